//! The service's database sessions ended under load with `pg_terminate_backend`: at random,
//! and while they run `COMMIT`, when the service cannot know whether its commit happened.

use std::time::{Duration, Instant};

use sqlx::{Connection, PgConnection};
use tower_inbox_testdb::TestDatabase;

use crate::checker::check;
use crate::{scaled, under_load};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backends_terminated_at_random_and_during_commit() {
    let db = TestDatabase::create().await.expect("a test database");
    let (receiver, _service, load, mut rng) = under_load("backends", db.url(), "term").await;
    let mut admin = PgConnection::connect(db.url()).await.expect("connect");

    let rounds = scaled(40, 400);
    let (mut at_random, mut during_commit, mut commit_rounds) = (0i64, 0i64, 0);
    for round in 0..rounds {
        tokio::time::sleep(rng.millis(50, 300)).await;
        if round % 2 == 0 {
            at_random += terminate(&mut admin, "true").await;
            continue;
        }
        // Polled until a session is caught in COMMIT (bounded): the window is short.
        commit_rounds += 1;
        let deadline = Instant::now() + Duration::from_millis(500);
        while Instant::now() < deadline {
            let ended = terminate(&mut admin, "state = 'active' and query = 'COMMIT'").await;
            if ended > 0 {
                during_commit += ended;
                break;
            }
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let records = load.stop().await;
    admin.close().await.expect("close");

    let pool = db.pool(4).await;
    let faults = format!(
        "{at_random} sessions ended at random in {} rounds, {during_commit} during COMMIT \
         (caught in {commit_rounds} tries)",
        rounds - commit_rounds
    );
    assert!(
        during_commit > 0,
        "backends: no session was ever caught in COMMIT"
    );
    check("backends", &faults, &pool, &records, &receiver).await;
}

/// Ends one session of the database (not `admin`'s) that satisfies `filter`; returns how
/// many it ended (0 or 1).
async fn terminate(admin: &mut PgConnection, filter: &str) -> i64 {
    let sql = format!(
        "select count(*) from (select pg_catalog.pg_terminate_backend(pid) from pg_stat_activity \
         where datname = current_database() and pid <> pg_backend_pid() \
           and backend_type = 'client backend' and {filter} \
         order by random() limit 1) ended"
    );
    sqlx::query_scalar(&sql)
        .fetch_one(admin)
        .await
        .expect("terminate a backend")
}
