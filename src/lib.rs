//! # tower-inbox
//!
//! A Tower layer that makes a retried HTTP command have **at most one committed domain
//! transition**, while an attempt that did not commit stays retryable.
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
//! ## The protocol, per request
//!
//! | situation | response | durable effect |
//! |---|---|---|
//! | method not guarded | the handler's, untouched | none |
//! | guarded, no key, key required (default) | 400 [`key-missing`](problem#key-missing) | none |
//! | key malformed: empty, over 255 characters, not visible ASCII, repeated header, bad RFC 8941 string | 400 [`key-malformed`](problem#key-malformed) | none |
//! | producer scope not available | 401 (or 400) [`producer-missing`](problem#producer-missing) | none |
//! | body over the limit | 413 [`body-too-large`](problem#body-too-large) | none |
//! | first seen; the [`OutcomePolicy`] commits the status (default: 2xx, 3xx, business 4xx) | the handler's | claim + business writes + recorded response, one commit |
//! | first seen; the handler rejects the request's shape (default: 400, 401, 403, 404, 405, 408, 413, 415, 422, 429) | the handler's | rollback: the key may be reused with a corrected request |
//! | first seen; 5xx, panic (500 [`handler-panicked`](problem#handler-panicked)) or client gone | the handler's | rollback; the failed attempt is counted in `consumer_inbox_failure` |
//! | the pool times out: database down or full | 503 [`unavailable`](problem#unavailable) with `Retry-After` | nothing |
//! | serialization failure or deadlock (claim, handler, record, commit), or a requested re-run | the handler runs again, up to [`TransientRetry`] attempts, then 503 [`transaction-conflict`](problem#transaction-conflict) | at most one commit |
//! | the connection is lost at any step, `COMMIT` included | the protocol runs again on another connection, up to [`TransientRetry`] attempts plus the pool's size, then 503 [`unavailable`](problem#unavailable) | at most one commit: the new claim decides |
//! | duplicate, same fingerprint | the recorded status, headers and body, plus `Idempotent-Replayed: true` | none |
//! | duplicate, different fingerprint | 409 (or 422) [`payload-mismatch`](problem#payload-mismatch) | none; the original untouched |
//! | duplicate while the original is in flight | waits in the process (one poller per key, no connection held between polls) up to the configured time, then replays, runs (the original rolled back), or 409 [`in-progress`](problem#in-progress) with `Retry-After` | none |
//!
//! ## Pieces
//!
//! * [`InboxLayer`] / [`InboxService`]: the Tower adapter ([`middleware`]).
//! * [`InboxTx`]: the extractor for the claimed transaction.
//! * [`Inbox`], [`Claim`], [`ClaimedMessage`]: the protocol core, usable without HTTP (a
//!   broker consumer claims and commits the same way).
//! * [`MessageKey`], [`Fingerprint`], [`MessageIdentity`], [`Producer`]: identity.
//! * [`replay`]: what a new handler version does with old messages
//!   ([`ReplayPolicy`](replay::ReplayPolicy)), and
//!   [`CompensatedMigration`](replay::CompensatedMigration) to correct past effects with
//!   exactly-once steps.
//! * [`retention`]: the retention window from failure scenarios, the purge, and the guard
//!   against messages older than the window.
//! * [`migrate`] / [`migrate_schema`] / [`MIGRATOR`], [`Schema`]: the embedded migrations and
//!   the schema the tables live in (`tower_inbox` unless configured).
//! * [`TransientRetry`], [`IsolationLevel`], [`RetryReason`]: re-runs after serialization
//!   failures and deadlocks.
//! * [`ClaimMode`], [`ReplayCache`]: claim at commit, and answer duplicates from memory.
//! * [`metrics`]: every metric the crate records, and the stats task.
//! * [`outbox`], [`quarantine`], [`replay`]: effects, poison messages, handler versions.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod cache;
mod extract;
mod fingerprint;
mod identity;
pub mod inbox;
mod key;
pub mod metrics;
pub mod middleware;
pub mod outbox;
mod outcome;
pub mod problem;
pub mod producer;
pub mod quarantine;
pub mod replay;
pub mod retention;
mod retry;
mod schema;

pub use cache::ReplayCache;
pub use extract::InboxTx;
pub use fingerprint::{CommandPayload, Fingerprint, FingerprintStrategy};
pub use identity::{MessageIdentity, Producer, ProducerError, MAX_SCOPE_LEN};
pub use inbox::{
    Claim, ClaimMode, ClaimedMessage, Inbox, InboxEntry, InboxError, IsolationLevel,
    RecordedResponse, RetryReason,
};
pub use key::{KeyError, MessageKey, MAX_KEY_LEN};
pub use middleware::{ConfigError, InboxLayer, InboxLayerBuilder, InboxService};
pub use outcome::{Outcome, OutcomePolicy, DEFAULT_REJECTIONS};
pub use producer::ProducerScope;
pub use retry::TransientRetry;
pub use schema::{migrate, migrate_schema, Schema, SchemaError, DEFAULT_SCHEMA, MIGRATOR};

/// Compiles the README's code examples as doctests.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
