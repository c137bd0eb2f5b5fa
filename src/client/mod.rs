//! The client side of the protocol (feature `client`): a Tower layer for HTTP clients that
//! sends each command with one `Idempotency-Key`, the same key and the same body on every
//! attempt, retries what is safe to retry, and gives up within a budget.
//!
//! Two front ends share one retry loop and one [`RetryPolicy`]: [`RetryLayer`], for any
//! `tower::Service<http::Request<B>>` (hyper-util's client, for one), and `RetryMiddleware`,
//! a `reqwest_middleware::Middleware` (feature `client-reqwest`).
//!
//! ```no_run
//! use bytes::Bytes;
//! use http::Request;
//! use http_body_util::Full;
//! use tower::{Layer, Service};
//! use tower_inbox::client::{AttemptBody, CommandReceipt, RetryLayer, RetryPolicy};
//!
//! # async fn send<C>(client: C) -> Result<(), Box<dyn std::error::Error>>
//! # where
//! #     C: Service<Request<AttemptBody<Full<Bytes>>>, Response = http::Response<Full<Bytes>>>
//! #         + Clone + Send + 'static,
//! #     C::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
//! #     C::Future: Send,
//! # {
//! // `client`: any `Service<Request<AttemptBody<B>>>`, e.g. hyper-util's legacy client.
//! let mut client = RetryLayer::new(RetryPolicy::default()).layer(client);
//! let request = Request::post("http://127.0.0.1:3000/accounts/alice/credits")
//!     .header("content-type", "application/json")
//!     .body(Full::new(Bytes::from_static(br#"{"delta": 5}"#)))?;
//! let response = client.call(request).await?;
//! let receipt = response.extensions().get::<CommandReceipt>().expect("a command");
//! println!("{} after {} attempts, replayed: {}", receipt.key(), receipt.attempts(), receipt.replayed());
//! # Ok(()) }
//! ```
//!
//! ## Keys
//!
//! A `POST`, `PUT`, `PATCH` or `DELETE` without an `Idempotency-Key` gets one from the
//! policy's [key generator](RetryPolicy::key_generator) (a random v4 UUID by default); a key
//! the caller set is kept. Every attempt carries the same key, method, URI, headers and body
//! bytes. A request with neither a key nor one of those methods passes through once,
//! untouched, without a receipt. A repeated key, or one the server would refuse as
//! malformed (empty, over 255 characters, not visible ASCII), fails before anything is sent.
//!
//! ## Bodies
//!
//! A body is replayable when its exact size is known up front (`Body::size_hint`) and within
//! the [body limit](RetryPolicy::body_limit) (1 MiB by default): `Full<Bytes>`, `Empty`, a
//! boxed `Full`. It is buffered once and each attempt sends the same bytes. Any other body (a
//! stream, or one over the limit) is sent once, as it is: its answer is returned if final,
//! and an answer worth retrying becomes a [`CommandError`] that says why it was not
//! retried ([`GiveUpReason::BodyStreamed`], [`GiveUpReason::BodyOverLimit`]). The inner
//! service takes [`AttemptBody<B>`], which is either.
//!
//! ## What is retried
//!
//! | answer | verdict | reason label |
//! |---|---|---|
//! | the inner service fails with a refused connection: the attempt never reached the server | retried | `refused` |
//! | the inner service fails otherwise: the connection reset, the answer cut off | retried | `transport` |
//! | no answer within the [attempt timeout](RetryPolicy::attempt_timeout) (10 s) | retried | `timeout` |
//! | 429, 502, 503, 504 | retried | `status-<code>` |
//! | 500 | retried (the crate's server rolls back on a 5xx); [`retry_500(false)`](RetryPolicy::retry_500) returns it | `status-500` |
//! | a problem+json answer (the crate's server sends 409) of type [`in-progress`](crate::problem#in-progress) or [`transaction-conflict`](crate::problem#transaction-conflict) | retried | the problem's slug |
//! | 409 [`payload-mismatch`](crate::problem#payload-mismatch) | returned at once | |
//! | 422, any other 4xx, any other 5xx | returned at once | |
//! | 1xx, 2xx, 3xx, and any answer with `Idempotent-Replayed: true` | returned at once | |
//!
//! [`RetryPolicy::retry_status`] and [`RetryPolicy::retry_problem`] change the table.
//! Before retry `n` the layer waits a random time between zero and
//! `min(5 s, 100 ms * 2^(n-1))` (full jitter, [`RetryPolicy::backoff`]), and at least the
//! answer's `Retry-After`, in delta-seconds or as an HTTP-date (RFC 9110 §10.2.3, counted
//! from the client's wall clock).
//!
//! ## Budget
//!
//! At most [10 attempts](RetryPolicy::max_attempts) within [30 s](RetryPolicy::max_total_time)
//! of the first. A wait that would end past the time budget is not begun (a `Retry-After`
//! longer than what is left gives up at once), and an attempt still running at the end of
//! it is abandoned. Giving up returns a [`CommandError`] with the key, the attempts made
//! and the last answer: sending the same command later with that key is still safe.
//! [`CommandError::reached_server`] is `false` when every attempt's connection was refused:
//! then the command cannot have committed.
//!
//! ## What the caller sees
//!
//! A final answer is returned as the server gave it, with a [`CommandReceipt`] in its
//! extensions: the key, the attempts made and whether the server replayed a recorded answer.
//! Each command runs in a `tower_inbox.client.command` span (`message_id`, `attempts`,
//! `outcome`) and each attempt in a `tower_inbox.client.attempt` span (`attempt`,
//! `outcome`), both at `DEBUG`, like the server's. The metrics
//! [`inbox_client_attempts_total`](crate::metrics::CLIENT_ATTEMPTS),
//! [`inbox_client_retries_total`](crate::metrics::CLIENT_RETRIES) (by reason) and
//! [`inbox_client_give_ups_total`](crate::metrics::CLIENT_GIVE_UPS) (by reason) count them.

mod error;
mod key;
mod layer;
#[cfg(feature = "client-reqwest")]
mod middleware;
mod policy;
mod retry_after;
mod run;
#[cfg(test)]
mod tests;

use bytes::Bytes;
use http_body_util::{Either, Full};

pub use error::{CommandError, GiveUpReason, LastAnswer};
pub use layer::{ResponseFuture, RetryLayer, RetryService};
#[cfg(feature = "client-reqwest")]
pub use middleware::RetryMiddleware;
pub use policy::{RetryPolicy, RetryReason};

/// The body the inner service is sent: the buffered bytes of a replayable request (on every
/// attempt), or the caller's own body (on the single attempt of any other).
pub type AttemptBody<B> = Either<Full<Bytes>, B>;

/// The body of the answer: the inner service's, or the bytes the layer read to classify a
/// problem+json answer it returns.
pub type ResponseBody<B> = Either<Full<Bytes>, B>;

/// What the layer did for a command, in the extensions of its final answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommandReceipt {
    key: String,
    attempts: u32,
    replayed: bool,
}

impl CommandReceipt {
    /// The `Idempotency-Key` every attempt carried.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The attempts made, the last included.
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// Whether the server answered from its record (`Idempotent-Replayed: true`): an earlier
    /// attempt, or an earlier sender of the same key, had committed the command.
    pub fn replayed(&self) -> bool {
        self.replayed
    }
}
