//! Whatever the claim answers — claimed, duplicate, conflict, in progress, a database error,
//! or a claim cancelled while it waits — the connection it used must go back to the pool
//! outside any transaction (a duplicate's empty transaction is dropped, and rolled back in a
//! task of its own before the connection goes back), a waiting claim must hold no connection, and
//! the answer must carry the recorded row exactly.
//!
//! Each test gives the inbox a pool of one connection, so the next statement on that pool
//! runs on the very connection the claim used; another connection checks that statement
//! committed and that no backend was left inside a transaction. The same connection also
//! shows the plan of the claim the crate prepared on it.
//! (Over 400 lines: one test per answer of the claim, each with the checks of its connection.)

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::TestApp;
use sqlx::{Connection, PgConnection, PgPool};
use tower_inbox::fingerprint::Fingerprint;
use tower_inbox::inbox::{Claim, ClaimedMessage, Inbox, InboxError, RecordedResponse};
use tower_inbox::{MessageIdentity, MessageKey, Producer};

/// An identity whose every part needs care in SQL text: quotes, backslashes, non-ASCII.
fn identity(key: &str) -> MessageIdentity {
    MessageIdentity::new(
        "consumer 'o\\ne' ✓",
        Producer::new("pay'ments\\")
            .unwrap()
            .with_tenant("t€nant\"")
            .unwrap(),
        MessageKey::new(key).unwrap(),
    )
}

/// A response whose headers and body hold every byte a text encoding could mangle.
fn response() -> RecordedResponse {
    RecordedResponse {
        status: 201,
        headers: vec![
            ("content-type".to_owned(), b"application/json".to_vec()),
            ("x-odd".to_owned(), b"a,b {c} \"d\" \\e 'f' NULL".to_vec()),
            ("x-bytes".to_owned(), (0x80..=0xff).collect()),
            ("x-empty".to_owned(), Vec::new()),
            // An array element spelled NULL reads as a null in an array's text form.
            ("NULL".to_owned(), b"NULL".to_vec()),
        ],
        body: Bytes::from((0..=255u8).collect::<Vec<u8>>()),
    }
}

/// Commits an autocommit insert on `pool` (its only connection), then checks from another
/// connection that it is visible and that no backend of the database is inside a
/// transaction: the claim's connection went back clean.
async fn assert_pool_connection_clean(app: &TestApp, pool: &PgPool, marker: i32) {
    assert_clean(app, pool, marker, 0).await;
}

/// [`assert_pool_connection_clean`] while one other connection deliberately holds a claim:
/// exactly that one backend is in a transaction.
async fn assert_pool_connection_clean_but_for_holder(app: &TestApp, pool: &PgPool, marker: i32) {
    assert_clean(app, pool, marker, 1).await;
}

async fn assert_clean(app: &TestApp, pool: &PgPool, marker: i32, holders: usize) {
    sqlx::query("insert into probe values ($1)")
        .bind(marker)
        .execute(pool)
        .await
        .expect("the pooled connection runs statements");
    let mut other = PgConnection::connect(app.db.url()).await.expect("connect");
    let seen: i64 = sqlx::query_scalar("select count(*) from probe where id = $1")
        .bind(marker)
        .fetch_one(&mut other)
        .await
        .expect("probe");
    assert_eq!(seen, 1, "the insert committed on its own");
    let in_transaction: Vec<String> = sqlx::query_scalar(
        "select query from pg_stat_activity
         where datname = current_database() and pid <> pg_backend_pid()
           and state like 'idle in transaction%'",
    )
    .fetch_all(&mut other)
    .await
    .expect("pg_stat_activity");
    assert_eq!(in_transaction.len(), holders, "{in_transaction:?}");
    // A holder is a claim made on purpose, its last statement the claim.
    for query in &in_transaction {
        assert!(query.contains("pg_try_advisory_xact_lock"), "{query}");
    }
}

/// Claims a key with a payload, waiting for no one.
async fn claim(inbox: &Inbox, key: &str, payload: &[u8]) -> Claim {
    inbox
        .claim(
            identity(key),
            Fingerprint::of_bytes(payload),
            "v1",
            Duration::ZERO,
        )
        .await
        .unwrap()
}

/// Claims a key that must be free.
async fn claimed(inbox: &Inbox, key: &str, wait: Duration) -> ClaimedMessage {
    let claim = inbox
        .claim(identity(key), Fingerprint::of_bytes(b"payload"), "v1", wait)
        .await
        .unwrap();
    match claim {
        Claim::Claimed(message) => message,
        other => panic!("{key} is free, yet: {other:?}"),
    }
}

async fn app_with_probe() -> (TestApp, PgPool) {
    let app = TestApp::new().await;
    sqlx::query("create table probe (id int)")
        .execute(&app.pool)
        .await
        .expect("probe table");
    let one = app.db.pool(1).await;
    (app, one)
}

#[tokio::test]
async fn a_duplicate_and_a_conflict_carry_the_recorded_row_and_leave_the_connection_clean() {
    let (app, pool) = app_with_probe().await;
    let inbox = Inbox::new(pool.clone());
    let fingerprint = Fingerprint::of_bytes(b"payload");

    let message = claimed(&inbox, "k1", Duration::ZERO).await;
    message.commit(Some(&response())).await.unwrap();
    assert_pool_connection_clean(&app, &pool, 1).await;

    match inbox
        .claim(identity("k1"), fingerprint, "v2", Duration::ZERO)
        .await
        .unwrap()
    {
        Claim::Duplicate(entry) => {
            assert_eq!(entry.payload_sha256, fingerprint.to_hex());
            assert_eq!(entry.handler_version, "v1");
            assert!(entry.processed);
            assert_eq!(entry.response, Some(response()));
        }
        other => panic!("expected a duplicate, got {other:?}"),
    }
    assert_pool_connection_clean(&app, &pool, 2).await;

    match claim(&inbox, "k1", b"another payload").await {
        Claim::Conflict(entry) => assert_eq!(entry.payload_sha256, fingerprint.to_hex()),
        other => panic!("expected a conflict, got {other:?}"),
    }
    assert_pool_connection_clean(&app, &pool, 3).await;

    // A record without a response replays as none.
    let message = claimed(&inbox, "k2", Duration::ZERO).await;
    message.commit(None).await.unwrap();
    match inbox
        .claim(identity("k2"), fingerprint, "v1", Duration::ZERO)
        .await
        .unwrap()
    {
        Claim::Duplicate(entry) => assert_eq!(entry.response, None),
        other => panic!("expected a duplicate, got {other:?}"),
    }
    assert_pool_connection_clean(&app, &pool, 4).await;
}

#[tokio::test]
async fn a_duplicate_reads_the_same_whatever_bytea_output_says() {
    let (app, _) = app_with_probe().await;
    app.set_for_new_sessions("bytea_output", "'escape'").await;
    // A new pool: its connections start with the database's setting.
    let pool = app.db.pool(1).await;
    let setting: String = sqlx::query_scalar("show bytea_output")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(setting, "escape");
    let inbox = Inbox::new(pool.clone());
    claimed(&inbox, "k", Duration::ZERO)
        .await
        .commit(Some(&response()))
        .await
        .unwrap();
    match claim(&inbox, "k", b"payload").await {
        Claim::Duplicate(entry) => assert_eq!(entry.response, Some(response())),
        other => panic!("expected a duplicate, got {other:?}"),
    }
    assert_pool_connection_clean(&app, &pool, 1).await;
}

#[tokio::test]
async fn a_claim_in_progress_elsewhere_leaves_the_connection_clean() {
    let (app, pool) = app_with_probe().await;
    let holder = Inbox::new(app.pool.clone());
    let inbox = Inbox::new(pool.clone());
    let fingerprint = Fingerprint::of_bytes(b"payload");
    let held = claimed(&holder, "k", Duration::ZERO).await;

    let claim = inbox
        .claim(identity("k"), fingerprint, "v1", Duration::from_millis(50))
        .await
        .unwrap();
    assert!(matches!(claim, Claim::InProgress), "{claim:?}");
    assert_pool_connection_clean_but_for_holder(&app, &pool, 1).await;

    // Rolled back, the key is free again, and the same pool claims it.
    held.rollback().await.unwrap();
    let message = claimed(&inbox, "k", Duration::ZERO).await;
    message.commit(None).await.unwrap();
    assert_pool_connection_clean(&app, &pool, 2).await;
}

#[tokio::test]
async fn a_waiting_claim_holds_no_connection_and_a_cancelled_one_leaves_nothing() {
    let (app, pool) = app_with_probe().await;
    let holder = Inbox::new(app.pool.clone());
    let inbox = Inbox::new(pool.clone());
    let fingerprint = Fingerprint::of_bytes(b"payload");
    let held = claimed(&holder, "k", Duration::ZERO).await;

    // The claim runs in a task of its own, so that it goes on polling while the test works.
    let waiting = tokio::spawn({
        let inbox = inbox.clone();
        async move {
            inbox
                .claim(identity("k"), fingerprint, "v1", Duration::from_secs(30))
                .await
        }
    });
    common::wait_until_waiting(&inbox, 1).await;
    // It waits in this process: the pool's only connection is free for other work.
    assert_pool_connection_clean_but_for_holder(&app, &pool, 1).await;
    assert!(
        !waiting.is_finished(),
        "the claim still waits for the holder"
    );
    waiting.abort();
    assert!(waiting.await.unwrap_err().is_cancelled());
    assert_eq!(
        inbox.waiting_claims(),
        0,
        "a cancelled claim no longer waits"
    );

    held.rollback().await.unwrap();
    assert_pool_connection_clean(&app, &pool, 2).await;
    let message = claimed(&inbox, "k", Duration::ZERO).await;
    message.commit(None).await.unwrap();
    assert_pool_connection_clean(&app, &pool, 3).await;
}

#[tokio::test]
async fn a_failing_claim_reports_its_error_and_leaves_the_connection_clean() {
    let (app, pool) = app_with_probe().await;
    sqlx::raw_sql(
        "create function public.refuse() returns trigger language plpgsql as
             $$ begin raise exception 'refused' using errcode = 'P0001'; end $$;
         create trigger refuse before insert on tower_inbox.consumer_inbox
             for each row execute function public.refuse();",
    )
    // A trigger on the crate's table is the owner's to create.
    .execute(&app.owner)
    .await
    .expect("trigger");
    let inbox = Inbox::new(pool.clone());
    let err = inbox
        .claim(
            identity("k"),
            Fingerprint::of_bytes(b"payload"),
            "v1",
            Duration::ZERO,
        )
        .await
        .expect_err("the insert is refused");
    match &err {
        InboxError::Database(sqlx::Error::Database(db)) => {
            assert_eq!(db.code().as_deref(), Some("P0001"), "{db}")
        }
        other => panic!("expected the database's own error, got {other:?}"),
    }
    assert_pool_connection_clean(&app, &pool, 1).await;
}

/// The names of an identity travel as UTF-8 bytes and are decoded by the server: for any
/// consumer name, the row the claim wrote is the row the lookup finds, and a second claim
/// reads it back as a duplicate. A NUL, which PostgreSQL text cannot hold, is an error.
#[test]
fn any_consumer_name_round_trips_through_the_claim() {
    use proptest::prelude::*;
    use proptest::test_runner::{Config, TestRunner};

    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let (app, pool) = rt.block_on(app_with_probe());
    let names = prop_oneof![
        "\\PC{0,24}",
        "[\\\\'\"$E\\x01-\\x1f]{0,12}",
        Just("E'\\\\'; select 1; --".to_owned()),
    ];
    let mut runner = TestRunner::new(Config {
        cases: 48,
        ..Config::default()
    });
    let n = std::sync::atomic::AtomicU32::new(0);
    runner
        .run(&names, |name| {
            let key = format!("k{}", n.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
            let identity = MessageIdentity::new(
                name.as_str(),
                Producer::new("p").unwrap(),
                MessageKey::new(&key).unwrap(),
            );
            rt.block_on(async {
                let inbox = Inbox::new(pool.clone());
                let fingerprint = Fingerprint::of_bytes(name.as_bytes());
                let claim = inbox
                    .claim(identity.clone(), fingerprint, "v1", Duration::ZERO)
                    .await
                    .unwrap();
                let Claim::Claimed(message) = claim else {
                    panic!("{name:?}: a new key is claimed: {claim:?}");
                };
                message.commit(Some(&response())).await.unwrap();
                let entry = inbox.lookup(&identity).await.unwrap();
                prop_assert_eq!(
                    entry.and_then(|e| e.response),
                    Some(response()),
                    "{:?}",
                    name
                );
                let again = inbox
                    .claim(identity, fingerprint, "v1", Duration::ZERO)
                    .await
                    .unwrap();
                prop_assert!(
                    matches!(again, Claim::Duplicate(_)),
                    "{:?}: {:?}",
                    name,
                    again
                );
                Ok(())
            })
        })
        .unwrap();

    rt.block_on(async {
        let identity = MessageIdentity::new(
            "nul\0inside",
            Producer::new("p").unwrap(),
            MessageKey::new("k").unwrap(),
        );
        let err = Inbox::new(pool.clone())
            .claim(identity, Fingerprint::of_bytes(b"x"), "v1", Duration::ZERO)
            .await
            .expect_err("no text holds a NUL");
        assert!(matches!(err, InboxError::Database(_)), "{err:?}");
        assert_pool_connection_clean(&app, &pool, 1).await;
    });
}

/// The generic plan (the one a statement cached per connection runs from) of the statement
/// this connection prepared whose text is like `like`, run with `arguments` of `types`.
async fn generic_plan(conn: &mut PgConnection, like: &str, types: &str, arguments: &str) -> String {
    let statement: String =
        sqlx::query_scalar("select statement from pg_prepared_statements where statement like $1")
            .bind(like)
            .fetch_one(&mut *conn)
            .await
            .unwrap_or_else(|e| panic!("no prepared statement like {like}: {e}"));
    // The generic plan is the one the crate's cached statement gets.
    sqlx::raw_sql(&format!(
        "prepare plan_of ({types}) as {statement}; set plan_cache_mode = force_generic_plan"
    ))
    .execute(&mut *conn)
    .await
    .expect("prepare");
    let plan: Vec<String> =
        sqlx::query_scalar(&format!("explain (costs off) execute plan_of({arguments})"))
            .fetch_all(&mut *conn)
            .await
            .expect("explain");
    sqlx::raw_sql("deallocate plan_of; reset plan_cache_mode")
        .execute(&mut *conn)
        .await
        .expect("clean up");
    plan.join("\n")
}

/// The claim tries the key's lock as the one-time condition of a `SELECT` without `FROM`,
/// evaluated once before the row reaches the insert: its plan shows the lock as the
/// "One-Time Filter" of the `Result` node the insert reads, and no scan the lock could run
/// in once per row, nor a `Subquery Scan` between the `SELECT` and the insert. The record
/// finds the claimed row where the claim put it (a `Tid Scan`), not through the primary key.
/// Read from the statements the crate prepared on its one connection.
#[tokio::test]
async fn the_claim_tries_the_lock_once_as_a_one_time_filter_and_the_record_finds_its_row() {
    let app = TestApp::new().await;
    let inbox = Inbox::new(app.pool_with(1, &[]));
    let message = claimed(&inbox, "plan", Duration::ZERO).await;
    message.commit(Some(&response())).await.expect("commit");
    let mut conn = inbox
        .pool()
        .acquire()
        .await
        .expect("the claim's connection");
    let claim = generic_plan(
        &mut conn,
        "insert into %consumer_inbox %",
        "bytea, bytea, bytea, text, text, bytea, int4, int4",
        "'c', 'p', '', 'k', 's', 'v', 1, 2",
    )
    .await;
    assert!(
        claim.contains("One-Time Filter: pg_try_advisory_xact_lock($7, $8)"),
        "{claim}"
    );
    assert!(
        !claim.contains("CTE") && !claim.contains("Subquery Scan"),
        "{claim}"
    );
    let record = generic_plan(
        &mut conn,
        "update %consumer_inbox i set processed_at%",
        "text, text, int2, text[], bytea[], bytea",
        "'(0,1)', 'k', 201, '{}', '{}', ''",
    )
    .await;
    assert!(record.contains("Tid Scan on consumer_inbox i"), "{record}");
    assert!(!record.contains("Index"), "{record}");
}

/// The claim at commit names every column, so that the planner drops the `Subquery Scan`
/// that the `SELECT`'s volatile `clock_timestamp()` would otherwise keep between it and the
/// insert.
#[tokio::test]
async fn the_claim_at_commit_has_no_subquery_scan() {
    let app = TestApp::with_pool_size(1).await;
    let router = app.credits_with(|b| b.claim_mode(tower_inbox::inbox::ClaimMode::AtCommit));
    let reply = common::send(&router, common::credit("a1", Some("k1"), Some("app"), 3)).await;
    assert_eq!(reply.status, http::StatusCode::CREATED);
    let mut conn = app.pool.acquire().await.expect("the claim's connection");
    let claim = generic_plan(
        &mut conn,
        "insert into %consumer_inbox %",
        "bytea, bytea, bytea, text, text, bytea, int4, int4, int2, text[], bytea[], bytea",
        "'c', 'p', '', 'k', 's', 'v', 1, 2, 201, '{}', '{}', ''",
    )
    .await;
    assert!(
        claim.contains("One-Time Filter: pg_try_advisory_xact_lock($7, $8)"),
        "{claim}"
    );
    assert!(!claim.contains("Subquery Scan"), "{claim}");
}
