//! The service process SIGKILLed at random points under retrying clients, again and again,
//! and started again each time: what a crash loop or an OOM killer does.

use std::time::Duration;

use tower_inbox_testdb::TestDatabase;

use crate::checker::check;
use crate::{scaled, under_load};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_again_and_again_nothing_is_lost_or_doubled() {
    let db = TestDatabase::create().await.expect("a test database");
    let (receiver, mut service, load, mut rng) = under_load("kill_loop", db.url(), "kill").await;

    let kills = scaled(20, 200);
    let mut answered_before_kill = Vec::new();
    for _ in 0..kills {
        tokio::time::sleep(rng.millis(100, 800)).await;
        answered_before_kill.push(load.finished());
        service.kill();
        tokio::time::sleep(rng.millis(0, 300)).await;
        service.start().await;
    }
    // Some load on the last process, then the clients finish what they are retrying.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let records = load.stop().await;

    let pool = db.pool(4).await;
    let faults = format!(
        "{kills} SIGKILLs, {} starts, commands finished before each kill: {answered_before_kill:?}",
        service.starts
    );
    check("kill_loop", &faults, &pool, &records, &receiver).await;
}
