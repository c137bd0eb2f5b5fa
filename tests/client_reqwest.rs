//! The client as reqwest middleware (feature `client-reqwest`), against the credits service
//! served on a real TCP listener and a real database: the same behaviour as the Tower layer
//! (tests/client.rs), through reqwest.

mod common;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::listen::{closed_port, problem_slug, serve};
use common::proxy::{Cut, Proxy};
use common::receipts::{assert_streamed_and_refused, assert_waited_out};
use common::{gated_router, TestApp};
use http::Extensions;
use http_body::Frame;
use http_body_util::StreamBody;
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware, Middleware, Next};
use tokio::sync::Notify;
use tower_inbox::client::{CommandError, CommandReceipt, RetryMiddleware, RetryPolicy};

fn client(after: Option<Conflicts>) -> ClientWithMiddleware {
    let builder = ClientBuilder::new(reqwest::Client::new())
        .with(RetryMiddleware::new(RetryPolicy::default()));
    match after {
        Some(conflicts) => builder.with(conflicts).build(),
        None => builder.build(),
    }
}

fn credit(
    client: &ClientWithMiddleware,
    addr: SocketAddr,
    account: &str,
    key: Option<&str>,
    delta: i64,
) -> reqwest_middleware::RequestBuilder {
    let builder = client
        .post(format!("http://{addr}/accounts/{account}/credits"))
        .header("content-type", "application/json")
        .header("x-producer", "client-test")
        .body(format!(r#"{{"delta": {delta}}}"#));
    match key {
        Some(key) => builder.header("idempotency-key", key),
        None => builder,
    }
}

fn receipt(response: &reqwest::Response) -> CommandReceipt {
    response
        .extensions()
        .get::<CommandReceipt>()
        .expect("a receipt")
        .clone()
}

/// The middleware's give-up, out of reqwest-middleware's error.
fn command_error(error: &reqwest_middleware::Error) -> &CommandError {
    match error {
        reqwest_middleware::Error::Middleware(e) => e.downcast_ref().expect("a CommandError"),
        other => panic!("not the middleware's error: {other}"),
    }
}

#[tokio::test]
async fn a_command_without_a_key_gets_one_and_its_answer_the_receipt() {
    let app = TestApp::new().await;
    let addr = serve(app.credits()).await;
    let response = credit(&client(None), addr, "keyed", None, 4)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    let seen = receipt(&response);
    assert_eq!(seen.key().len(), 36, "a UUID: {}", seen.key());
    assert_eq!((seen.attempts(), seen.replayed()), (1, false));
    assert_eq!(response.url().path(), "/accounts/keyed/credits");
    // `Response::json` needs reqwest's `json` feature: the bytes, then serde_json.
    let body: serde_json::Value = serde_json::from_slice(&response.bytes().await.unwrap()).unwrap();
    assert_eq!(body["balance"], 4);
    assert_eq!(app.ledger_rows("keyed").await, 1);
}

#[tokio::test]
async fn a_payload_conflict_is_returned_at_once_after_one_attempt() {
    let app = TestApp::new().await;
    let addr = serve(app.credits()).await;
    let client = client(None);
    let first = credit(&client, addr, "conflict", Some("same-key"), 1)
        .send()
        .await
        .unwrap();
    assert_eq!(first.status(), 201);

    let other = credit(&client, addr, "conflict", Some("same-key"), 2)
        .send()
        .await
        .unwrap();
    assert_eq!(other.status(), 409);
    let seen = receipt(&other);
    assert_eq!(
        (seen.key(), seen.attempts(), seen.replayed()),
        ("same-key", 1, false)
    );
    assert_eq!(
        problem_slug(&other.bytes().await.unwrap()),
        "payload-mismatch"
    );
    assert_eq!(app.ledger_rows("conflict").await, 1);
}

#[tokio::test]
async fn a_response_lost_after_the_commit_is_replayed_to_the_retry() {
    let app = TestApp::new().await;
    let proxy = Proxy::start(serve(app.credits()).await).await;
    // The server gets the request and commits; its answer never reaches the client.
    proxy.arm(b"lost-answer-key", Cut::After);
    let response = credit(
        &client(None),
        proxy.addr(),
        "lost",
        Some("lost-answer-key"),
        5,
    )
    .send()
    .await
    .unwrap();
    proxy.cut_done().await;
    assert_eq!(response.status(), 201);
    assert_eq!(response.headers()["idempotent-replayed"], "true");
    let seen = receipt(&response);
    assert_eq!((seen.attempts(), seen.replayed()), (2, true));
    assert_eq!(app.ledger_rows("lost").await, 1);
    assert_eq!(app.balance("lost").await, Some(5));
}

/// The status of the latest attempt, which [`Conflicts`] leaves in the request's extensions.
#[derive(Debug, Clone, PartialEq)]
struct LastStatus(u16);

/// After the client's middleware: counts the 409s its attempts get and tells the test.
#[derive(Clone)]
struct Conflicts {
    count: Arc<AtomicUsize>,
    seen: Arc<Notify>,
}

#[async_trait::async_trait]
impl Middleware for Conflicts {
    async fn handle(
        &self,
        request: reqwest::Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<reqwest::Response> {
        let response = next.run(request, extensions).await?;
        if response.status() == 409 {
            self.count.fetch_add(1, Ordering::SeqCst);
            self.seen.notify_one();
        }
        extensions.insert(LastStatus(response.status().as_u16()));
        Ok(response)
    }
}

#[tokio::test]
async fn an_in_flight_duplicate_waits_for_retry_after_then_gets_the_replay() {
    let app = TestApp::new().await;
    let (router, gate, calls) =
        gated_router(&app, |b| b.in_flight_wait(Duration::ZERO).retry_after(1));
    let addr = serve(router).await;

    // The original, straight to the server, held in its handler by the gate.
    let plain = ClientBuilder::new(reqwest::Client::new()).build();
    let original = tokio::spawn(credit(&plain, addr, "gated", Some("busy-key"), 1).send());
    gate.started.notified().await;

    let conflicts = Conflicts {
        count: Arc::new(AtomicUsize::new(0)),
        seen: Arc::new(Notify::new()),
    };
    let client = client(Some(conflicts.clone()));
    let request = credit(&client, addr, "gated", Some("busy-key"), 1)
        .build()
        .unwrap();
    let duplicate = tokio::spawn(async move {
        let mut extensions = Extensions::new();
        let sent = client
            .execute_with_extensions(request, &mut extensions)
            .await;
        (sent, extensions)
    });
    conflicts.seen.notified().await;
    gate.release.notify_one();

    let (sent, extensions) = duplicate.await.unwrap();
    let response = sent.unwrap();
    assert_eq!(
        extensions.get::<LastStatus>(),
        Some(&LastStatus(201)),
        "what the chain left in the last attempt's extensions reaches the caller"
    );
    assert_eq!(original.await.unwrap().unwrap().status(), 201);
    assert_eq!(response.status(), 201);
    assert_waited_out(&receipt(&response), conflicts.count.load(Ordering::SeqCst));
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the handler ran once");
}

#[tokio::test]
async fn a_streamed_body_is_sent_once_and_not_retried_with_a_clear_error() {
    let frames: Vec<Result<_, Infallible>> =
        vec![Ok(Frame::data(Bytes::from_static(br#"{"delta": 3}"#)))];
    let body = reqwest::Body::wrap(StreamBody::new(futures_util::stream::iter(frames)));
    let error = client(None)
        .post(format!(
            "http://{}/accounts/streamed/credits",
            closed_port().await
        ))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap_err();
    assert_streamed_and_refused(command_error(&error));
}
