//! The client layer (feature `client`) over hyper-util's client, against the credits
//! service served on a real TCP listener and a real database, and against the credits
//! example's own process, SIGKILLed and started again under the client's load.

mod common;
// The fault suite's driver of the credits example's process.
#[path = "faults/service.rs"]
mod service;

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

/// How the commands of the restart test fared.
#[derive(Default)]
struct Tally {
    commands: usize,
    attempts: usize,
    replayed: usize,
    most_attempts: u32,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_and_restarted_every_command_gets_a_2xx_and_one_ledger_row() {
    const COMMANDS: usize = 500;
    const WORKERS: usize = 8;
    /// A SIGKILL after every this many answered commands: the kills land inside the load
    /// however fast or slow the machine is.
    const KILL_EVERY: usize = 50;

    let app = TestApp::new().await;
    let webhook = common::receiver([]).await;
    let mut service = service::Service::new("client", app.db.url(), &webhook);
    service.start().await;
    let base = service.url("");
    // The default policy but for the attempts: a command whose attempts meet a process
    // still starting on a slow machine is refused quickly over and over; the default time
    // budget (30 s) is what bounds it here.
    let policy = RetryPolicy::default().max_attempts(20);
    let client = RetryLayer::new(policy).layer(hyper_client::<Full<Bytes>>());
    let answered = Arc::new(AtomicUsize::new(0));
    let next = Arc::new(AtomicUsize::new(0));
    let workers: Vec<_> = (0..WORKERS)
        .map(|_| {
            let (mut client, base) = (client.clone(), base.clone());
            let (answered, next) = (answered.clone(), next.clone());
            tokio::spawn(async move {
                let mut tally = Tally::default();
                loop {
                    let n = next.fetch_add(1, Ordering::SeqCst);
                    if n >= COMMANDS {
                        return tally;
                    }
                    // No key: the layer makes one, and keeps it across the kills.
                    let request = Request::post(format!("{base}/accounts/restart-{n}/credits"))
                        .header("content-type", "application/json")
                        .header("x-producer", "client-test")
                        .body(Full::new(Bytes::from_static(br#"{"delta": 1}"#)))
                        .unwrap();
                    let response = client.ready().await.unwrap().call(request).await;
                    let response = response.unwrap_or_else(|e| panic!("command {n}: {e}"));
                    assert!(
                        response.status().is_success(),
                        "command {n}: {}",
                        response.status()
                    );
                    let seen = receipt(&response);
                    tally.commands += 1;
                    tally.attempts += seen.attempts() as usize;
                    tally.replayed += usize::from(seen.replayed());
                    tally.most_attempts = tally.most_attempts.max(seen.attempts());
                    answered.fetch_add(1, Ordering::SeqCst);
                }
            })
        })
        .collect();

    let mut kills = 0;
    let mut kill_at = KILL_EVERY;
    while kill_at < COMMANDS {
        if answered.load(Ordering::SeqCst) >= kill_at {
            service.kill();
            kills += 1;
            tokio::time::sleep(Duration::from_millis(fastrand::u64(0..300))).await;
            service.start().await;
            kill_at += KILL_EVERY;
        }
        if workers.iter().all(|w| w.is_finished()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut total = Tally::default();
    for worker in workers {
        let tally = worker
            .await
            .expect("a worker panicked: see its message above");
        total.commands += tally.commands;
        total.attempts += tally.attempts;
        total.replayed += tally.replayed;
        total.most_attempts = total.most_attempts.max(tally.most_attempts);
    }
    println!(
        "restart: {kills} SIGKILLs, {} starts; {} commands, {} attempts ({} retries, at most {} \
         for one command), {} answers replayed",
        service.starts,
        total.commands,
        total.attempts,
        total.attempts - total.commands,
        total.most_attempts,
        total.replayed,
    );
    assert_eq!(total.commands, COMMANDS);
    assert!(kills >= 1, "no kill happened inside the load");
    let (rows, commands): (i64, i64) = sqlx::query_as(
        "select count(*), count(distinct account_id) from credit_ledger
         where account_id like 'restart-%'",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(
        (rows, commands),
        (COMMANDS as i64, COMMANDS as i64),
        "one row per command"
    );
}
