//! Half-open connections: a proxy between the pool and PostgreSQL stops forwarding without
//! closing either side, as a network partition does. The inbox's statements on such a
//! connection must fail within its statement deadline, as a lost connection (a re-run is
//! safe; a `COMMIT`'s outcome is unknown), and the connection must be closed rather than
//! returned to the pool: sqlx's own return pings it with no limit, which would hold the
//! pool's slot for ever. Each test gives the inbox a pool of one connection, so the next
//! claim can only be served if that slot came back.

mod common;

use std::time::Duration;

use common::proxy::{Cut, Proxy};
use common::TestApp;
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;
use tower_inbox::fingerprint::Fingerprint;
use tower_inbox::inbox::{Claim, ClaimedMessage, Inbox, InboxError, RecordedResponse, RetryReason};
use tower_inbox::{MessageIdentity, MessageKey, Producer};

/// Far above a healthy statement's time on a loaded machine, so that only a stall meets it.
const DEADLINE: Duration = Duration::from_secs(2);

fn identity(key: &str) -> MessageIdentity {
    MessageIdentity::new(
        "half-open",
        Producer::new("app").expect("producer"),
        MessageKey::new(key).expect("key"),
    )
}

fn payload() -> Fingerprint {
    Fingerprint::of_bytes(b"credit 1")
}

fn response() -> RecordedResponse {
    RecordedResponse {
        status: 201,
        headers: Vec::new(),
        body: bytes::Bytes::from_static(b"{}"),
    }
}

/// A pool of one connection to the test database through a new proxy, and an inbox on it
/// with a short statement deadline.
async fn through_proxy(app: &TestApp) -> (Proxy, PgPool, Inbox) {
    let options = (*app.pool.connect_options()).clone();
    let proxy = Proxy::in_front_of(&options).await;
    let pool = PgPoolOptions::new()
        .max_connections(1)
        // Bounded, so that a slot never given back fails the test instead of hanging it.
        .acquire_timeout(Duration::from_secs(5))
        .test_before_acquire(false)
        .connect_lazy_with(
            options
                .host(&proxy.addr().ip().to_string())
                .port(proxy.addr().port()),
        );
    let inbox = Inbox::new(pool.clone()).with_statement_deadline(DEADLINE);
    (proxy, pool, inbox)
}

async fn claim(inbox: &Inbox, key: &str, wait: Duration) -> Result<Claim, InboxError> {
    inbox.claim(identity(key), payload(), "v1", wait).await
}

async fn claimed(inbox: &Inbox, key: &str, wait: Duration) -> ClaimedMessage {
    match claim(inbox, key, wait).await.expect("claim") {
        Claim::Claimed(message) => message,
        other => panic!("{key} was not free: {other:?}"),
    }
}

/// A committed command, so that the pool's one connection is open, idle, and ready to be
/// stalled.
async fn warm(inbox: &Inbox) {
    claimed(inbox, "warm", Duration::ZERO)
        .await
        .commit(Some(&response()))
        .await
        .expect("commit");
    idle(inbox.pool()).await;
}

/// Waits (bounded) until the pool's connection is back in it. sqlx pings a connection as
/// it comes back, with no limit of its own: a stall that met that ping would hold the slot
/// until the kernel gives the connection up (the crate documents it), so the tests stall
/// only idle connections, or ones the inbox holds.
async fn idle(pool: &PgPool) {
    for _ in 0..500 {
        if pool.num_idle() == 1 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the pool's connection never came back");
}

fn lost(err: &InboxError) -> bool {
    err.retry_reason() == Some(RetryReason::ConnectionLost)
}

#[tokio::test]
async fn a_claim_on_a_half_open_connection_fails_in_time_and_gives_its_slot_back() {
    let app = TestApp::new().await;
    let (proxy, _pool, inbox) = through_proxy(&app).await;
    warm(&inbox).await;

    assert_eq!(proxy.stall_all(), 1);
    let err = claim(&inbox, "k", Duration::ZERO)
        .await
        .expect_err("no answer comes");
    assert!(lost(&err), "{err}");
    assert!(!err.may_have_committed());

    // The stalled connection was closed, not returned: the pool opens a new one.
    claimed(&inbox, "k", Duration::ZERO)
        .await
        .commit(Some(&response()))
        .await
        .expect("commit on a new connection");
    assert_eq!(proxy.connections(), 2);
    assert!(app.inbox_row("app", "k").await.is_some_and(|r| r.processed));
}

#[tokio::test]
async fn a_commit_without_an_answer_is_outcome_unknown_and_a_retry_runs_it_once() {
    let app = TestApp::new().await;
    // The server ends the stalled session's transaction, which holds the claim, on its own.
    app.set_for_new_sessions("idle_in_transaction_session_timeout", "'1s'")
        .await;
    let (proxy, _pool, inbox) = through_proxy(&app).await;
    warm(&inbox).await;

    let message = claimed(&inbox, "k", Duration::ZERO).await;
    proxy.arm(b"COMMIT", Cut::Stall);
    let err = message
        .commit(Some(&response()))
        .await
        .expect_err("no answer comes");
    proxy.cut_done().await;
    assert!(matches!(err, InboxError::OutcomeUnknown(_)), "{err}");
    assert!(err.may_have_committed());

    // The COMMIT never reached the server: once the server has ended that session, the
    // retry claims the key and runs the command once.
    let retry = claimed(&inbox, "k", Duration::from_secs(30)).await;
    retry.commit(Some(&response())).await.expect("commit");
    let rows: i64 = sqlx::query_scalar(
        "select count(*) from tower_inbox.consumer_inbox
         where consumer_name = 'half-open' and message_id = 'k'",
    )
    .fetch_one(&app.pool)
    .await
    .expect("count");
    assert_eq!(rows, 1);
}

#[tokio::test]
async fn a_claimed_message_dropped_on_a_half_open_connection_gives_its_slot_back() {
    let app = TestApp::new().await;
    let (proxy, _pool, inbox) = through_proxy(&app).await;
    warm(&inbox).await;

    // A handler's future dropped (its client gave up) while the network is gone: the
    // rollback cannot get through, so the connection is closed instead.
    let message = claimed(&inbox, "k", Duration::ZERO).await;
    assert_eq!(proxy.stall_all(), 1);
    drop(message);

    claimed(&inbox, "other", Duration::ZERO)
        .await
        .commit(Some(&response()))
        .await
        .expect("commit on a new connection");
    assert_eq!(proxy.connections(), 2);
}

#[tokio::test]
async fn lookups_and_failure_records_on_a_half_open_connection_fail_in_time() {
    let app = TestApp::new().await;
    let (proxy, _pool, inbox) = through_proxy(&app).await;
    warm(&inbox).await;

    assert_eq!(proxy.stall_all(), 1);
    let err = inbox
        .lookup(&identity("warm"))
        .await
        .expect_err("no answer comes");
    assert!(lost(&err), "{err}");
    assert!(inbox
        .lookup(&identity("warm"))
        .await
        .expect("lookup")
        .is_some());

    idle(inbox.pool()).await;
    assert_eq!(proxy.stall_all(), 1);
    let err = inbox
        .record_failure(&identity("f"), payload(), "v1", "handler-error", 3)
        .await
        .expect_err("no answer comes");
    assert!(lost(&err), "{err}");
    inbox
        .record_failure(&identity("f"), payload(), "v1", "handler-error", 3)
        .await
        .expect("counted on a new connection");
    assert_eq!(app.failures("app", "f").await.map(|(n, _)| n), Some(1));
    assert_eq!(proxy.connections(), 3);
}
