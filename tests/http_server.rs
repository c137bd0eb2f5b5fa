//! The credits service over real HTTP on loopback, as a client sees it.

mod common;

use std::sync::Arc;
use std::time::Duration;

use axum::extract::Path;
use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use common::TestApp;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::Notify;
use tower_inbox::producer::TrustedHeader;
use tower_inbox::{InboxLayer, InboxTx};

async fn serve(router: Router) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, router).await });
    addr
}

fn credit_request(account: &str, key: &str, delta: i64) -> String {
    let body = format!(r#"{{"delta": {delta}}}"#);
    format!(
        "POST /accounts/{account}/credits HTTP/1.1\r\nhost: test\r\nidempotency-key: {key}\r\n\
         x-producer: app\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         connection: close\r\n\r\n{body}",
        body.len()
    )
}

/// Sends one request on a fresh connection and reads the response to EOF.
async fn exchange(addr: std::net::SocketAddr, request: &str) -> (u16, String, String) {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    stream.write_all(request.as_bytes()).await.expect("write");
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut raw))
        .await
        .expect("response within 30 s")
        .expect("read");
    let text = String::from_utf8(raw).expect("utf-8 response");
    let (head, body) = text.split_once("\r\n\r\n").expect("head and body");
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("status");
    (status, head.to_ascii_lowercase(), body.to_owned())
}

#[tokio::test]
async fn a_client_retrying_over_http_gets_one_credit() {
    let app = TestApp::new().await;
    let addr = serve(app.credits()).await;

    let (status, head, body) = exchange(addr, &credit_request("a1", "7f1c", 10)).await;
    assert_eq!(status, 201);
    assert!(!head.contains("idempotent-replayed"));
    assert_eq!(body, r#"{"account_id":"a1","balance":10,"delta":10}"#);

    let (status, head, replayed) = exchange(addr, &credit_request("a1", "7f1c", 10)).await;
    assert_eq!(status, 201);
    assert!(head.contains("idempotent-replayed: true"), "{head}");
    assert_eq!(replayed, body);

    let (status, head, problem) = exchange(addr, &credit_request("a1", "7f1c", 11)).await;
    assert_eq!(status, 409);
    assert!(head.contains("content-type: application/problem+json"));
    assert!(problem.contains("#payload-mismatch"), "{problem}");

    let get = "GET /accounts/a1 HTTP/1.1\r\nhost: test\r\nconnection: close\r\n\r\n";
    let (status, _, account) = exchange(addr, get).await;
    assert_eq!(status, 200);
    assert_eq!(account, r#"{"account_id":"a1","balance":10}"#);
    assert_eq!(app.ledger_rows("a1").await, 1);
}

#[tokio::test]
async fn a_client_disconnecting_mid_handler_rolls_back_over_http() {
    let app = TestApp::new().await;
    let started = Arc::new(Notify::new());
    let release = Arc::new(Notify::new());
    let handler = {
        let (started, release) = (started.clone(), release.clone());
        move |Path(account): Path<String>, mut tx: InboxTx| {
            let (started, release) = (started.clone(), release.clone());
            async move {
                sqlx::query("insert into credit_account (account_id, balance) values ($1, 1)")
                    .bind(&account)
                    .execute(&mut *tx)
                    .await
                    .expect("write");
                started.notify_one();
                release.notified().await;
                StatusCode::CREATED
            }
        }
    };
    let layer = InboxLayer::builder(app.pool.clone(), "credits")
        .producer(TrustedHeader::new("x-producer"))
        .in_flight_wait(Duration::from_secs(30))
        .build()
        .expect("layer");
    let router = Router::new()
        .route("/accounts/{account}/credits", post(handler))
        .layer(layer);
    let addr = serve(router).await;

    let mut stream = TcpStream::connect(addr).await.expect("connect");
    stream
        .write_all(credit_request("a1", "k", 1).as_bytes())
        .await
        .expect("write");
    started.notified().await;
    drop(stream);

    // The server notices the closed connection, drops the handler and rolls back.
    let (attempts, reason) = app.wait_for_failures("app", "k", 1).await;
    assert_eq!((attempts, reason.as_str()), (1, "client-gone"));

    release.notify_one(); // lets the retry's handler finish at once
    let (status, _, _) = exchange(addr, &credit_request("a1", "k", 1)).await;
    assert_eq!(status, 201);
    assert_eq!(app.balance("a1").await, Some(1));
    assert_eq!(app.inbox_rows().await, 1);
}
