//! # tower-inbox
//!
//! A Tower layer that makes a retried HTTP command have **at most one committed domain
//! transition**, while an attempt that did not commit stays retryable.
//!
//! ## Quick start
//!
//! ```no_run
//! use axum::{http::StatusCode, routing::post, Router};
//! use tower_inbox::{producer::TrustedHeader, InboxLayer, InboxTx};
//!
//! // The business write goes through the claimed transaction: it commits with the claim.
//! async fn create_order(mut tx: InboxTx, item: String) -> Result<StatusCode, StatusCode> {
//!     sqlx::query("insert into orders (item) values ($1)")
//!         .bind(item)
//!         .execute(&mut *tx)
//!         .await
//!         .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
//!     Ok(StatusCode::CREATED)
//! }
//!
//! # async fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! tower_inbox::migrate(&pool).await?; // the inbox's tables, in the schema `tower_inbox`
//! let inbox = InboxLayer::builder(pool, "orders")
//!     // Who sent the command: in production, your authentication (producer::FromExtension).
//!     .producer(TrustedHeader::new("x-producer"))
//!     .build()?;
//! let app: Router = Router::new()
//!     .route("/orders", post(create_order))
//!     .route_layer(inbox);
//! # let _ = app; Ok(()) }
//! ```
//!
//! `examples/minimal.rs` is this as a service; `examples/credits.rs` is the full demo.
//!
//! ## How it works
//!
//! For each guarded request (by default `POST` and `PATCH`) the layer reads the producer's
//! command ID from `Idempotency-Key`, opens a PostgreSQL transaction and claims
//! `(consumer, producer, message_id)` in it with `INSERT ... ON CONFLICT DO NOTHING`. The
//! handler takes that transaction with the [`InboxTx`] extractor and does its business writes
//! on it. The layer then records the response in the claimed row and commits: the claim, the
//! business change and the recorded response become durable together or not at all. A
//! duplicate gets the recorded response back byte for byte, marked `Idempotent-Replayed:
//! true`; the same key with a different payload is refused.
//!
//! ## Features
//!
//! * `axum` (default): [`InboxTx`] as an axum extractor, `IntoResponse` for
//!   [`Problem`](problem::Problem). Without it the layer serves any Tower HTTP stack, and a
//!   handler takes the transaction with [`InboxTx::from_extensions`].
//! * `outbox-http`: `outbox::HttpTransport`, the dispatcher's HTTP delivery (reqwest).
//! * `tls`: HTTPS for `HttpTransport`.
//! * `nats`: [`consumer::nats`](consumer) and `outbox::NatsTransport`, for NATS JetStream.
//! * `amqp`: RabbitMQ with lapin: `consumer::amqp`, which runs the consumer on deliveries and
//!   acknowledges, requeues or rejects them once the outcome is durable, and
//!   `outbox::AmqpTransport`, which publishes effects with publisher confirms.
//! * `client`: `tower_inbox::client`, the client side: a Tower layer for HTTP clients that
//!   gives each command one `Idempotency-Key`, sends the same key and body on every attempt,
//!   and retries only what is safe to retry, within a budget.
//! * `fuzzing`: the property checks for the fuzz targets in `fuzz/` and their corpus test;
//!   not a stable API.
//!
//! With `default-features = false` the crate pulls neither axum nor reqwest.
//!
//! ## The protocol, per request
//!
//! | situation | response | durable effect |
//! |---|---|---|
//! | method not guarded | the handler's, untouched | none |
//! | guarded, no key, key required (default) | 400 [`key-missing`](problem#key-missing) | none |
//! | key malformed: empty, over 255 characters, not visible ASCII, repeated header, bad RFC 8941 string | 400 [`key-malformed`](problem#key-malformed) | none |
//! | producer scope not available | 401 (or 400) [`producer-missing`](problem#producer-missing) | none |
//! | body over the limit | 413 [`body-too-large`](problem#body-too-large) | none |
//! | first seen; the [`OutcomePolicy`](middleware::OutcomePolicy) commits the status (default: 2xx, 3xx, business 4xx) | the handler's | claim + business writes + recorded response, one commit |
//! | first seen; the handler rejects the request's shape (default: 400, 401, 403, 404, 405, 408, 413, 415, 422, 429) | the handler's | rollback: the key may be reused with a corrected request |
//! | first seen; 5xx, panic (500 [`handler-panicked`](problem#handler-panicked)) or client gone | the handler's | rollback; the failed attempt is counted in `consumer_inbox_failure` |
//! | the pool times out: database down or full | 503 [`unavailable`](problem#unavailable) with `Retry-After` | nothing |
//! | serialization failure or deadlock (claim, handler, record, commit), or a requested re-run | the handler runs again, up to [`TransientRetry`](inbox::TransientRetry) attempts, then 503 [`transaction-conflict`](problem#transaction-conflict) | at most one commit |
//! | the connection is lost at any step, `COMMIT` included | the protocol runs again on another connection, up to [`TransientRetry`](inbox::TransientRetry) attempts plus the pool's size, then 503 [`unavailable`](problem#unavailable) | at most one commit: the new claim decides |
//! | duplicate, same fingerprint | the recorded status, headers and body, plus `Idempotent-Replayed: true` | none |
//! | duplicate, different fingerprint | 409 (or 422) [`payload-mismatch`](problem#payload-mismatch) | none; the original untouched |
//! | duplicate while the original is in flight | waits in the process (one poller per key, no connection held between polls) up to the configured time, then replays, runs (the original rolled back), or 409 [`in-progress`](problem#in-progress) with `Retry-After` | none |
//!
//! ## Map of the crate
//!
//! | module | what it holds |
//! |---|---|
//! | the root | what every user touches: [`InboxLayer`] and its builder, the [`InboxTx`] extractor, [`migrate`], and the identity types [`MessageIdentity`], [`MessageKey`], [`Producer`] |
//! | [`middleware`] | the rest of the Tower adapter: [`InboxService`](middleware::InboxService), the [`OutcomePolicy`](middleware::OutcomePolicy), the [`ReplayCache`](middleware::ReplayCache), the builder's [`ConfigError`](middleware::ConfigError) |
//! | [`consumer`] | broker consumers: one call runs the protocol for a delivered message and says whether to ack, retry or reject |
//! | [`inbox`] | the protocol core, without HTTP: [`Inbox`](inbox::Inbox), [`Claim`](inbox::Claim), [`ClaimedMessage`](inbox::ClaimedMessage), re-runs ([`TransientRetry`](inbox::TransientRetry), [`RetryReason`](inbox::RetryReason)) |
//! | [`fingerprint`] | what makes two payloads the same command |
//! | [`producer`] | where the producer's identity comes from ([`ProducerScope`](producer::ProducerScope)) |
//! | [`problem`] | the RFC 9457 problem+json answers |
//! | [`outbox`] | effects written in the claimed transaction, and their dispatcher |
//! | [`quarantine`] | poison messages and dead effects, and their repair |
//! | [`retention`] | the retention window from failure scenarios, the purge, the guard |
//! | [`replay`] | what a new handler version does with old messages, and compensated migrations |
//! | [`schema`] | the embedded migrations and the schema the tables live in |
//! | [`metrics`] | every metric the crate records, and the stats task |
//!
//! `ARCHITECTURE.md` in the repository follows one request through these.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod body;
#[cfg(feature = "client")]
pub mod client;
mod connection;
pub mod consumer;
mod db;
mod extract;
pub mod fingerprint;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
mod identity;
pub mod inbox;
mod key;
pub mod metrics;
pub mod middleware;
pub mod outbox;
pub mod partition;
pub mod problem;
pub mod producer;
pub mod quarantine;
pub mod replay;
pub mod retention;
mod retry;
pub mod schema;
mod sql;

pub use extract::InboxTx;
pub use identity::{MessageIdentity, Producer, ProducerError, MAX_SCOPE_LEN};
pub use key::{KeyError, MessageKey, MAX_KEY_LEN};
pub use middleware::layer::{InboxLayer, InboxLayerBuilder};

/// Runs the embedded migrations into the default schema, `tower_inbox`, creating it first if
/// it is missing.
///
/// ```no_run
/// # async fn start(pool: sqlx::PgPool) -> Result<(), sqlx::migrate::MigrateError> {
/// tower_inbox::migrate(&pool).await?;
/// # Ok(()) }
/// ```
pub async fn migrate(pool: &sqlx::PgPool) -> Result<(), sqlx::migrate::MigrateError> {
    schema::migrate_schema(pool, &schema::Schema::default()).await
}

/// Compiles the README's code examples as doctests (they use every feature).
#[doc = include_str!("../README.md")]
#[cfg(all(
    doctest,
    feature = "axum",
    feature = "outbox-http",
    feature = "client-reqwest"
))]
pub struct ReadmeDoctests;
