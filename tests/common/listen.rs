//! The credits service on a real loopback listener, for tests that call it over TCP.

use std::net::SocketAddr;

use axum::Router;

/// Serves `router` on a loopback port until the test's runtime ends.
pub async fn serve(router: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await });
    addr
}

/// An address nobody listens on (a port that was just free): connecting is refused.
pub async fn closed_port() -> SocketAddr {
    let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    closed.local_addr().unwrap()
}

/// The slug of a problem+json body's `type` (`payload-mismatch`, ...).
pub fn problem_slug(body: &[u8]) -> String {
    let json: serde_json::Value = serde_json::from_slice(body).unwrap();
    let uri = json["type"].as_str().unwrap();
    uri.rsplit_once('#').unwrap().1.to_owned()
}
