//! The client layer (feature `client`) over hyper-util's client, against the credits
//! service served on a real TCP listener and a real database.

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
use http::{Request, Response};
use http_body::{Body, Frame};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::sync::Notify;
use tower::{Layer, Service, ServiceBuilder, ServiceExt};
use tower_inbox::client::{AttemptBody, CommandReceipt, RetryLayer, RetryPolicy};

fn hyper_client<B>() -> Client<HttpConnector, AttemptBody<B>>
where
    B: Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    Client::builder(TokioExecutor::new()).build_http()
}

fn credit(addr: SocketAddr, account: &str, key: Option<&str>, delta: i64) -> Request<Full<Bytes>> {
    let mut builder = Request::post(format!("http://{addr}/accounts/{account}/credits"))
        .header("content-type", "application/json")
        .header("x-producer", "client-test");
    if let Some(key) = key {
        builder = builder.header("idempotency-key", key);
    }
    builder
        .body(Full::new(Bytes::from(format!(r#"{{"delta": {delta}}}"#))))
        .unwrap()
}

fn receipt<B>(response: &Response<B>) -> CommandReceipt {
    response
        .extensions()
        .get::<CommandReceipt>()
        .expect("a receipt")
        .clone()
}

async fn problem_type<B>(response: Response<B>) -> String
where
    B: Body,
    B::Error: std::fmt::Debug,
{
    let body = response.into_body().collect().await.unwrap().to_bytes();
    problem_slug(&body)
}

#[tokio::test]
async fn a_payload_conflict_is_returned_at_once_after_one_attempt() {
    let app = TestApp::new().await;
    let addr = serve(app.credits()).await;
    let mut client = RetryLayer::new(RetryPolicy::default()).layer(hyper_client());

    let first = client
        .ready()
        .await
        .unwrap()
        .call(credit(addr, "conflict", Some("same-key"), 1))
        .await
        .unwrap();
    assert_eq!(first.status(), 201);
    assert_eq!(receipt(&first).attempts(), 1);

    let other = client
        .ready()
        .await
        .unwrap()
        .call(credit(addr, "conflict", Some("same-key"), 2))
        .await
        .unwrap();
    assert_eq!(other.status(), 409);
    let seen = receipt(&other);
    assert_eq!(
        (seen.key(), seen.attempts(), seen.replayed()),
        ("same-key", 1, false)
    );
    assert_eq!(problem_type(other).await, "payload-mismatch");
    assert_eq!(app.ledger_rows("conflict").await, 1);
}

type Streamed =
    StreamBody<futures_util::stream::Iter<std::vec::IntoIter<Result<Frame<Bytes>, Infallible>>>>;

fn streamed(addr: SocketAddr, key: &str) -> Request<Streamed> {
    let frames = vec![Ok(Frame::data(Bytes::from_static(br#"{"delta": 3}"#)))];
    Request::post(format!("http://{addr}/accounts/streamed/credits"))
        .header("content-type", "application/json")
        .header("x-producer", "client-test")
        .header("idempotency-key", key)
        .body(StreamBody::new(futures_util::stream::iter(frames)))
        .unwrap()
}

#[tokio::test]
async fn a_streamed_body_is_sent_once_and_not_retried_with_a_clear_error() {
    let app = TestApp::new().await;
    let addr = serve(app.credits()).await;
    let mut client = RetryLayer::new(RetryPolicy::default()).layer(hyper_client::<Streamed>());

    // A final answer comes back as usual.
    let response = client
        .ready()
        .await
        .unwrap()
        .call(streamed(addr, "s1"))
        .await
        .unwrap();
    assert_eq!(
        (response.status().as_u16(), receipt(&response).attempts()),
        (201, 1)
    );

    // Nobody listens on this port any more: the connection is refused, and a buffered body
    // would be retried; this one cannot be.
    let gone = closed_port().await;
    let error = client
        .ready()
        .await
        .unwrap()
        .call(streamed(gone, "s2"))
        .await
        .unwrap_err();
    assert_streamed_and_refused(&error);
    assert_eq!(error.key(), Some("s2"), "the caller's key");
    assert_eq!(app.ledger_rows("streamed").await, 1);
}

#[tokio::test]
async fn a_response_lost_after_the_commit_is_replayed_to_the_retry() {
    let app = TestApp::new().await;
    let server = serve(app.credits()).await;
    let proxy = Proxy::start(server).await;
    // The server gets the request and commits; its answer never reaches the client.
    proxy.arm(b"lost-answer-key", Cut::After);
    let mut client = RetryLayer::new(RetryPolicy::default()).layer(hyper_client());

    let response = client
        .ready()
        .await
        .unwrap()
        .call(credit(proxy.addr(), "lost", Some("lost-answer-key"), 5))
        .await
        .unwrap();
    proxy.cut_done().await;
    assert_eq!(response.status(), 201);
    let seen = receipt(&response);
    assert_eq!((seen.attempts(), seen.replayed()), (2, true));
    assert_eq!(app.ledger_rows("lost").await, 1);
    assert_eq!(app.balance("lost").await, Some(5));
}

#[tokio::test]
async fn an_in_flight_duplicate_waits_for_retry_after_then_gets_the_replay() {
    let app = TestApp::new().await;
    let (router, gate, calls) =
        gated_router(&app, |b| b.in_flight_wait(Duration::ZERO).retry_after(1));
    let addr = serve(router).await;

    // The original, straight to the server, held in its handler by the gate.
    let plain = hyper_client::<Full<Bytes>>();
    let original = tokio::spawn(
        plain.request(credit(addr, "gated", Some("busy-key"), 1).map(AttemptBody::Left)),
    );
    gate.started.notified().await;

    // The duplicate through the layer; the test hears of each 409 it gets.
    let conflicts = Arc::new(AtomicUsize::new(0));
    let refused = Arc::new(Notify::new());
    let (count, notify) = (conflicts.clone(), refused.clone());
    let client = ServiceBuilder::new()
        .layer(RetryLayer::new(RetryPolicy::default()))
        .map_response(move |response: Response<_>| {
            if response.status() == 409 {
                count.fetch_add(1, Ordering::SeqCst);
                notify.notify_one();
            }
            response
        })
        .service(hyper_client());
    let duplicate = tokio::spawn(client.oneshot(credit(addr, "gated", Some("busy-key"), 1)));
    refused.notified().await;
    gate.release.notify_one();

    let response = duplicate.await.unwrap().unwrap();
    assert_eq!(original.await.unwrap().unwrap().status(), 201);
    assert_eq!(response.status(), 201);
    assert_waited_out(&receipt(&response), conflicts.load(Ordering::SeqCst));
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the handler ran once");
}
