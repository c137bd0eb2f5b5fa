//! The webhook receiver the example's outbox delivers to: it counts every delivery of every
//! effect, by the effect's idempotency key, and answers 200.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::Router;
use bytes::Bytes;

/// What arrived for one effect.
#[derive(Debug, Clone, Default)]
pub struct Delivered {
    /// The account the webhook's body names: the command it is about.
    pub account: String,
    /// How many times it arrived (more than once: delivered again after a crash or a cut
    /// between the receiver's answer and the dispatcher's record of it).
    pub times: usize,
}

#[derive(Clone)]
pub struct Receiver {
    url: String,
    seen: Arc<Mutex<HashMap<String, Delivered>>>,
}

impl Receiver {
    pub async fn start() -> Self {
        let seen: Arc<Mutex<HashMap<String, Delivered>>> = Arc::default();
        let s = seen.clone();
        let router = Router::new().route(
            "/hook",
            post(move |headers: HeaderMap, body: Bytes| {
                let seen = s.clone();
                async move {
                    let Some(key) = headers.get("idempotency-key").and_then(|v| v.to_str().ok())
                    else {
                        return StatusCode::BAD_REQUEST;
                    };
                    let account = serde_json::from_slice::<serde_json::Value>(&body)
                        .ok()
                        .and_then(|v| v["account_id"].as_str().map(str::to_owned))
                        .unwrap_or_default();
                    let mut seen = seen.lock().unwrap();
                    let entry = seen.entry(key.to_owned()).or_default();
                    entry.account = account;
                    entry.times += 1;
                    StatusCode::OK
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/hook", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, router).await });
        Self { url, seen }
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    /// Every effect that arrived, by its idempotency key.
    pub fn seen(&self) -> HashMap<String, Delivered> {
        self.seen.lock().unwrap().clone()
    }
}
