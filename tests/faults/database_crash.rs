//! PostgreSQL itself crashes under load (`pg_ctl stop -m immediate`: no shutdown
//! checkpoint, crash recovery on the next start) and comes back on the same port; the
//! service is not restarted and must recover by itself.

use std::sync::Arc;
use std::time::Duration;

use tower_inbox_testdb::Cluster;

use crate::checker::check;
use crate::{scaled, under_load};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_database_crashes_and_recovers_under_load() {
    let cluster = Arc::new(Cluster::builder().start().await.expect("a private cluster"));
    let db = cluster.database().await.expect("a database");
    let (receiver, service, load, mut rng) = under_load("database_crash", db.url(), "crash").await;

    let crashes = scaled(3, 20);
    let mut down_ms = Vec::new();
    for _ in 0..crashes {
        tokio::time::sleep(rng.millis(1000, 2500)).await;
        let c = cluster.clone();
        tokio::task::spawn_blocking(move || c.crash())
            .await
            .expect("the crash task")
            .expect("crash the server");
        let down = rng.millis(0, 1500);
        tokio::time::sleep(down).await;
        let c = cluster.clone();
        tokio::task::spawn_blocking(move || c.start_again())
            .await
            .expect("the start task")
            .expect("start the server again");
        down_ms.push(down.as_millis());
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let records = load.stop().await;

    let pool = db.pool(4).await;
    let faults = format!(
        "{crashes} crashes (immediate stop), down for {down_ms:?} ms plus recovery; the \
         service was started {} time(s)",
        service.starts
    );
    check("database_crash", &faults, &pool, &records, &receiver).await;
    assert_eq!(service.starts, 1, "the service was restarted");
}
