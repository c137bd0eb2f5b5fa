//! The seed article's required cases, each asserting the invariant on the database: for one
//! consumer and one producer intent there is at most one committed domain transition, while
//! uncommitted attempts stay retryable.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::Path;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::post;
use axum::Router;
use common::{credit, send, unreachable_pool, TestApp};
use tower::ServiceExt;
use tower_inbox::producer::TrustedHeader;
use tower_inbox::{InboxLayer, InboxTx};

#[tokio::test]
async fn same_message_delivered_sequentially_twice() {
    let app = TestApp::new().await;
    let router = app.credits();

    let first = send(&router, credit("acct", Some("k-1"), Some("app"), 10)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.replayed());
    assert_eq!(
        first.json(),
        serde_json::json!({"account_id": "acct", "balance": 10, "delta": 10})
    );

    let second = send(&router, credit("acct", Some("k-1"), Some("app"), 10)).await;
    assert_eq!(second.status, first.status);
    assert!(second.replayed());
    assert_eq!(second.body, first.body, "replayed body is byte-identical");
    let mut replayed_headers = second.headers.clone();
    replayed_headers.remove("idempotent-replayed");
    assert_eq!(replayed_headers, first.headers);

    assert_eq!(app.ledger_rows("acct").await, 1);
    assert_eq!(app.balance("acct").await, Some(10));
    let row = app.inbox_row("app", "k-1").await.expect("inbox row");
    assert!(row.processed);
    assert_eq!(row.status, Some(201));
    assert_eq!(row.body.as_ref(), Some(&first.body));
    assert_eq!(app.inbox_rows().await, 1);
}

#[tokio::test]
async fn same_message_from_many_concurrent_workers() {
    const WORKERS: usize = 32;
    let app = TestApp::with_pool_size(WORKERS as u32 + 4).await;
    // Long enough that waiting duplicates see the original's outcome rather than give up.
    let router = app.credits_with(|b| b.in_flight_wait(Duration::from_secs(30)));
    let barrier = Arc::new(tokio::sync::Barrier::new(WORKERS));

    let workers: Vec<_> = (0..WORKERS)
        .map(|_| {
            let router = router.clone();
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                send(&router, credit("hot", Some("same-key"), Some("app"), 7)).await
            })
        })
        .collect();
    let mut replies = Vec::new();
    for worker in workers {
        replies.push(worker.await.expect("worker"));
    }

    let originals = replies.iter().filter(|r| !r.replayed()).count();
    assert_eq!(originals, 1, "exactly one worker ran the handler");
    for reply in &replies {
        assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
        assert_eq!(reply.body, replies[0].body);
    }
    assert_eq!(app.ledger_rows("hot").await, 1);
    assert_eq!(app.balance("hot").await, Some(7));
    assert_eq!(app.inbox_rows().await, 1);
}

#[tokio::test]
async fn crash_before_the_inbox_insert() {
    let app = TestApp::new().await;
    // The first delivery never reaches the claim: the database is unreachable for it.
    let down = credits_router_over(unreachable_pool());
    let lost = send(&down, credit("acct", Some("k-crash"), Some("app"), 5)).await;
    assert_eq!(lost.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(lost.problem_type(), "unavailable");
    assert!(lost.headers.contains_key("retry-after"));
    assert_eq!(app.inbox_rows().await, 0);

    // A delivery that dies mid-upload (the client crashed) is refused before the claim.
    let router = app.credits();
    let chunks: Vec<Result<&'static str, std::io::Error>> = vec![
        Ok(r#"{"del"#),
        Err(std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "client died",
        )),
    ];
    let torn = common::credit_raw(
        "acct",
        Some("k-crash"),
        Some("app"),
        axum::body::Body::from_stream(futures_util::stream::iter(chunks)),
    );
    let torn = send(&router, torn).await;
    assert_eq!(torn.status, StatusCode::BAD_REQUEST);
    assert_eq!(torn.problem_type(), "body-unreadable");
    assert_eq!(app.inbox_rows().await, 0);
    assert_eq!(app.failures("app", "k-crash").await, None);

    // The redelivery is processed, once.
    let retry = send(&router, credit("acct", Some("k-crash"), Some("app"), 5)).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!retry.replayed());
    assert_eq!(app.ledger_rows("acct").await, 1);
    assert_eq!(app.balance("acct").await, Some(5));
}

fn credits_router_over(pool: sqlx::PgPool) -> Router {
    common::credits::routes(
        pool.clone(),
        common::credits::inbox_layer(pool).build().expect("layer"),
    )
}

/// A handler that fails on its first `failures` calls, after the claim: either before the
/// domain update or after part of it, by error status or by panic.
#[derive(Clone, Copy)]
enum Failure {
    StatusBeforeUpdate,
    StatusAfterPartialUpdate,
    Panic,
}

fn flaky_router(app: &TestApp, failures: usize, how: Failure) -> (Router, Arc<AtomicUsize>) {
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = calls.clone();
    let handler = move |Path(account): Path<String>, mut tx: InboxTx| {
        let counter = counter.clone();
        async move {
            let call = counter.fetch_add(1, Ordering::SeqCst);
            let failing = call < failures;
            if failing && matches!(how, Failure::StatusBeforeUpdate) {
                return StatusCode::INTERNAL_SERVER_ERROR.into_response();
            }
            if failing && matches!(how, Failure::Panic) {
                panic!("handler bug on call {call}");
            }
            sqlx::query(
                "insert into credit_account (account_id, balance) values ($1, 3)
                 on conflict (account_id) do update set balance = credit_account.balance + 3",
            )
            .bind(&account)
            .execute(&mut *tx)
            .await
            .expect("update");
            if failing {
                return StatusCode::BAD_GATEWAY.into_response();
            }
            sqlx::query(
                "insert into credit_ledger (account_id, delta, balance_after, consumer_name, producer_name, message_id)
                 select $1, 3, balance, 'credits', 'app', 'k' from credit_account where account_id = $1",
            )
            .bind(&account)
            .execute(&mut *tx)
            .await
            .expect("ledger");
            (StatusCode::CREATED, "applied").into_response()
        }
    };
    let layer = InboxLayer::builder(app.pool.clone(), "credits")
        .producer(TrustedHeader::new("x-producer"))
        .build()
        .expect("layer");
    let router = Router::new()
        .route("/accounts/{account}/credits", post(handler))
        .layer(layer);
    (router, calls)
}

async fn exception_after_claim(how: Failure, reason: &str) {
    let app = TestApp::new().await;
    let (router, calls) = flaky_router(&app, 2, how);

    for attempt in 1..=2 {
        let failed = send(&router, credit("acct", Some("k"), Some("app"), 3)).await;
        assert!(failed.status.is_server_error(), "{failed:?}");
        // Nothing of the attempt committed: no claim, no domain change.
        assert_eq!(app.inbox_rows().await, 0);
        assert_eq!(app.balance("acct").await, None);
        assert_eq!(app.ledger_rows("acct").await, 0);
        // The attempt is counted, in a transaction of its own.
        assert_eq!(
            app.failures("app", "k").await,
            Some((attempt, reason.to_owned()))
        );
    }

    // The same router keeps serving, and the retry applies the command once.
    let ok = send(&router, credit("acct", Some("k"), Some("app"), 3)).await;
    assert_eq!(ok.status, StatusCode::CREATED);
    let again = send(&router, credit("acct", Some("k"), Some("app"), 3)).await;
    assert!(again.replayed());
    assert_eq!(
        calls.load(Ordering::SeqCst),
        3,
        "the duplicate did not run the handler"
    );
    assert_eq!(app.balance("acct").await, Some(3));
    assert_eq!(app.ledger_rows("acct").await, 1);
    assert!(app.inbox_row("app", "k").await.expect("row").processed);
}

#[tokio::test]
async fn handler_error_after_claim_before_domain_update() {
    exception_after_claim(Failure::StatusBeforeUpdate, "handler-error-status").await;
}

#[tokio::test]
async fn handler_error_after_a_partial_domain_update() {
    exception_after_claim(Failure::StatusAfterPartialUpdate, "handler-error-status").await;
}

#[tokio::test]
async fn handler_panic_after_claim() {
    exception_after_claim(Failure::Panic, "handler-panicked").await;
}

#[tokio::test]
async fn handler_panic_answers_a_problem() {
    let app = TestApp::new().await;
    let (router, _) = flaky_router(&app, 1, Failure::Panic);
    let reply = send(&router, credit("acct", Some("k"), Some("app"), 3)).await;
    assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(reply.problem_type(), "handler-panicked");
}

#[tokio::test]
async fn commit_succeeds_and_the_acknowledgement_is_lost() {
    let app = TestApp::new().await;
    let router = app.credits();

    // The response is produced after the commit, then lost on its way to the client.
    let response = router
        .clone()
        .oneshot(credit("acct", Some("k-ack"), Some("app"), 4))
        .await
        .expect("infallible");
    assert_eq!(response.status(), StatusCode::CREATED);
    drop(response);
    assert_eq!(app.ledger_rows("acct").await, 1);
    let row = app
        .inbox_row("app", "k-ack")
        .await
        .expect("committed claim");
    assert!(row.processed);

    // The client retries and receives the answer it lost, without a second transition.
    let retry = send(&router, credit("acct", Some("k-ack"), Some("app"), 4)).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(retry.replayed());
    assert_eq!(
        retry.json(),
        serde_json::json!({"account_id": "acct", "balance": 4, "delta": 4})
    );
    assert_eq!(Some(&retry.body), row.body.as_ref());
    assert_eq!(app.ledger_rows("acct").await, 1);
    assert_eq!(app.balance("acct").await, Some(4));
}

#[tokio::test]
async fn same_id_with_a_different_payload() {
    let app = TestApp::new().await;
    let router = app.credits();

    let first = send(&router, credit("acct", Some("k-dup"), Some("app"), 10)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let original = app.inbox_row("app", "k-dup").await.expect("row");

    let conflict = send(&router, credit("acct", Some("k-dup"), Some("app"), 11)).await;
    assert_eq!(conflict.status, StatusCode::CONFLICT);
    assert_eq!(conflict.problem_type(), "payload-mismatch");
    assert!(!conflict.replayed());

    // Also across accounts: the path is part of the fingerprint.
    let elsewhere = send(&router, credit("other", Some("k-dup"), Some("app"), 10)).await;
    assert_eq!(elsewhere.problem_type(), "payload-mismatch");

    // The original is untouched and still replays.
    assert_eq!(app.inbox_row("app", "k-dup").await, Some(original));
    assert_eq!(app.ledger_rows("acct").await, 1);
    assert_eq!(app.balance("acct").await, Some(10));
    assert_eq!(app.balance("other").await, None);
    let replay = send(&router, credit("acct", Some("k-dup"), Some("app"), 10)).await;
    assert!(replay.replayed());

    // A new ID with the same payload is a new intent, never merged.
    let new_intent = send(&router, credit("acct", Some("k-new"), Some("app"), 10)).await;
    assert_eq!(new_intent.status, StatusCode::CREATED);
    assert!(!new_intent.replayed());
    assert_eq!(app.balance("acct").await, Some(20));
}

#[tokio::test]
async fn mismatch_status_can_be_422() {
    let app = TestApp::new().await;
    let router = app.credits_with(|b| {
        b.mismatch_status(tower_inbox::middleware::MismatchStatus::UnprocessableContent)
    });
    send(&router, credit("acct", Some("k"), Some("app"), 1)).await;
    let conflict = send(&router, credit("acct", Some("k"), Some("app"), 2)).await;
    assert_eq!(conflict.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(conflict.problem_type(), "payload-mismatch");
    assert_eq!(app.balance("acct").await, Some(1));
}
