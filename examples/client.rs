//! Sends credit commands to the running credits example through the client layer and
//! prints, per command, its key, the attempts it took and whether the server replayed it.
//!
//! ```text
//! cargo run --example credits                      # in one terminal
//! cargo run --example client --features client     # in another
//! BASE_URL=http://127.0.0.1:3000 COMMANDS=20 cargo run --example client --features client
//! ```
//!
//! The last line sends the first command again with its key: the server replays it. Stop
//! and restart the credits example while this runs to see the retries.

use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tower::{Layer, Service, ServiceExt};
use tower_inbox::client::{CommandReceipt, RetryLayer, RetryPolicy};

type Error = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> Result<(), Error> {
    let base = std::env::var("BASE_URL").unwrap_or_else(|_| "http://127.0.0.1:3000".to_owned());
    let count: u32 = match std::env::var("COMMANDS") {
        Ok(n) => n.parse().map_err(|e| format!("COMMANDS={n:?}: {e}"))?,
        Err(_) => 5,
    };
    let policy = RetryPolicy::default()
        .max_attempts(8)
        .max_total_time(Duration::from_secs(20));
    let mut client =
        RetryLayer::new(policy).layer(Client::builder(TokioExecutor::new()).build_http());

    let command = |key: Option<&str>, delta: u32| {
        let mut request = Request::post(format!("{base}/accounts/example-client/credits"))
            .header("content-type", "application/json")
            .header("x-producer", "example-client");
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        request.body(Full::new(Bytes::from(format!(r#"{{"delta": {delta}}}"#))))
    };

    println!(
        "{:<38} {:>6} {:>8} {:>8}",
        "key", "status", "attempts", "replayed"
    );
    let mut first_key = None;
    for delta in 1..=count {
        // No key: the layer makes one for the command and keeps it for every attempt.
        let request = command(None, delta)?;
        match client.ready().await?.call(request).await {
            Ok(response) => {
                let receipt = response.extensions().get::<CommandReceipt>().cloned();
                if let Some(receipt) = receipt {
                    print_line(response.status().as_u16(), &receipt);
                    first_key.get_or_insert_with(|| receipt.key().to_owned());
                }
            }
            // The key is in the error: the command can be sent again later, safely.
            Err(e) => println!("{e}"),
        }
    }
    if let Some(key) = first_key {
        let response = client.ready().await?.call(command(Some(&key), 1)?).await?;
        if let Some(receipt) = response.extensions().get::<CommandReceipt>() {
            print_line(response.status().as_u16(), receipt);
        }
    }
    Ok(())
}

fn print_line(status: u16, receipt: &CommandReceipt) {
    println!(
        "{:<38} {:>6} {:>8} {:>8}",
        receipt.key(),
        status,
        receipt.attempts(),
        receipt.replayed()
    );
}
