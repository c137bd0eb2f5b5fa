//! Several instances of the service on one database, as a scaled-out deployment runs:
//! three processes behind round-robin clients (a retry goes to the next instance), each
//! with its own outbox dispatcher, while instances are SIGKILLed and started again and
//! database sessions are ended.

use std::time::Duration;

use sqlx::{Connection, PgConnection};
use tower_inbox_testdb::TestDatabase;

use crate::checker::check;
use crate::clients::Load;
use crate::receiver::Receiver;
use crate::service::Service;
use crate::{scaled, Rng};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_instances_with_kills_and_terminations() {
    let db = TestDatabase::create().await.expect("a test database");
    let receiver = Receiver::start().await;
    let mut services: Vec<Service> = (0..3)
        .map(|n| Service::new(&format!("instance-{n}"), db.url(), receiver.url()))
        .collect();
    for service in &mut services {
        service.start().await;
    }
    let bases: Vec<String> = services.iter().map(|s| s.url("")).collect();
    let load = Load::round_robin(&bases, "inst", 6);
    let mut rng = Rng::from_clock("instances");
    let mut admin = PgConnection::connect(db.url()).await.expect("connect");

    let rounds = scaled(15, 150);
    let (mut kills, mut terminated) = (vec![0; 3], 0i64);
    for _ in 0..rounds {
        tokio::time::sleep(rng.millis(150, 600)).await;
        let victim = rng.between(0, 3) as usize;
        services[victim].kill();
        kills[victim] += 1;
        terminated += sqlx::query_scalar::<_, i64>(
            "select count(*) from (select pg_catalog.pg_terminate_backend(pid) \
             from pg_stat_activity where datname = current_database() \
               and pid <> pg_backend_pid() and backend_type = 'client backend' \
             order by random() limit 2) ended",
        )
        .fetch_one(&mut admin)
        .await
        .expect("terminate backends");
        tokio::time::sleep(rng.millis(0, 300)).await;
        services[victim].start().await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let records = load.stop().await;
    admin.close().await.expect("close");

    let pool = db.pool(4).await;
    let faults = format!(
        "3 instances; SIGKILLs per instance {kills:?}; {terminated} database sessions ended"
    );
    check("instances", &faults, &pool, &records, &receiver).await;
}
