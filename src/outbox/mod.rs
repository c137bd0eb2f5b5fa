//! The transactional outbox: external effects written in the handler's transaction and
//! delivered later by a [`Dispatcher`].
//!
//! (Over 400 lines: the enqueue functions and the guarantee they document, one place for both.)
//!
//! The inbox prevents duplicate domain decisions; the outbox makes the intended external
//! effect durable. A handler never calls another service inside its transaction: that is not
//! atomic, it only holds locks across a network call. It [`enqueue`]s the effect instead. The
//! row commits with the claim and the business change, or not at all, and its effect ID is
//! derived from the message identity, so one command can never produce two effects.
//!
//! **Delivery guarantee.** At least once, always with the same idempotency key (the effect
//! ID, sent by [`HttpTransport`] as `Idempotency-Key` and by `AmqpTransport` as
//! `message_id`). An effect happens exactly once only where the receiver deduplicates by
//! that key, because some deliveries are repeated:
//!
//! * after an ambiguous outcome (a timeout, a lost connection, a 5xx, a [`Transport`] that
//!   panicked) the dispatcher cannot know whether the receiver applied the effect, so it
//!   delivers again;
//! * a dispatcher that dies after a send and before recording its outcome, or cannot record
//!   it (its database fails, or is so slow that the lease runs out first), leaves the effect
//!   pending; when the lease runs out another dispatcher sends again.
//!
//! Nothing else repeats a delivery. Each send runs under a lease renewed right before it
//! starts (a batch is leased at once, but its later sends may start long after), and the
//! send is skipped when another dispatcher has taken the effect meanwhile; an outcome is
//! recorded only while that lease holds, and the lease must outlast the delivery timeout.
//! What a receiver answered cannot make a finished delivery unrecordable either (next
//! paragraph).
//!
//! **What is recorded.** The receiver's answer ([`OutboxEntry::remote_result`]) and the last
//! failure ([`OutboxEntry::last_error`]) are excerpts: text with NUL characters replaced by
//! U+FFFD and at most 64 KiB, cut on a character boundary, whatever a transport returns.
//! [`HttpTransport`] reads at most 64 KiB of a body (invalid UTF-8 replaced), and only for a
//! short window once the status is known: the status decides the outcome, and a body that is
//! slow or never ends shortens the excerpt but never turns a 2xx into a retry. It ends each
//! call within its timeout, and the dispatcher refuses a delivery timeout shorter than that
//! ([`Transport::call_timeout`]), so it never cuts off a call whose answer has arrived.
//!
//! **Refusals.** [`HttpTransport`] does not follow redirects: a 3xx, or a redirect that a
//! client of the caller's own followed, is a permanent `http-redirect` failure naming the
//! `Location`. A destination that is not an absolute `http` or `https` URL is a permanent
//! `invalid-destination` failure. Both go to dead letters and the quarantine at once, where a
//! person can fix the receiver and repair the item.
//!
//! **Panics.** A [`Transport`] that panics fails that attempt like [`Delivery::Retry`]: backoff,
//! then dead letters (`attempts-exhausted`) after the last attempt. The dispatcher logs a
//! warning with the effect ID (not the panic's message) and goes on with the other effects;
//! the process's panic hook still reports the panic as usual.
//!
//! ```no_run
//! use axum::http::StatusCode;
//! use tower_inbox::outbox::{enqueue, OutboxMessage};
//! use tower_inbox::InboxTx;
//!
//! async fn credit(mut tx: InboxTx) -> StatusCode {
//!     // ... business writes on `tx` ...
//!     let identity = tx.identity().clone();
//!     let message = OutboxMessage::new("http://mailer.internal/send", r#"{"template":"credited"}"#)
//!         .header("content-type", "application/json");
//!     match enqueue(&mut *tx, &identity, "email", &message).await {
//!         Ok(_) => StatusCode::CREATED,
//!         Err(_) => StatusCode::INTERNAL_SERVER_ERROR, // rolls the whole command back
//!     }
//! }
//! ```

// The `HttpTransport` links resolve with `outbox-http` only (docs.rs builds every feature).
#![cfg_attr(not(feature = "outbox-http"), allow(rustdoc::broken_intra_doc_links))]

#[cfg(feature = "amqp")]
mod amqp;
mod dispatcher;
#[cfg(feature = "outbox-http")]
mod http;
mod listing;
#[cfg(feature = "nats")]
mod nats;
mod sql;
mod transport;

use std::fmt;

use bytes::Bytes;
use sha2::{Digest, Sha256};
use sqlx::{Executor, PgPool, Postgres, Row};

use crate::identity::MessageIdentity;
use crate::schema::{Layout, Schema};

#[cfg(feature = "amqp")]
pub use amqp::AmqpTransport;
pub use dispatcher::{DispatchReport, Dispatcher, DispatcherBuilder, DispatcherConfigError};
#[cfg(feature = "outbox-http")]
pub use http::HttpTransport;
pub use listing::{EffectStatus, OutboxEntry, OutboxFilter};
#[cfg(feature = "nats")]
pub use nats::NatsTransport;
pub use transport::{Delivery, Transport};

crate::db::database_error!(
    /// A failure of the outbox's database work.
    OutboxError,
    "the outbox"
);

/// The stable ID of one external effect, also its idempotency key at the receiver.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct EffectId(String);

impl EffectId {
    /// The effect `effect_name` of the message `identity`: the same inputs always give the
    /// same ID, so re-running a command cannot create a second effect.
    ///
    /// ```
    /// use tower_inbox::outbox::EffectId;
    /// use tower_inbox::{MessageIdentity, MessageKey, Producer};
    ///
    /// let id = MessageIdentity::new("credits", Producer::new("app").unwrap(), MessageKey::new("k1").unwrap());
    /// assert_eq!(EffectId::for_message(&id, "webhook"), EffectId::for_message(&id, "webhook"));
    /// assert_ne!(EffectId::for_message(&id, "webhook"), EffectId::for_message(&id, "email"));
    /// ```
    pub fn for_message(identity: &MessageIdentity, effect_name: &str) -> Self {
        let mut hasher = Sha256::new();
        hasher.update(b"tower-inbox/effect/v1");
        for part in [
            identity.consumer(),
            identity.producer().name(),
            identity.tenant_column(),
            identity.message_id().as_str(),
            effect_name,
        ] {
            hasher.update((part.len() as u64).to_be_bytes());
            hasher.update(part.as_bytes());
        }
        let digest = hasher.finalize();
        Self(crate::fingerprint::Fingerprint::from_digest(digest.into()).to_hex())
    }

    /// An ID chosen by the caller, for effects that do not come from an inbox message. It
    /// must be stable across retries of whatever enqueues it.
    pub fn new(id: impl Into<String>) -> Self {
        Self(id.into())
    }

    /// The ID as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for EffectId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "EffectId({})", self.0)
    }
}

impl fmt::Display for EffectId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// What to deliver: a destination the [`Transport`] understands (a URL for
/// [`HttpTransport`]), a payload and headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxMessage {
    destination: String,
    payload: Bytes,
    headers: Vec<(String, String)>,
}

impl OutboxMessage {
    /// A message to `destination` with `payload`.
    pub fn new(destination: impl Into<String>, payload: impl Into<Bytes>) -> Self {
        Self {
            destination: destination.into(),
            payload: payload.into(),
            headers: Vec::new(),
        }
    }

    /// Adds a header sent with every delivery attempt.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }
}

/// The result of [`enqueue`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Enqueued {
    /// The effect's ID.
    pub effect_id: EffectId,
    /// `false` when the effect was already in the outbox (the same command enqueued it).
    pub inserted: bool,
}

/// Writes the effect `effect_name` of the message `identity` to the outbox in the default
/// schema, on `conn`: the claimed transaction (`&mut *tx` for an
/// [`InboxTx`](crate::InboxTx), `&mut message` for a
/// [`ClaimedMessage`](crate::inbox::ClaimedMessage), both watched for serialization failures and
/// deadlocks) or any sqlx connection or transaction (`&mut *sqlx_tx`).
///
/// Dispatchers are woken when the transaction commits; a rollback leaves no trace. In a
/// handler, [`ClaimedMessage::enqueue`](crate::inbox::ClaimedMessage::enqueue) does the same in the
/// layer's schema; [`Outbox::enqueue`] takes the schema of its outbox.
pub async fn enqueue<'c>(
    conn: impl Executor<'c, Database = Postgres>,
    identity: &MessageIdentity,
    effect_name: &str,
    message: &OutboxMessage,
) -> Result<Enqueued, OutboxError> {
    Ok(enqueue_in(&Schema::default(), conn, identity, effect_name, message).await?)
}

/// [`enqueue`] in `schema`, failing with the statement's own error (the inbox classifies it
/// as its own when the claimed transaction enqueues).
pub(crate) async fn enqueue_in<'c>(
    schema: &Schema,
    conn: impl Executor<'c, Database = Postgres>,
    identity: &MessageIdentity,
    effect_name: &str,
    message: &OutboxMessage,
) -> Result<Enqueued, sqlx::Error> {
    let effect_id = EffectId::for_message(identity, effect_name);
    insert(
        schema,
        conn,
        &effect_id,
        effect_name,
        Some(identity),
        message,
    )
    .await
}

/// Like [`enqueue`], with an effect ID chosen by the caller and no message identity.
pub async fn enqueue_with_id<'c>(
    conn: impl Executor<'c, Database = Postgres>,
    effect_id: EffectId,
    effect_name: &str,
    message: &OutboxMessage,
) -> Result<Enqueued, OutboxError> {
    Ok(insert(
        &Schema::default(),
        conn,
        &effect_id,
        effect_name,
        None,
        message,
    )
    .await?)
}

async fn insert<'c>(
    schema: &Schema,
    conn: impl Executor<'c, Database = Postgres>,
    effect_id: &EffectId,
    effect_name: &str,
    identity: Option<&MessageIdentity>,
    message: &OutboxMessage,
) -> Result<Enqueued, sqlx::Error> {
    let names: Vec<&str> = message.headers.iter().map(|(n, _)| n.as_str()).collect();
    let values: Vec<&str> = message.headers.iter().map(|(_, v)| v.as_str()).collect();
    let sql = schema.sql_for(sql::ENQUEUE, sql::ENQUEUE_PARTITIONED);
    let query = sqlx::query(&sql)
        .bind(effect_id.as_str())
        .bind(effect_name)
        .bind(identity.map(|i| i.consumer().as_bytes()))
        .bind(identity.map(|i| i.producer().name().as_bytes()))
        .bind(identity.map(|i| i.tenant_column().as_bytes()))
        .bind(identity.map(|i| i.message_id().as_str()))
        .bind(&message.destination)
        .bind(&message.payload[..])
        .bind(names)
        .bind(values);
    let inserted = match schema.layout() {
        Layout::Plain => query.execute(conn).await?.rows_affected() == 1,
        Layout::Partitioned => query.fetch_one(conn).await?.try_get(0)?,
    };
    Ok(Enqueued {
        effect_id: effect_id.clone(),
        inserted,
    })
}

/// One effect as the dispatcher hands it to a [`Transport`].
#[derive(Debug, Clone)]
pub struct Effect {
    /// The stable ID: send it as the idempotency key.
    pub effect_id: EffectId,
    /// The effect's name, e.g. `webhook`.
    pub effect_name: String,
    /// Where to deliver it.
    pub destination: String,
    /// What to deliver.
    pub payload: Bytes,
    /// The headers enqueued with it.
    pub headers: Vec<(String, String)>,
    /// Which attempt this is, from 1.
    pub attempt: i32,
}

/// The outbox in one schema: writes effects, reads them back.
///
/// With the [partitioned layout](crate::partition) (a [`Schema`] with
/// [`Layout::Partitioned`]), an enqueue takes an advisory lock on the effect ID until its
/// transaction ends, then writes the effect unless a row of the ID exists in any partition;
/// a second enqueue of the ID waits for the first's transaction. It must run at `READ
/// COMMITTED`: in a transaction of the caller's own at `REPEATABLE READ` or `SERIALIZABLE`
/// it fails with [`OutboxError::Database`] (SQLSTATE `0A000`) and writes nothing.
#[derive(Debug, Clone)]
pub struct Outbox {
    pool: PgPool,
    schema: Schema,
}

impl Outbox {
    /// The outbox over `pool`, in the default schema.
    pub fn new(pool: PgPool) -> Self {
        Self {
            pool,
            schema: Schema::default(),
        }
    }

    /// The outbox's tables are in `schema`.
    pub fn with_schema(mut self, schema: Schema) -> Self {
        self.schema = schema;
        self
    }

    /// [`enqueue`], in this outbox's schema.
    pub async fn enqueue<'c>(
        &self,
        conn: impl Executor<'c, Database = Postgres>,
        identity: &MessageIdentity,
        effect_name: &str,
        message: &OutboxMessage,
    ) -> Result<Enqueued, OutboxError> {
        Ok(enqueue_in(&self.schema, conn, identity, effect_name, message).await?)
    }

    /// [`enqueue_with_id`], in this outbox's schema.
    pub async fn enqueue_with_id<'c>(
        &self,
        conn: impl Executor<'c, Database = Postgres>,
        effect_id: EffectId,
        effect_name: &str,
        message: &OutboxMessage,
    ) -> Result<Enqueued, OutboxError> {
        Ok(insert(&self.schema, conn, &effect_id, effect_name, None, message).await?)
    }
}
