//! Serialization failures, deadlocks and requested re-runs: the transaction is rolled back and
//! the handler runs again with the same request, within a bound, and every command still
//! commits at most once. Also the claim under each isolation level.
//! (Over 400 lines: one test per kind of transient failure, over shared handlers.)

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use axum::extract::Path;
use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use common::{credit, send, TestApp};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use tokio::sync::Barrier;
use tower_inbox::fingerprint::Fingerprint;
use tower_inbox::inbox::{
    Claim, ClaimMode, ClaimedMessage, Inbox, InboxError, IsolationLevel, RetryReason,
    TransientRetry,
};
use tower_inbox::producer::TrustedHeader;
use tower_inbox::{InboxLayer, InboxLayerBuilder, InboxTx, MessageIdentity, MessageKey, Producer};

/// Counters recorded in this test binary, accumulated: a debugging snapshot drains what it
/// reads, so every read goes through here. Tests tell their series apart by consumer name.
fn counter(name: &str, labels: &[(&str, &str)]) -> u64 {
    static RECORDER: OnceLock<(Snapshotter, Mutex<HashMap<String, u64>>)> = OnceLock::new();
    let (snapshotter, totals) = RECORDER.get_or_init(|| {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        recorder
            .install()
            .expect("the only recorder in this binary");
        (snapshotter, Mutex::new(HashMap::new()))
    });
    let mut totals = totals.lock().expect("totals");
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        if let DebugValue::Counter(n) = value {
            let key = key.key();
            let mut labels: Vec<String> = key
                .labels()
                .map(|l| format!("{}={}", l.key(), l.value()))
                .collect();
            labels.sort();
            *totals
                .entry(format!("{}{{{}}}", key.name(), labels.join(",")))
                .or_default() += n;
        }
    }
    let mut wanted: Vec<String> = labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
    wanted.sort();
    totals
        .get(&format!("{name}{{{}}}", wanted.join(",")))
        .copied()
        .unwrap_or(0)
}

/// Makes sure the recorder is installed before anything is recorded.
fn start_recording() {
    counter("none", &[]);
}

fn retries(consumer: &str, reason: &str) -> u64 {
    counter(
        "inbox_transaction_retries_total",
        &[("consumer", consumer), ("reason", reason)],
    )
}

fn layer(
    pool: &sqlx::PgPool,
    consumer: &str,
    configure: impl FnOnce(InboxLayerBuilder) -> InboxLayerBuilder,
) -> InboxLayer {
    configure(
        InboxLayer::builder(pool.clone(), consumer).producer(TrustedHeader::new("x-producer")),
    )
    .build()
    .expect("layer")
}

fn command(key: &str) -> axum::http::Request<axum::body::Body> {
    axum::http::Request::post("/run")
        .header("idempotency-key", key)
        .header("x-producer", "app")
        .body(axum::body::Body::from("{}"))
        .expect("request")
}

/// How many rows `table` holds with `message_id`.
async fn rows(app: &TestApp, table: &str, message_id: &str) -> i64 {
    sqlx::query_scalar(&format!(
        "select count(*) from {table} where message_id = $1"
    ))
    .bind(message_id)
    .fetch_one(&app.pool)
    .await
    .expect("count")
}

#[tokio::test]
async fn write_skew_under_serializable_is_rerun_and_each_command_commits_once() {
    start_recording();
    let app = TestApp::new().await;
    sqlx::query("create table on_call (message_id text not null, doctor int not null)")
        .execute(&app.pool)
        .await
        .unwrap();
    // Both first runs read the roster before either writes: a classic write skew, which
    // SERIALIZABLE refuses by failing one of them with 40001 (at its write or its commit).
    let barrier = Arc::new(Barrier::new(2));
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = {
        let (barrier, runs) = (barrier.clone(), runs.clone());
        move |mut tx: InboxTx| {
            let (barrier, runs) = (barrier.clone(), runs.clone());
            async move {
                let run = runs.fetch_add(1, Ordering::SeqCst);
                let on_call: i64 = match sqlx::query_scalar("select count(*) from on_call")
                    .fetch_one(&mut *tx)
                    .await
                {
                    Ok(n) => n,
                    Err(_) => return StatusCode::INTERNAL_SERVER_ERROR,
                };
                if run < 2 {
                    tokio::time::timeout(Duration::from_secs(20), barrier.wait())
                        .await
                        .expect("both first runs reach the barrier");
                }
                let id = tx.identity().message_id().as_str().to_owned();
                let inserted = sqlx::query("insert into on_call values ($1, $2)")
                    .bind(&id)
                    .bind(on_call as i32)
                    .execute(&mut *tx)
                    .await;
                // A real handler maps the error to a 500; the layer still sees the 40001.
                match inserted {
                    Ok(_) => StatusCode::CREATED,
                    Err(_) => StatusCode::INTERNAL_SERVER_ERROR,
                }
            }
        }
    };
    let consumer = "skew";
    let router =
        Router::new()
            .route("/run", post(handler))
            .layer(layer(&app.pool, consumer, |b| {
                b.isolation_level(IsolationLevel::Serializable)
            }));
    let (a, b) = tokio::join!(send(&router, command("a")), send(&router, command("b")));
    assert_eq!(
        (a.status, b.status),
        (StatusCode::CREATED, StatusCode::CREATED)
    );
    assert_eq!(runs.load(Ordering::SeqCst), 3, "one of the two ran twice");
    for key in ["a", "b"] {
        assert_eq!(rows(&app, "on_call", key).await, 1, "{key} applied once");
        assert_eq!(rows(&app, "tower_inbox.consumer_inbox", key).await, 1);
    }
    // The re-run saw the other's committed row: serial order restored.
    let seen: Vec<i32> = sqlx::query_scalar("select doctor from on_call order by doctor")
        .fetch_all(&app.pool)
        .await
        .unwrap();
    assert_eq!(seen, vec![0, 1]);
    assert_eq!(retries(consumer, "serialization-failure"), 1);
    assert_eq!(app.failures("app", "a").await, None);
    assert_eq!(app.failures("app", "b").await, None);
}

#[tokio::test]
async fn a_deadlock_between_two_handlers_is_rerun_and_both_commit_once() {
    start_recording();
    let app = TestApp::new().await;
    // Detect the deadlock fast. deadlock_timeout is a superuser's setting, which the
    // service's role may not set: the owner sets it for the database's new sessions, before
    // the service's pool opens any.
    app.set_for_new_sessions("deadlock_timeout", "'50ms'").await;
    sqlx::raw_sql(
        "create table slot (id text primary key, taken_by text[] not null default '{}');
         insert into slot (id) values ('x'), ('y');",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let barrier = Arc::new(Barrier::new(2));
    let runs = Arc::new(AtomicUsize::new(0));
    // Command "xy" locks x then y, command "yx" locks y then x: after the barrier each waits
    // for the other, and PostgreSQL kills one of them with 40P01.
    let handler = {
        let (barrier, runs) = (barrier.clone(), runs.clone());
        move |Path(order): Path<String>, mut tx: InboxTx| {
            let (barrier, runs) = (barrier.clone(), runs.clone());
            async move {
                let run = runs.fetch_add(1, Ordering::SeqCst);
                let id = tx.identity().message_id().as_str().to_owned();
                for (i, slot) in order.chars().enumerate() {
                    if i == 1 && run < 2 {
                        tokio::time::timeout(Duration::from_secs(20), barrier.wait())
                            .await
                            .expect("both first runs hold their first lock");
                    }
                    let taken =
                        sqlx::query("update slot set taken_by = taken_by || $2 where id = $1")
                            .bind(slot.to_string())
                            .bind(&id)
                            .execute(&mut *tx)
                            .await;
                    if taken.is_err() {
                        return StatusCode::INTERNAL_SERVER_ERROR;
                    }
                }
                StatusCode::CREATED
            }
        }
    };
    let consumer = "deadlock";
    let router = Router::new()
        .route("/slots/{order}", post(handler))
        .layer(layer(&app.pool, consumer, |b| b));
    let request = |order: &str| {
        axum::http::Request::post(format!("/slots/{order}"))
            .header("idempotency-key", order)
            .header("x-producer", "app")
            .body(axum::body::Body::empty())
            .unwrap()
    };
    let (xy, yx) = tokio::join!(send(&router, request("xy")), send(&router, request("yx")));
    assert_eq!(
        (xy.status, yx.status),
        (StatusCode::CREATED, StatusCode::CREATED)
    );
    assert_eq!(runs.load(Ordering::SeqCst), 3, "the victim ran twice");
    let taken: Vec<(String, Vec<String>)> =
        sqlx::query_as("select id, taken_by from slot order by id")
            .fetch_all(&app.pool)
            .await
            .unwrap();
    for (slot, by) in &taken {
        let mut by = by.clone();
        by.sort();
        assert_eq!(
            by,
            vec!["xy", "yx"],
            "slot {slot} taken once by each command"
        );
    }
    assert_eq!(retries(consumer, "deadlock"), 1);
    assert_eq!(app.inbox_rows().await, 2);
}

#[tokio::test]
async fn a_serialization_failure_at_commit_is_rerun() {
    start_recording();
    let app = TestApp::new().await;
    // A deferred constraint trigger fails the first two commits with 40001, as SSI does
    // when it finds the dangerous structure only at commit. A sequence counts them: unlike a
    // table it is not rolled back with the failing commit.
    sqlx::raw_sql(
        "create sequence commit_attempts;
         create table applied (message_id text not null);
         create function fail_at_commit() returns trigger language plpgsql as $$
         begin
             if nextval('commit_attempts') <= 2 then
                 raise exception 'forced serialization failure' using errcode = '40001';
             end if;
             return null;
         end $$;
         create constraint trigger fail_at_commit after insert on applied
             deferrable initially deferred for each row execute function fail_at_commit();",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = {
        let runs = runs.clone();
        move |mut tx: InboxTx| {
            let runs = runs.clone();
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                let id = tx.identity().message_id().as_str().to_owned();
                sqlx::query("insert into applied values ($1)")
                    .bind(id)
                    .execute(&mut *tx)
                    .await
                    .expect("insert");
                (StatusCode::CREATED, "applied")
            }
        }
    };
    let consumer = "commit-conflict";
    let router =
        Router::new()
            .route("/run", post(handler))
            .layer(layer(&app.pool, consumer, |b| b));
    let reply = send(&router, command("k")).await;
    assert_eq!(reply.status, StatusCode::CREATED);
    assert_eq!(&reply.body[..], b"applied");
    assert_eq!(runs.load(Ordering::SeqCst), 3);
    assert_eq!(rows(&app, "applied", "k").await, 1);
    assert_eq!(retries(consumer, "serialization-failure"), 2);
    // The committed answer is what a duplicate gets.
    let again = send(&router, command("k")).await;
    assert!(again.replayed());
    assert_eq!(runs.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn a_requested_rerun_runs_the_handler_again_with_the_same_request() {
    start_recording();
    let app = TestApp::new().await;
    sqlx::query("create table applied (message_id text not null, body text not null)")
        .execute(&app.pool)
        .await
        .unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = {
        let runs = runs.clone();
        move |mut tx: InboxTx, body: String| {
            let runs = runs.clone();
            async move {
                let run = runs.fetch_add(1, Ordering::SeqCst);
                let id = tx.identity().message_id().as_str().to_owned();
                // The handler asks for the re-run itself.
                sqlx::query("insert into applied values ($1, $2)")
                    .bind(id)
                    .bind(body)
                    .execute(&mut *tx)
                    .await
                    .expect("insert");
                if run == 0 {
                    tx.request_retry();
                    // Even a committable answer does not commit a requested re-run.
                    return StatusCode::CREATED;
                }
                StatusCode::ACCEPTED
            }
        }
    };
    let consumer = "requested";
    let router =
        Router::new()
            .route("/run", post(handler))
            .layer(layer(&app.pool, consumer, |b| b));
    let reply = send(&router, command("k")).await;
    assert_eq!(reply.status, StatusCode::ACCEPTED);
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    let applied: Vec<String> = sqlx::query_scalar("select body from applied")
        .fetch_all(&app.pool)
        .await
        .unwrap();
    assert_eq!(
        applied,
        vec!["{}"],
        "the first run rolled back; the re-run saw the body"
    );
    assert_eq!(retries(consumer, "requested"), 1);
}

#[tokio::test]
async fn reruns_that_run_out_answer_503_and_commit_nothing() {
    start_recording();
    let app = TestApp::new().await;
    sqlx::query("create table applied (message_id text not null)")
        .execute(&app.pool)
        .await
        .unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = {
        let runs = runs.clone();
        move |mut tx: InboxTx| {
            let runs = runs.clone();
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                let id = tx.identity().message_id().as_str().to_owned();
                sqlx::query("insert into applied values ($1)")
                    .bind(id)
                    .execute(&mut *tx)
                    .await
                    .expect("insert");
                // Always conflicts: a serialization failure raised by a watched statement.
                let failed = sqlx::query(
                    "do $$ begin raise exception 'conflict' using errcode = '40001'; end $$",
                )
                .execute(&mut *tx)
                .await;
                assert!(failed.is_err());
                StatusCode::INTERNAL_SERVER_ERROR
            }
        }
    };
    let consumer = "exhausted";
    let retry = TransientRetry::new(4, Duration::from_millis(1), Duration::from_millis(5));
    let router =
        Router::new()
            .route("/run", post(handler))
            .layer(layer(&app.pool, consumer, |b| b.transient_retry(retry)));
    let reply = send(&router, command("k")).await;
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(reply.problem_type(), "transaction-conflict");
    assert_eq!(reply.headers["retry-after"], "1");
    assert_eq!(runs.load(Ordering::SeqCst), 4);
    assert_eq!(rows(&app, "applied", "k").await, 0);
    assert_eq!(app.inbox_rows().await, 0);
    assert_eq!(
        app.failures("app", "k").await,
        Some((1, "transaction-conflict".to_owned())),
        "one failed command, not one per run"
    );
    assert_eq!(retries(consumer, "serialization-failure"), 3);
    assert_eq!(
        counter(
            "inbox_handler_failures_total",
            &[("consumer", consumer), ("reason", "transaction-conflict")]
        ),
        1
    );

    // With re-runs turned off the first conflict is the answer.
    let once = Router::new()
        .route("/run", post(|| async { StatusCode::CREATED }))
        .layer(layer(&app.pool, "never", |b| {
            b.transient_retry(TransientRetry::never())
        }));
    assert_eq!(send(&once, command("n")).await.status, StatusCode::CREATED);
}

async fn concurrent_duplicates_commit_once(level: IsolationLevel, expected: &str) {
    let app = TestApp::with_pool_size(40).await;
    let credits = app.credits_with(|b| b.isolation_level(level));
    let replies = futures_util::future::join_all(
        (0..24).map(|_| send(&credits, credit("acct", Some("same"), Some("app"), 7))),
    )
    .await;
    let mut created = 0;
    for reply in &replies {
        match reply.status {
            StatusCode::CREATED => {
                created += 1;
                assert_eq!(reply.json()["balance"], 7, "{level:?}");
            }
            StatusCode::CONFLICT => assert_eq!(reply.problem_type(), "in-progress"),
            other => panic!("{level:?}: unexpected {other}: {:?}", reply.body),
        }
    }
    assert!(created >= 1, "{level:?}");
    assert_eq!(app.ledger_rows("acct").await, 1, "{level:?}: applied once");
    assert_eq!(app.balance("acct").await, Some(7));
    assert_eq!(
        replies
            .iter()
            .filter(|r| r.status == StatusCode::CREATED && !r.replayed())
            .count(),
        1,
        "{level:?}: exactly one first-seen answer"
    );

    // The claimed transaction runs at the configured level.
    assert_eq!(
        level_seen(&app.pool, level, ClaimMode::First).await,
        expected
    );
}

#[tokio::test]
async fn concurrent_duplicates_commit_once_at_read_committed() {
    concurrent_duplicates_commit_once(IsolationLevel::ReadCommitted, "read committed").await;
}

#[tokio::test]
async fn concurrent_duplicates_commit_once_at_repeatable_read() {
    concurrent_duplicates_commit_once(IsolationLevel::RepeatableRead, "repeatable read").await;
}

#[tokio::test]
async fn concurrent_duplicates_commit_once_at_serializable() {
    concurrent_duplicates_commit_once(IsolationLevel::Serializable, "serializable").await;
}

#[tokio::test]
async fn concurrent_duplicates_commit_once_at_the_database_default() {
    concurrent_duplicates_commit_once(IsolationLevel::DatabaseDefault, "read committed").await;
}

/// The level a handler's transaction runs at, through a layer over `pool` configured by
/// `level` and `mode`.
async fn level_seen(pool: &sqlx::PgPool, level: IsolationLevel, mode: ClaimMode) -> String {
    let probe = Router::new()
        .route(
            "/run",
            post(|mut tx: InboxTx| async move {
                sqlx::query_scalar::<_, String>("show transaction_isolation")
                    .fetch_one(&mut *tx)
                    .await
                    .expect("isolation")
            }),
        )
        .layer(layer(pool, "levels", |b| {
            b.isolation_level(level).claim_mode(mode)
        }));
    let key = format!("{level:?}-{mode:?}");
    let reply = send(&probe, command(&key)).await;
    assert_eq!(reply.status, StatusCode::OK, "{key}: {reply:?}");
    String::from_utf8(reply.body.to_vec()).expect("utf-8")
}

/// The default starts the transaction with a plain `BEGIN`, so the database's default level
/// is the handler's; a level named in the settings is the handler's whatever the database's
/// default, in both claim modes.
#[tokio::test]
async fn the_default_level_is_the_databases_and_a_named_level_stays() {
    let app = TestApp::new().await;
    app.set_for_new_sessions("default_transaction_isolation", "'serializable'")
        .await;
    let pool = app.pool_with(4, &[]);
    for mode in [ClaimMode::First, ClaimMode::AtCommit] {
        for (level, expected) in [
            (IsolationLevel::DatabaseDefault, "serializable"),
            (IsolationLevel::ReadCommitted, "read committed"),
            (IsolationLevel::RepeatableRead, "repeatable read"),
        ] {
            assert_eq!(
                level_seen(&pool, level, mode).await,
                expected,
                "{level:?} {mode:?}"
            );
        }
    }
}

/// The first claim of `key` (consumer `broker`, producer `payments`) in `inbox`.
async fn first_claim(inbox: &Inbox, key: &str) -> ClaimedMessage {
    let identity = MessageIdentity::new(
        "broker",
        Producer::new("payments").unwrap(),
        MessageKey::new(key).unwrap(),
    );
    let claim = inbox.claim(identity, Fingerprint::of_bytes(b"m"), "1", Duration::ZERO);
    match claim.await.unwrap() {
        Claim::Claimed(message) => message,
        _ => panic!("first claim of {key}"),
    }
}

#[tokio::test]
async fn a_claimed_message_remembers_transient_failures_of_watched_statements() {
    let app = TestApp::new().await;
    let inbox = Inbox::new(app.pool.clone()).with_isolation(IsolationLevel::RepeatableRead);
    let identity = |key: &str| {
        MessageIdentity::new(
            "broker",
            Producer::new("payments").unwrap(),
            MessageKey::new(key).unwrap(),
        )
    };
    let raise =
        |code: &str| format!("do $$ begin raise exception 'x' using errcode = '{code}'; end $$");
    for (key, code, expected) in [
        ("s", "40001", Some(RetryReason::SerializationFailure)),
        ("d", "40P01", Some(RetryReason::Deadlock)),
        ("u", "23505", None),
    ] {
        let mut message = first_claim(&inbox, key).await;
        let sql = raise(code);
        assert!(sqlx::query(&sql).execute(&mut message).await.is_err());
        assert_eq!(message.retry_reason(), expected, "{code}");
        message.rollback().await.unwrap();
    }
    // The plain connection is reached through with_connection only, and watched there too:
    // the error its closure returns counts like a statement's.
    let mut message = first_claim(&inbox, "p").await;
    let sql = raise("40001");
    let failed = message
        .with_connection(async |conn| sqlx::query(&sql).execute(conn).await)
        .await;
    assert!(failed.is_err());
    assert_eq!(
        message.retry_reason(),
        Some(RetryReason::SerializationFailure)
    );
    let err = message.commit(None).await.expect_err("never committed");
    assert!(
        matches!(err, InboxError::Rerun(RetryReason::SerializationFailure)),
        "{err}"
    );
    assert!(err.is_retryable());

    // An error swallowed inside the closure is not seen, but it aborted the transaction:
    // the record fails and nothing commits.
    let mut message = first_claim(&inbox, "swallowed").await;
    let swallowed = message
        .with_connection(async |conn| {
            let _ = sqlx::query(&sql).execute(&mut *conn).await;
            Ok(())
        })
        .await;
    assert!(swallowed.is_ok());
    assert_eq!(message.retry_reason(), None);
    assert!(
        message.commit(None).await.is_err(),
        "an aborted transaction never commits"
    );
    assert!(
        inbox
            .lookup(&identity("swallowed"))
            .await
            .unwrap()
            .is_none(),
        "nothing of the swallowed run was committed"
    );

    // A watched failure makes the commit roll back with its reason too, even when the
    // consumer carries on as if nothing happened.
    let mut message = first_claim(&inbox, "w").await;
    let _ = sqlx::query(&raise("40P01")).execute(&mut message).await;
    let err = message.commit(None).await.expect_err("never committed");
    assert_eq!(err.retry_reason(), Some(RetryReason::Deadlock));
    assert_eq!(app.inbox_rows().await, 0);
}
