//! The network between the service and PostgreSQL fails: added latency, every connection
//! cut at once, a `COMMIT` that never reaches the server, and the answer to a `COMMIT`
//! that did (the service cannot know whether it committed). A TCP proxy in the test does
//! it ([`Proxy`]).

use std::time::Duration;

use tower_inbox_testdb::TestDatabase;

use crate::checker::check;
use crate::common::proxy::{Cut, Proxy};
use crate::{scaled, under_load};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn latency_cuts_and_lost_commit_answers() {
    let db = TestDatabase::create().await.expect("a test database");
    let options = db.connect_options();
    let upstream = tokio::net::lookup_host((options.get_host(), options.get_port()))
        .await
        .expect("resolve the database server")
        .next()
        .expect("an address of the database server");
    let proxy = Proxy::start(upstream).await;
    let through_proxy = format!(
        "postgres://{}@{}/{}",
        options.get_username(),
        proxy.addr(),
        options.get_database().expect("the test database's name")
    );
    let (receiver, _service, load, mut rng) = under_load("network", &through_proxy, "net").await;

    let rounds = scaled(6, 60);
    let (mut cut, mut commit_lost, mut answer_lost) = (0, 0, 0);
    for _ in 0..rounds {
        // Latency: every message waits before it is passed on.
        proxy.set_latency(rng.millis(1, 20));
        tokio::time::sleep(rng.millis(300, 800)).await;
        proxy.set_latency(Duration::ZERO);
        // Every connection cut at once.
        cut += proxy.cut_all();
        tokio::time::sleep(rng.millis(200, 500)).await;
        // A COMMIT that never reaches the server: rolled back there.
        proxy.arm(b"COMMIT", Cut::Before);
        proxy.cut_done().await;
        commit_lost += 1;
        tokio::time::sleep(rng.millis(100, 400)).await;
        // The answer to a COMMIT the server carried out: committed, unbeknown to the service.
        proxy.arm(b"COMMIT", Cut::After);
        proxy.cut_done().await;
        answer_lost += 1;
        tokio::time::sleep(rng.millis(100, 400)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let records = load.stop().await;

    let pool = db.pool(4).await;
    let faults = format!(
        "{rounds} rounds of latency; {cut} connections cut at once, {commit_lost} COMMITs \
         lost on the way, {answer_lost} COMMIT answers lost; {} connections made through \
         the proxy",
        proxy.connections()
    );
    check("network", &faults, &pool, &records, &receiver).await;
}
