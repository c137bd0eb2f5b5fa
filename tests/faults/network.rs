//! The network between the service and PostgreSQL fails: added latency, every connection
//! cut at once, a `COMMIT` that never reaches the server, the answer to a `COMMIT` that did
//! (the service cannot know whether it committed), and half-open connections that stop
//! forwarding without closing. A TCP proxy in the test does it ([`Proxy`]).

use std::time::Duration;

use tower_inbox_testdb::TestDatabase;

use crate::checker::check;
use crate::common::proxy::{Cut, Proxy};
use crate::{scaled, under_load};

/// The test database, and its URL through a new proxy.
async fn behind_proxy(db: &TestDatabase) -> (Proxy, String) {
    let options = db.connect_options();
    let proxy = Proxy::in_front_of(&options).await;
    let through_proxy = format!(
        "postgres://{}@{}/{}",
        options.get_username(),
        proxy.addr(),
        options.get_database().expect("the test database's name")
    );
    (proxy, through_proxy)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn latency_cuts_and_lost_commit_answers() {
    let db = TestDatabase::create().await.expect("a test database");
    let (proxy, through_proxy) = behind_proxy(&db).await;
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

/// Every connection between service and database stops forwarding at once and never closes,
/// neither end hearing of it: statements in flight get no answer, `COMMIT`s included, and
/// the pool's idle connections are dead too. The service must give up on them (its
/// statement deadline), close them rather than return them to its pool, and serve on new
/// connections; the server ends the stalled sessions' transactions, which hold the claims
/// of the commands they ran, after `idle_in_transaction_session_timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_open_connections() {
    let db = TestDatabase::create().await.expect("a test database");
    let pool = db.pool(4).await;
    let database = db.connect_options();
    let database = database.get_database().expect("the test database's name");
    sqlx::query(&format!(
        "alter database \"{database}\" set idle_in_transaction_session_timeout = '3s'"
    ))
    .execute(&pool)
    .await
    .expect("set the idle-in-transaction timeout");
    let (proxy, through_proxy) = behind_proxy(&db).await;
    let (receiver, _service, load, mut rng) =
        under_load("half-open", &through_proxy, "stall").await;

    let rounds = scaled(3, 20);
    let (mut stalled, mut commits_stalled) = (0, 0);
    for _ in 0..rounds {
        tokio::time::sleep(rng.millis(500, 1500)).await;
        // One connection goes half-open as it sends a COMMIT: the service cannot know
        // whether it committed (it did not), and answers 503 with a retry safe.
        proxy.arm(b"COMMIT", Cut::Stall);
        proxy.cut_done().await;
        commits_stalled += 1;
        tokio::time::sleep(rng.millis(200, 600)).await;
        stalled += proxy.stall_all();
        // The stalled connections stay stalled: statements in flight on them, and those sent
        // on them later from the pool, meet the service's statement deadline (10 s).
        tokio::time::sleep(rng.millis(2000, 4000)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let records = load.stop().await;

    let faults = format!(
        "{rounds} rounds; {commits_stalled} connections left half-open at a COMMIT, \
         {stalled} more all at once (never closed); {} connections made through the proxy",
        proxy.connections()
    );
    check("half-open", &faults, &pool, &records, &receiver).await;
}
