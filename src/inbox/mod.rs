//! The protocol core: claim, look up, record and commit. Nothing here knows about HTTP, so a
//! message-broker consumer uses the same calls as the Tower layer.
//!
//! ```no_run
//! use std::time::Duration;
//! use tower_inbox::{Claim, Fingerprint, Inbox, MessageIdentity, MessageKey, Producer};
//!
//! # async fn consume(pool: sqlx::PgPool, body: &[u8]) -> Result<(), Box<dyn std::error::Error>> {
//! let inbox = Inbox::new(pool);
//! let identity = MessageIdentity::new(
//!     "ledger-projector",
//!     Producer::new("payments")?,
//!     MessageKey::new("evt-0042")?,
//! );
//! match inbox
//!     .claim(identity, Fingerprint::of_bytes(body), "v3", Duration::from_secs(1))
//!     .await?
//! {
//!     Claim::Claimed(mut message) => {
//!         sqlx::query("update account set balance = balance + 10 where id = 'a1'")
//!             .execute(&mut message)
//!             .await?;
//!         message.commit(None).await?; // claim and business change become durable together
//!     }
//!     Claim::Duplicate(_) => { /* already applied: just acknowledge */ }
//!     Claim::Conflict(_) => { /* same ID, different payload: quarantine */ }
//!     Claim::InProgress => { /* another worker holds it: redeliver later */ }
//! }
//! # Ok(()) }
//! ```

mod executor;
mod literal;
mod sql;
mod tx;

use std::ops::{Deref, DerefMut};
use std::time::{Duration, Instant};

use bytes::Bytes;
use sqlx::postgres::{PgConnection, PgPool, PgRow};
use sqlx::Row;
use tracing::Instrument;

use crate::fingerprint::Fingerprint;
use crate::identity::{bind_identity, MessageIdentity};
use crate::metrics::{self as m, MetricLabels};
use crate::quarantine::{identity_item_key, QuarantineSource};
use tx::OpenTx;

/// The embedded migrations that create the inbox tables and the claim function.
///
/// Run them with [`migrate`], or copy `migrations/` into the application's own migration
/// directory and run `sqlx migrate run`.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// Runs the embedded migrations.
///
/// Migrations the application applied through the same `_sqlx_migrations` table are
/// tolerated (they are not ours to check), so an application may run its own migrator with
/// `set_ignore_missing(true)` beside this one.
pub async fn migrate(pool: &PgPool) -> Result<(), sqlx::migrate::MigrateError> {
    let mut migrator = sqlx::migrate!("./migrations");
    migrator.set_ignore_missing(true);
    migrator.run(pool).await
}

/// A failure of the inbox's own database work.
#[derive(Debug, thiserror::Error)]
pub enum InboxError {
    /// The database cannot be reached or has no room right now (connection refused, pool
    /// timed out, server shutting down, too many connections). Retrying later may succeed.
    #[error("the inbox database is unavailable: {0}")]
    Unavailable(#[source] sqlx::Error),
    /// A serialization failure or deadlock: the transaction can be retried from the start.
    #[error("the inbox transaction hit a transient conflict: {0}")]
    Transient(#[source] sqlx::Error),
    /// The transaction was rolled back instead of committed because it has to be re-run:
    /// a watched statement failed with a serialization failure or deadlock (which aborted
    /// it), or a re-run was requested with [`ClaimedMessage::request_retry`]. A claim also
    /// answers it when the key it found taken kept vanishing before it could read the row
    /// (three times; a purge racing it), like the serialization failure it is.
    #[error("the inbox transaction was rolled back to be re-run ({0})")]
    Rerun(RetryReason),
    /// (Claim at commit only.) Another transaction claimed the message first: everything
    /// this one wrote was rolled back. [`Inbox::lookup`] tells what the inbox holds.
    #[error("the message was claimed by another transaction; this one was rolled back")]
    ClaimedElsewhere,
    /// Any other database error, such as missing migrations.
    #[error("the inbox query failed: {0}")]
    Database(#[source] sqlx::Error),
}

impl InboxError {
    pub(crate) fn classify(err: sqlx::Error) -> Self {
        use sqlx::Error as E;
        match &err {
            E::Io(_)
            | E::Tls(_)
            | E::PoolTimedOut
            | E::PoolClosed
            | E::WorkerCrashed
            | E::Protocol(_) => Self::Unavailable(err),
            E::Database(db) => match db.code().as_deref() {
                Some("40001" | "40P01") => Self::Transient(err),
                // connection exceptions, insufficient resources, operator intervention
                Some(code)
                    if code.starts_with("08")
                        || code.starts_with("53")
                        || matches!(code, "57P01" | "57P02" | "57P03") =>
                {
                    Self::Unavailable(err)
                }
                _ => Self::Database(err),
            },
            _ => Self::Database(err),
        }
    }

    /// Whether a later retry of the whole command may succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            Self::Unavailable(_) | Self::Transient(_) | Self::Rerun(_)
        )
    }

    /// Counts the error in [`DATABASE_ERRORS`](m::DATABASE_ERRORS); serialization failures
    /// and deadlocks are contention, not errors, and are counted as re-runs instead.
    fn count(&self, consumer: &[::metrics::Label]) {
        if !matches!(
            self,
            Self::Transient(_) | Self::Rerun(_) | Self::ClaimedElsewhere
        ) {
            m::count_with(m::DATABASE_ERRORS, consumer, "kind", self.kind());
        }
    }

    /// The kind, as a stable span field and metric label.
    fn kind(&self) -> &'static str {
        match self {
            Self::Unavailable(_) => "unavailable",
            Self::Transient(_) | Self::Rerun(_) => "transient",
            Self::ClaimedElsewhere => "claimed-elsewhere",
            Self::Database(_) => "internal",
        }
    }

    /// Why the transaction should be re-run, for a serialization failure or a deadlock.
    pub fn retry_reason(&self) -> Option<RetryReason> {
        match self {
            Self::Transient(err) => RetryReason::of(err),
            Self::Rerun(reason) => Some(*reason),
            _ => None,
        }
    }
}

/// Why a transaction is rolled back and re-run from the start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RetryReason {
    /// `40001`: the transaction could not be serialized with a concurrent one.
    SerializationFailure,
    /// `40P01`: the transaction was chosen as the victim of a deadlock.
    Deadlock,
    /// The handler asked for it ([`ClaimedMessage::request_retry`]).
    Requested,
}

impl RetryReason {
    /// The stable name, also a metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::SerializationFailure => "serialization-failure",
            Self::Deadlock => "deadlock",
            Self::Requested => "requested",
        }
    }

    /// The reason a database error calls for a re-run, if it does.
    ///
    /// ```
    /// use tower_inbox::RetryReason;
    /// assert_eq!(RetryReason::of(&sqlx::Error::RowNotFound), None);
    /// ```
    pub fn of(err: &sqlx::Error) -> Option<Self> {
        match err {
            sqlx::Error::Database(db) => match db.code().as_deref() {
                Some("40001") => Some(Self::SerializationFailure),
                Some("40P01") => Some(Self::Deadlock),
                _ => None,
            },
            _ => None,
        }
    }
}

impl std::fmt::Display for RetryReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The isolation level claimed transactions run at.
///
/// The claim is correct at every level: under `RepeatableRead` and `Serializable` a claim
/// that meets a concurrently committed original fails with a serialization failure instead of
/// reading it, and the re-run (a new transaction, a new snapshot) sees it as a duplicate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IsolationLevel {
    /// `READ COMMITTED`, PostgreSQL's own default (the default here too).
    #[default]
    ReadCommitted,
    /// `REPEATABLE READ`: one snapshot for the whole handler.
    RepeatableRead,
    /// `SERIALIZABLE`: as if the transactions ran one at a time; expect serialization
    /// failures under contention, which are re-run.
    Serializable,
}

impl IsolationLevel {
    fn begin(self) -> &'static str {
        match self {
            Self::ReadCommitted => "BEGIN ISOLATION LEVEL READ COMMITTED",
            Self::RepeatableRead => "BEGIN ISOLATION LEVEL REPEATABLE READ",
            Self::Serializable => "BEGIN ISOLATION LEVEL SERIALIZABLE",
        }
    }
}

/// When the layer claims a command's identity in its transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ClaimMode {
    /// The claim is the transaction's first statement (the default). A duplicate of a
    /// finished command is answered before the handler runs, and one of an in-flight
    /// command waits for it there. Costs one statement more than the handler alone, plus the
    /// record.
    #[default]
    First,
    /// The handler's statements run first; the inbox row, with the recorded response, is
    /// inserted last with `ON CONFLICT DO NOTHING`, one statement fewer per command. If the
    /// key was claimed meanwhile, the whole transaction rolls back and the recorded response
    /// is replayed (or the conflict or in-progress answer given): at most one transition
    /// still commits. The trade-off: **a duplicate runs the handler before it is rolled
    /// back**, so use it only for handlers whose every effect is in the transaction (outbox
    /// effects included), and expect duplicates to cost a full handler run (a
    /// [`ReplayCache`](crate::ReplayCache) answers most of them before that).
    AtCommit,
}

/// A response (or any outcome) recorded with the claim, replayed byte for byte to duplicates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordedResponse {
    /// The status code.
    pub status: u16,
    /// Header names and values in the order they were sent; names in lowercase.
    pub headers: Vec<(String, Vec<u8>)>,
    /// The complete body.
    pub body: Bytes,
}

/// What the inbox holds for a message that was claimed before.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InboxEntry {
    /// The fingerprint of the payload that claimed it, in hex.
    pub payload_sha256: String,
    /// The handler version that processed (or is processing) it.
    pub handler_version: String,
    /// Whether the outcome is recorded. A committed claim made by the layer always is.
    pub processed: bool,
    /// The recorded response, if the consumer recorded one.
    pub response: Option<RecordedResponse>,
}

/// The result of a claim attempt.
#[derive(Debug)]
pub enum Claim {
    /// This transaction owns first processing: do the business writes on it, then
    /// [`ClaimedMessage::commit`].
    Claimed(ClaimedMessage),
    /// A duplicate with the same fingerprint; its recorded outcome.
    Duplicate(InboxEntry),
    /// The same identity was claimed with a different fingerprint: a producer contract
    /// violation. The original is untouched.
    Conflict(InboxEntry),
    /// The original is still being processed and did not finish within the wait.
    InProgress,
}

/// The inbox: claims messages in a transaction of their own pool.
#[derive(Clone, Debug)]
pub struct Inbox {
    pool: PgPool,
    isolation: IsolationLevel,
    labels: MetricLabels,
}

impl Inbox {
    /// An inbox over a pool whose database has the [`MIGRATOR`] migrations applied; claims
    /// run at `READ COMMITTED` and metrics carry the consumer label.
    pub fn new(pool: PgPool) -> Self {
        Self {
            pool,
            isolation: IsolationLevel::default(),
            labels: MetricLabels::default(),
        }
    }

    /// Claims run at `level`.
    pub fn with_isolation(mut self, level: IsolationLevel) -> Self {
        self.isolation = level;
        self
    }

    /// Which identity labels this inbox's [metrics](crate::metrics) carry.
    pub fn with_metric_labels(mut self, labels: MetricLabels) -> Self {
        self.labels = labels;
        self
    }

    /// The pool claims are made from.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The isolation level claims run at.
    pub fn isolation(&self) -> IsolationLevel {
        self.isolation
    }

    /// The identity labels metrics carry.
    pub fn metric_labels(&self) -> MetricLabels {
        self.labels
    }

    /// Classifies an error of the inbox's own database work and counts it.
    fn failed(&self, consumer: &str, err: sqlx::Error) -> InboxError {
        let err = InboxError::classify(err);
        err.count(&self.labels.of_consumer(consumer));
        err
    }

    /// Opens a transaction and claims `identity` in it with `INSERT ... ON CONFLICT DO
    /// NOTHING`.
    ///
    /// If another transaction holds an uncommitted claim of the same identity, this waits up
    /// to `wait` for it: if it commits, the result is [`Claim::Duplicate`] or
    /// [`Claim::Conflict`]; if it rolls back, this claim wins; otherwise
    /// [`Claim::InProgress`]. The wait holds a pooled connection.
    pub async fn claim(
        &self,
        identity: MessageIdentity,
        fingerprint: Fingerprint,
        handler_version: &str,
        wait: Duration,
    ) -> Result<Claim, InboxError> {
        let span = tracing::debug_span!(
            "inbox.claim",
            consumer = %identity.consumer(),
            producer = %identity.producer().name(),
            message_id = %identity.message_id(),
            outcome = tracing::field::Empty,
        );
        let labels = self.labels.of(&identity);
        let claim = self
            .claim_in_span(identity, fingerprint, handler_version, wait)
            .instrument(span.clone())
            .await;
        let outcome = match &claim {
            Ok(claim) => count_claim(claim, &labels),
            Err(err) => err.kind(),
        };
        span.record("outcome", outcome);
        claim
    }

    async fn claim_in_span(
        &self,
        identity: MessageIdentity,
        fingerprint: Fingerprint,
        handler_version: &str,
        wait: Duration,
    ) -> Result<Claim, InboxError> {
        let consumer = identity.consumer();
        let fingerprint_hex = fingerprint.to_hex();
        let wait_ms = i32::try_from(wait.as_millis()).unwrap_or(i32::MAX);
        // One message: "BEGIN …; select tower_inbox_claim_or_raise(…)". A claim answers
        // with success, or raises when the key is taken; the rows of a BEGIN are not read.
        let begin = format!(
            "{}; {}",
            self.isolation.begin(),
            literal::Call::new(sql::CLAIM_OR_RAISE)
                .identity(&identity)
                .text(&fingerprint_hex)
                .text(handler_version)
                .int(Some(i64::from(wait_ms)), "integer")
                .finish()
        );
        // A row that won the race can be purged before it is read; then claim again.
        for _ in 0..3 {
            let conn = self
                .pool
                .acquire()
                .await
                .map_err(|e| self.failed(consumer, e))?;
            let started = Instant::now();
            let begun = OpenTx::begin(conn, begin.clone()).await;
            m::observe_seconds(
                m::CLAIM_WAIT,
                &self.labels.of_consumer(consumer),
                started.elapsed().as_secs_f64(),
            );
            let failed = match begun {
                Ok(tx) => {
                    return Ok(Claim::Claimed(ClaimedMessage {
                        tx,
                        identity,
                        retry: None,
                        labels: self.labels,
                        at_commit: None,
                        pool: self.pool.clone(),
                    }))
                }
                Err(failed) => failed,
            };
            let then = match failed.code().as_deref() {
                // The key is taken by a committed row: read it in the ROLLBACK's message.
                Some(sql::TAKEN) => {
                    let key: Vec<_> = sql::KEY_COLUMNS
                        .into_iter()
                        .zip(identity.key_parts())
                        .collect();
                    literal::select_where(sql::LOOKUP_TEXT_SELECT, &key)
                }
                // lock_timeout: the original is still in flight. Nothing was written.
                Some("55P03") => {
                    failed
                        .rollback_then("")
                        .await
                        .map_err(|e| self.failed(consumer, e))?;
                    return Ok(Claim::InProgress);
                }
                _ => return Err(self.failed(consumer, failed.rollback_into_error().await)),
            };
            let rows = failed
                .rollback_then(&then)
                .await
                .map_err(|e| self.failed(consumer, e))?;
            if let Some(row) = rows.first() {
                return seen(entry_from_text_row(row)?, &fingerprint_hex);
            }
        }
        // Taken three times, gone three times: contention with the purge, retried like one.
        Err(InboxError::Rerun(RetryReason::SerializationFailure))
    }

    /// Opens a transaction for `identity` whose claim is made at commit, as the last
    /// statement, together with the recorded response (the layer's
    /// [`ClaimMode::AtCommit`]). Nothing is claimed until then: a concurrent duplicate runs
    /// too, and the one that commits second finds the claim taken and rolls back.
    pub(crate) async fn begin_at_commit(
        &self,
        identity: MessageIdentity,
        fingerprint: Fingerprint,
        handler_version: &str,
        wait: Duration,
    ) -> Result<ClaimedMessage, InboxError> {
        let conn = self
            .pool
            .acquire()
            .await
            .map_err(|e| self.failed(identity.consumer(), e))?;
        let tx = match OpenTx::begin(conn, self.isolation.begin().to_owned()).await {
            Ok(tx) => tx,
            Err(failed) => {
                return Err(self.failed(identity.consumer(), failed.rollback_into_error().await))
            }
        };
        Ok(ClaimedMessage {
            tx,
            identity,
            retry: None,
            labels: self.labels,
            pool: self.pool.clone(),
            at_commit: Some(ClaimAtCommit {
                fingerprint_hex: fingerprint.to_hex(),
                handler_version: handler_version.to_owned(),
                wait_ms: i32::try_from(wait.as_millis()).unwrap_or(i32::MAX),
            }),
        })
    }

    /// Reads what the inbox holds for `identity`, outside any transaction.
    pub async fn lookup(
        &self,
        identity: &MessageIdentity,
    ) -> Result<Option<InboxEntry>, InboxError> {
        let row = bind_identity!(sqlx::query(sql::LOOKUP), &identity)
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| self.failed(identity.consumer(), e))?;
        row.as_ref().map(entry_from_row).transpose()
    }

    /// Counts an attempt at `identity` that rolled back, with a stable reason code, in a
    /// transaction of its own. From the `quarantine_after`th failure on, the command also has
    /// an open [quarantine](crate::quarantine) item; its id is returned.
    ///
    /// `reason` is also the `reason` label of
    /// [`inbox_handler_failures_total`](crate::metrics::HANDLER_FAILURES): use a code from a
    /// small fixed set (`handler-error`, `validation-failed`, ...), never text from the
    /// message, or the metric grows a series per message.
    pub async fn record_failure(
        &self,
        identity: &MessageIdentity,
        fingerprint: Fingerprint,
        handler_version: &str,
        reason: &str,
        quarantine_after: u32,
    ) -> Result<Option<i64>, InboxError> {
        m::count_with(
            m::HANDLER_FAILURES,
            &self.labels.of_consumer(identity.consumer()),
            "reason",
            reason,
        );
        let item_key = identity_item_key(QuarantineSource::HandlerFailure, identity, "");
        let item: Option<(i64, bool)> =
            bind_identity!(sqlx::query_as(sql::RECORD_FAILURE), &identity)
                .bind(fingerprint.to_hex())
                .bind(handler_version)
                .bind(reason)
                .bind(i32::try_from(quarantine_after.max(1)).unwrap_or(i32::MAX))
                .bind(item_key)
                .fetch_optional(&self.pool)
                .await
                .map_err(|e| self.failed(identity.consumer(), e))?;
        if let Some((_, true)) = item {
            quarantine_moved(QuarantineSource::HandlerFailure);
        }
        Ok(item.map(|(id, _)| id))
    }

    /// Keeps an identity conflict (`identity` claimed before with another payload) in the
    /// [quarantine](crate::quarantine): one open item per conflicting payload, counted.
    pub async fn record_conflict(
        &self,
        identity: &MessageIdentity,
        conflicting: Fingerprint,
        handler_version: &str,
    ) -> Result<(), InboxError> {
        self.quarantine_message(
            QuarantineSource::IdentityConflict,
            "payload-mismatch",
            identity,
            conflicting,
            handler_version,
        )
        .await
        .map(|_| ())
    }

    /// Opens (or counts again) the quarantine item of `source` about a message, with the
    /// fingerprint of the payload concerned. Returns the item and how many times it has
    /// happened.
    pub(crate) async fn quarantine_message(
        &self,
        source: QuarantineSource,
        reason_code: &str,
        identity: &MessageIdentity,
        fingerprint: Fingerprint,
        handler_version: &str,
    ) -> Result<(i64, i32), InboxError> {
        let sha = fingerprint.to_hex();
        let (id, attempts): (i64, i32) = bind_identity!(
            sqlx::query_as(sql::QUARANTINE_MESSAGE)
                .bind(source.as_str())
                .bind(identity_item_key(source, identity, &sha)),
            &identity
        )
        .bind(&sha)
        .bind(reason_code)
        .bind(handler_version)
        .fetch_one(&self.pool)
        .await
        .map_err(|e| self.failed(identity.consumer(), e))?;
        if attempts == 1 {
            quarantine_moved(source);
        }
        Ok((id, attempts))
    }
}

/// Counts an item newly opened in the quarantine.
pub(crate) fn quarantine_moved(source: QuarantineSource) {
    m::count_with(m::QUARANTINE_MOVES, &[], "source", source.as_str());
}

/// Counts quarantined items a later success recovered.
pub(crate) fn quarantine_recovered(source: QuarantineSource, n: u64) {
    if n > 0 {
        ::metrics::counter!(m::QUARANTINE_RECOVERIES, "source" => source.as_str()).increment(n);
    }
}

/// Counts a claim's outcome and names it (for the span).
fn count_claim(claim: &Claim, labels: &[::metrics::Label]) -> &'static str {
    match claim {
        Claim::Claimed(_) => "claimed",
        Claim::Duplicate(_) => {
            m::count(m::DUPLICATES, labels, 1);
            "duplicate"
        }
        Claim::Conflict(_) => {
            m::count(m::IDENTITY_CONFLICTS, labels, 1);
            "conflict"
        }
        Claim::InProgress => {
            m::count(m::IN_PROGRESS, labels, 1);
            "in-progress"
        }
    }
}

/// What a claim that found the key taken answers, from the winning row.
fn seen_from_row(row: &PgRow, fingerprint_hex: &str) -> Result<Claim, InboxError> {
    seen(entry_from_row(row)?, fingerprint_hex)
}

fn seen(entry: InboxEntry, fingerprint_hex: &str) -> Result<Claim, InboxError> {
    Ok(if entry.payload_sha256 != fingerprint_hex {
        Claim::Conflict(entry)
    } else if entry.processed {
        Claim::Duplicate(entry)
    } else {
        Claim::InProgress
    })
}

fn entry_from_row(row: &PgRow) -> Result<InboxEntry, InboxError> {
    let get = |e| InboxError::Database(e);
    let status: Option<i16> = row.try_get("response_status").map_err(get)?;
    let response = match status {
        None => None,
        Some(status) => {
            let names: Vec<String> = row
                .try_get::<Option<Vec<String>>, _>("response_header_names")
                .map_err(get)?
                .unwrap_or_default();
            let values: Vec<Vec<u8>> = row
                .try_get::<Option<Vec<Vec<u8>>>, _>("response_header_values")
                .map_err(get)?
                .unwrap_or_default();
            let body: Vec<u8> = row
                .try_get::<Option<Vec<u8>>, _>("response_body")
                .map_err(get)?
                .unwrap_or_default();
            Some(recorded(
                status,
                names.into_iter().zip(values).collect(),
                body,
            ))
        }
    };
    entry_with(row, response)
}

/// [`entry_from_row`] for a row of [`sql::LOOKUP_TEXT_SELECT`], read in text format.
fn entry_from_text_row(row: &PgRow) -> Result<InboxEntry, InboxError> {
    let get = |e| InboxError::Database(e);
    let malformed = |what: &str| {
        InboxError::Database(sqlx::Error::Decode(
            format!("the inbox row's {what} is not the hex the lookup writes").into(),
        ))
    };
    let status: Option<i16> = row.try_get("response_status").map_err(get)?;
    let response = match status {
        None => None,
        Some(status) => {
            let body: Option<String> = row.try_get("response_body_hex").map_err(get)?;
            let body = match body {
                Some(hex) => literal::from_hex(&hex).ok_or_else(|| malformed("body"))?,
                None => Vec::new(),
            };
            let headers: Option<String> = row.try_get("response_headers_hex").map_err(get)?;
            let mut pairs = Vec::new();
            for pair in headers
                .as_deref()
                .unwrap_or("")
                .split(',')
                .filter(|p| !p.is_empty())
            {
                let (name, value) = pair.split_once(':').ok_or_else(|| malformed("headers"))?;
                let name = literal::from_hex(name)
                    .and_then(|n| String::from_utf8(n).ok())
                    .ok_or_else(|| malformed("headers"))?;
                let value = literal::from_hex(value).ok_or_else(|| malformed("headers"))?;
                pairs.push((name, value));
            }
            Some(recorded(status, pairs, body))
        }
    };
    entry_with(row, response)
}

fn recorded(status: i16, headers: Vec<(String, Vec<u8>)>, body: Vec<u8>) -> RecordedResponse {
    RecordedResponse {
        status: u16::try_from(status).unwrap_or(500),
        headers,
        body: Bytes::from(body),
    }
}

fn entry_with(row: &PgRow, response: Option<RecordedResponse>) -> Result<InboxEntry, InboxError> {
    let get = |e| InboxError::Database(e);
    Ok(InboxEntry {
        payload_sha256: row.try_get("payload_sha256").map_err(get)?,
        handler_version: row.try_get("handler_version").map_err(get)?,
        processed: row.try_get("processed").map_err(get)?,
        response,
    })
}

/// A message this transaction claimed.
///
/// Run the business writes through it: `sqlx::query(..).execute(&mut message)` (or
/// `&mut *tx` for an [`InboxTx`](crate::InboxTx)). Statements run that way are watched: a
/// serialization failure or deadlock among them is remembered ([`retry_reason`](Self::retry_reason)),
/// and the layer then rolls back and re-runs the handler. It also dereferences to the
/// transaction's [`PgConnection`] for functions that take one; statements run through that
/// plain connection are not watched, so call [`request_retry`](Self::request_retry) when one
/// of them fails with `40001` or `40P01`.
///
/// Dropping it without [`commit`](Self::commit) rolls the claim back with everything written
/// on it, so a retry can process the message again.
#[derive(Debug)]
pub struct ClaimedMessage {
    tx: OpenTx,
    identity: MessageIdentity,
    retry: Option<RetryReason>,
    labels: MetricLabels,
    /// Set when the claim is still to be made, at commit.
    at_commit: Option<ClaimAtCommit>,
    /// For reading the row that won, when the claim at commit finds the key taken.
    pool: PgPool,
}

/// What a claim made at commit needs.
#[derive(Debug)]
struct ClaimAtCommit {
    fingerprint_hex: String,
    handler_version: String,
    wait_ms: i32,
}

/// How [`ClaimedMessage::finish`] ended.
#[derive(Debug)]
pub(crate) enum Finished {
    /// Claim, business writes and record committed together.
    Committed,
    /// (Claim at commit.) The key was claimed by another transaction: everything was rolled
    /// back; this is what the inbox holds instead (never [`Claim::Claimed`]).
    ClaimedElsewhere(Box<Claim>),
}

impl ClaimedMessage {
    /// The identity this transaction claimed.
    pub fn identity(&self) -> &MessageIdentity {
        &self.identity
    }

    /// Asks for this transaction to be rolled back and run again from the start, as after a
    /// serialization failure. The layer honours it whatever the handler answers, within its
    /// [`TransientRetry`](crate::TransientRetry) bound.
    pub fn request_retry(&mut self) {
        self.retry.get_or_insert(RetryReason::Requested);
    }

    /// Why this transaction has to be re-run, if a watched statement failed with a
    /// serialization failure or deadlock (which aborted it), or a re-run was requested.
    /// [`commit`](Self::commit) then rolls back instead and answers
    /// [`InboxError::Rerun`].
    pub fn retry_reason(&self) -> Option<RetryReason> {
        self.retry
    }

    /// Records the outcome on the claim and commits: claim, business writes and recorded
    /// response become durable together or not at all.
    ///
    /// An error from the commit itself is ambiguous (the server may have committed before the
    /// connection failed); a retry of the command resolves it, as a replay or a new run.
    ///
    /// A transaction that has to be re-run ([`retry_reason`](Self::retry_reason)) is rolled
    /// back instead, with [`InboxError::Rerun`]: claim again and run it from the start.
    pub async fn commit(self, response: Option<&RecordedResponse>) -> Result<(), InboxError> {
        match self.finish(response).await? {
            Finished::Committed => Ok(()),
            Finished::ClaimedElsewhere(_) => Err(InboxError::ClaimedElsewhere),
        }
    }

    /// Records and commits; with a claim made at commit, reports a key claimed meanwhile.
    pub(crate) async fn finish(
        self,
        response: Option<&RecordedResponse>,
    ) -> Result<Finished, InboxError> {
        let span = tracing::debug_span!(
            "inbox.commit",
            consumer = %self.identity.consumer(),
            producer = %self.identity.producer().name(),
            message_id = %self.identity.message_id(),
            status = response.map(|r| r.status),
            outcome = tracing::field::Empty,
        );
        let (labels, identity) = (self.labels, self.identity.clone());
        let result = self
            .record_and_commit(response)
            .instrument(span.clone())
            .await;
        let outcome = match &result {
            Ok(Finished::Committed) => {
                m::count(m::FIRST_SEEN, &labels.of(&identity), 1);
                "committed"
            }
            Ok(Finished::ClaimedElsewhere(claim)) => count_claim(claim, &labels.of(&identity)),
            Err(err) => {
                err.count(&labels.of_consumer(identity.consumer()));
                err.kind()
            }
        };
        span.record("outcome", outcome);
        result
    }

    async fn record_and_commit(
        mut self,
        response: Option<&RecordedResponse>,
    ) -> Result<Finished, InboxError> {
        if let Some(reason) = self.retry {
            // Aborted by a watched 40001/40P01, or asked to run again: never commit it.
            self.tx.rollback().await.map_err(InboxError::classify)?;
            return Err(InboxError::Rerun(reason));
        }
        if response.is_none_or(|r| r.body.len() <= literal::MAX_LITERAL_BODY) {
            return self.record_and_commit_in_one(response).await;
        }
        let (status, names, values, body) = match response {
            Some(r) => (
                Some(i16::try_from(r.status).unwrap_or(i16::MAX)),
                Some(
                    r.headers
                        .iter()
                        .map(|(n, _)| n.as_str())
                        .collect::<Vec<_>>(),
                ),
                Some(
                    r.headers
                        .iter()
                        .map(|(_, v)| v.as_slice())
                        .collect::<Vec<_>>(),
                ),
                Some(&r.body[..]),
            ),
            None => (None, None, None, None),
        };
        let identity = &self.identity;
        let item_key = identity_item_key(QuarantineSource::HandlerFailure, identity, "");
        let recovered: i64 = match &self.at_commit {
            None => bind_identity!(sqlx::query_scalar(sql::RECORD), &identity)
                .bind(status)
                .bind(names)
                .bind(values)
                .bind(body)
                .bind(item_key)
                .fetch_optional(&mut *self.tx)
                .await
                .map_err(InboxError::classify)?
                .unwrap_or(0),
            Some(claim) => {
                let started = Instant::now();
                let row = bind_identity!(sqlx::query(sql::CLAIM_AT_COMMIT), &identity)
                    .bind(&claim.fingerprint_hex)
                    .bind(&claim.handler_version)
                    .bind(claim.wait_ms)
                    .bind(status)
                    .bind(names)
                    .bind(values)
                    .bind(body)
                    .bind(item_key)
                    .fetch_one(&mut *self.tx)
                    .await;
                m::observe_seconds(
                    m::CLAIM_WAIT,
                    &self.labels.of_consumer(identity.consumer()),
                    started.elapsed().as_secs_f64(),
                );
                let row = match row {
                    Ok(row) => row,
                    Err(sqlx::Error::Database(db)) if db.code().as_deref() == Some("55P03") => {
                        // The original is still in flight: ours rolls back entirely.
                        self.tx.rollback().await.map_err(InboxError::classify)?;
                        return Ok(Finished::ClaimedElsewhere(Box::new(Claim::InProgress)));
                    }
                    Err(err) => return Err(InboxError::classify(err)),
                };
                let claimed: bool = row.try_get("claimed").map_err(InboxError::Database)?;
                if !claimed {
                    self.tx.rollback().await.map_err(InboxError::classify)?;
                    let seen = seen_from_row(&row, &claim.fingerprint_hex)?;
                    return Ok(Finished::ClaimedElsewhere(Box::new(seen)));
                }
                row.try_get("recovered").map_err(InboxError::Database)?
            }
        };
        self.tx.commit().await.map_err(InboxError::classify)?;
        quarantine_recovered(QuarantineSource::HandlerFailure, recovered.unsigned_abs());
        Ok(Finished::Committed)
    }

    /// Records (claim first) or claims and records (claim at commit), and commits, in one
    /// message: `select tower_inbox_…(…); commit; begin`. If the function fails (or, at
    /// commit, finds the key taken and raises `TIAC1`), the rest of the message is never
    /// run and the dropped transaction rolls back. On success the trailing `begin` leaves an
    /// empty transaction for the dropped handle's queued `ROLLBACK` to end, which the pool
    /// sends with its release ping: no round trip of its own, and no warning.
    async fn record_and_commit_in_one(
        self,
        response: Option<&RecordedResponse>,
    ) -> Result<Finished, InboxError> {
        let sql = self.record_sql(response);
        let Self {
            mut tx,
            identity,
            labels,
            at_commit,
            pool,
            ..
        } = self;
        let started = Instant::now();
        // Through the Executor trait: its boxed future is Send, RawSql's own is not provably.
        let result = sqlx::Executor::fetch_all(&mut *tx, sqlx::raw_sql(&sql)).await;
        if at_commit.is_some() {
            m::observe_seconds(
                m::CLAIM_WAIT,
                &labels.of_consumer(identity.consumer()),
                started.elapsed().as_secs_f64(),
            );
        }
        // Success, failure or cancellation alike: the handle's queued ROLLBACK ends what is
        // left (the empty transaction, or the failed one).
        drop(tx);
        let code = match &result {
            Err(sqlx::Error::Database(db)) => db.code().map(|c| c.into_owned()),
            _ => None,
        };
        match (result, code.as_deref(), at_commit) {
            (Ok(rows), _, _) => {
                let recovered: i64 = match rows.first() {
                    Some(row) => row.try_get(0).map_err(InboxError::Database)?,
                    None => 0,
                };
                quarantine_recovered(QuarantineSource::HandlerFailure, recovered.unsigned_abs());
                Ok(Finished::Committed)
            }
            // The original is still in flight; everything of ours rolled back.
            (Err(_), Some("55P03"), Some(_)) => {
                Ok(Finished::ClaimedElsewhere(Box::new(Claim::InProgress)))
            }
            // Claimed meanwhile by another transaction, which committed: read its row.
            (Err(_), Some("TIAC1"), Some(claim)) => {
                let row = bind_identity!(sqlx::query(sql::LOOKUP), &identity)
                    .fetch_optional(&pool)
                    .await
                    .map_err(InboxError::classify)?;
                match row {
                    Some(row) => Ok(Finished::ClaimedElsewhere(Box::new(seen_from_row(
                        &row,
                        &claim.fingerprint_hex,
                    )?))),
                    // Purged in between: nothing holds the key any more; run again.
                    None => Err(InboxError::Rerun(RetryReason::SerializationFailure)),
                }
            }
            (Err(err), _, _) => Err(InboxError::classify(err)),
        }
    }

    /// The text of [`record_and_commit_in_one`](Self::record_and_commit_in_one)'s message.
    fn record_sql(&self, response: Option<&RecordedResponse>) -> String {
        let identity = &self.identity;
        let call = match &self.at_commit {
            None => literal::Call::new("tower_inbox_record"),
            Some(_) => literal::Call::new("tower_inbox_claim_at_commit_or_abort"),
        }
        .identity(identity);
        let call = match &self.at_commit {
            None => call,
            Some(claim) => call
                .text(&claim.fingerprint_hex)
                .text(&claim.handler_version)
                .int(Some(i64::from(claim.wait_ms)), "integer"),
        };
        let headers = response.map(|r| &r.headers[..]);
        call.int(
            response.map(|r| i64::from(i16::try_from(r.status).unwrap_or(i16::MAX))),
            "smallint",
        )
        .text_array(headers.map(|h| h.iter().map(|(name, _)| name.as_str())))
        .bytea_array(headers.map(|h| h.iter().map(|(_, value)| value.as_slice())))
        .bytea(response.map(|r| &r.body[..]))
        .text(&identity_item_key(
            QuarantineSource::HandlerFailure,
            identity,
            "",
        ))
        .then_commit()
    }

    /// Rolls back the claim and everything written in its transaction.
    pub async fn rollback(self) -> Result<(), InboxError> {
        self.tx.rollback().await.map_err(InboxError::classify)
    }
}

impl Deref for ClaimedMessage {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        &self.tx
    }
}

impl DerefMut for ClaimedMessage {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.tx
    }
}
