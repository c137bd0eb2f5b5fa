//! Failover to a synchronous standby: the service reaches PostgreSQL through PgBouncer (its
//! one address), the primary is SIGKILLed under load, the standby is promoted and PgBouncer
//! pointed at it and reloaded. The service is not restarted. Every command a client saw
//! acknowledged is on the new primary, and nothing is doubled there.
//!
//! sqlx takes one host per URL, so an application follows a failover through an address
//! that moves: a pooler (this test), a virtual IP or a DNS name. The layer re-runs a command
//! whose connection was lost, and the pool opens new connections to the address.

use std::sync::Arc;
use std::time::Duration;

use tower_inbox_testdb::{Cluster, PgBouncer, PoolMode};

use crate::checker::check;
use crate::under_load;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_primary_dies_and_the_synchronous_standby_takes_over() {
    let primary = Arc::new(Cluster::builder().start().await.expect("the primary"));
    let db = primary.database().await.expect("a database");
    let p = primary.clone();
    let standby = tokio::task::spawn_blocking(move || p.standby())
        .await
        .expect("the standby task")
        .expect("a standby");
    primary
        .require_synchronous_standby()
        .await
        .expect("a synchronous standby");
    let bouncer = PgBouncer::start(primary.port(), PoolMode::Session).expect("PgBouncer");

    let (receiver, service, load, mut rng) =
        under_load("failover", &bouncer.url(db.name()), "failover").await;
    tokio::time::sleep(rng.millis(1500, 3000)).await;
    let before = load.finished();
    let p = primary.clone();
    tokio::task::spawn_blocking(move || p.kill())
        .await
        .expect("the kill task")
        .expect("SIGKILL the primary");
    // A failover script's pause before it decides the primary is gone.
    tokio::time::sleep(rng.millis(200, 1000)).await;
    let standby = Arc::new(standby);
    let s = standby.clone();
    tokio::task::spawn_blocking(move || s.promote())
        .await
        .expect("the promote task")
        .expect("promote the standby");
    bouncer
        .point_at(standby.port())
        .expect("point PgBouncer at the new primary");
    let at_failover = load.finished();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let records = load.stop().await;

    let pool = sqlx::PgPool::connect(&standby.server().database_url(db.name()))
        .await
        .expect("connect to the new primary");
    let faults = format!(
        "primary SIGKILLed after {before} commands, standby promoted and PgBouncer reloaded \
         after {at_failover}; the service was started {} time(s)",
        service.starts
    );
    check("failover", &faults, &pool, &records, &receiver).await;
    assert_eq!(service.starts, 1, "the service was restarted");
    pool.close().await;
    drop(bouncer);
    // The dead primary's database goes with its cluster.
    drop(primary);
}
