//! The example's hand-written minimal protocol (`examples/credits/ceiling.rs`), the ceiling
//! the HTTP benchmark measures the layer against: it must do the protocol's work, or the
//! ceiling is too high. A new key credits once and is recorded with its response in the same
//! transaction; a reused key is refused without a second credit, in both claim modes.

mod common;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use common::ceiling::{minimal_routes, MINIMAL_CONSUMER};
use common::{send, TestApp};

fn minimal_credit(account: &str, key: &str, delta: i64) -> Request<Body> {
    Request::post(format!("/minimal/accounts/{account}/credits"))
        .header("content-type", "application/json")
        .header("idempotency-key", key)
        .header("x-producer", "bench")
        .body(Body::from(format!(r#"{{"delta": {delta}}}"#)))
        .expect("request")
}

async fn recorded(app: &TestApp, key: &str) -> Option<(String, Option<i16>, Option<Vec<u8>>)> {
    sqlx::query_as(
        "select payload_sha256, response_status, response_body from tower_inbox.consumer_inbox
         where consumer_name = $1 and producer_name = 'bench' and message_id = $2",
    )
    .bind(MINIMAL_CONSUMER)
    .bind(key)
    .fetch_optional(&app.pool)
    .await
    .expect("inbox row")
}

async fn credits_once_and_records(at_commit: bool) {
    let app = TestApp::new().await;
    let router = minimal_routes(app.pool.clone(), at_commit);

    let first = send(&router, minimal_credit("m1", "k1", 5)).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert_eq!(first.json()["balance"], 5);
    let (sha, status, body) = recorded(&app, "k1").await.expect("claimed with the credit");
    assert_eq!(sha.len(), 64, "the body's SHA-256 in hex");
    assert_eq!(status, Some(201));
    assert_eq!(
        body.as_deref(),
        Some(&first.body[..]),
        "the response is recorded"
    );

    for delta in [5, 7] {
        let again = send(&router, minimal_credit("m1", "k1", delta)).await;
        assert_eq!(again.status, StatusCode::CONFLICT, "{again:?}");
    }
    assert_eq!(
        app.ledger_rows("m1").await,
        1,
        "a reused key credits nothing"
    );
    assert_eq!(app.balance("m1").await, Some(5));

    let other = send(&router, minimal_credit("m1", "k2", 1)).await;
    assert_eq!(other.status, StatusCode::CREATED, "{other:?}");
    assert_eq!(app.balance("m1").await, Some(6));
}

#[tokio::test]
async fn claiming_first_it_credits_a_key_once_and_records_the_response() {
    credits_once_and_records(false).await;
}

#[tokio::test]
async fn claiming_at_commit_it_credits_a_key_once_and_records_the_response() {
    credits_once_and_records(true).await;
}

#[tokio::test]
async fn a_credit_the_baseline_refuses_is_refused_and_claims_nothing() {
    let app = TestApp::new().await;
    for at_commit in [false, true] {
        let router = minimal_routes(app.pool.clone(), at_commit);
        let account = format!("m2-{at_commit}");
        let key = format!("big-{at_commit}");
        let first = send(&router, minimal_credit(&account, &key, i64::MAX)).await;
        assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
        let key = format!("over-{at_commit}");
        let overflow = send(&router, minimal_credit(&account, &key, 1)).await;
        assert_eq!(
            overflow.status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{overflow:?}"
        );
        assert_eq!(
            recorded(&app, &key).await,
            None,
            "rolled back with the credit"
        );
        assert_eq!(app.balance(&account).await, Some(i64::MAX));

        let long = "a".repeat(129);
        let refused = send(
            &router,
            minimal_credit(&long, &format!("long-{at_commit}"), 1),
        )
        .await;
        assert_eq!(
            refused.status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{refused:?}"
        );
    }
}

#[tokio::test]
async fn a_body_that_is_not_a_credit_is_refused_and_claims_nothing() {
    let app = TestApp::new().await;
    let router = minimal_routes(app.pool.clone(), false);
    let request = Request::post("/minimal/accounts/m1/credits")
        .header("idempotency-key", "k1")
        .header("x-producer", "bench")
        .body(Body::from("not json"))
        .expect("request");
    let reply = send(&router, request).await;
    assert_eq!(reply.status, StatusCode::UNPROCESSABLE_ENTITY, "{reply:?}");
    assert_eq!(recorded(&app, "k1").await, None);
}
