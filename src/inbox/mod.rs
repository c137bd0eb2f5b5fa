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
//!
//! **Waiting for an original in flight.** Every claim holds its key's advisory lock
//! (`pg_try_advisory_xact_lock`) until its transaction ends. A claim that finds the lock held
//! waits in this process, not in the database: it polls with a short backoff, one
//! primary-key read at a time, and holds no connection between polls. So a duplicate never
//! blocks a pooled connection for long, and a wait that runs out raises nothing on the server
//! (a `lock_timeout` would log an `ERROR` for every such retry).

mod entry;
mod error;
mod executor;
mod lookup;
mod message;
mod settings;
pub(crate) mod sql;
mod waiters;

use std::sync::Arc;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use sqlx::postgres::PgPool;
use sqlx::Row;
use tracing::Instrument;

use crate::fingerprint::Fingerprint;
use crate::identity::{bind_identity, MessageIdentity};
use crate::metrics::{self as m, MetricLabels};
use crate::quarantine::{identity_item_key, QuarantineSource};
use crate::schema::Schema;

pub(crate) use entry::{headers_len, seen};
pub use entry::{Claim, InboxEntry, RecordedResponse};
pub use error::{InboxError, RetryReason};
use lookup::{LookupFirst, TakenShare};
pub use message::ClaimedMessage;
pub(crate) use message::Finished;
pub use settings::{ClaimMode, IsolationLevel};
use waiters::{Role, Settled, Waiters};

/// How many times a claim tries again when the row that held its key vanished before it
/// could be read (a purge racing it) before it gives up like a serialization failure.
const VANISHED_ATTEMPTS: u32 = 3;

/// The inbox: claims messages in a transaction of their own pool.
#[derive(Clone, Debug)]
pub struct Inbox {
    pool: PgPool,
    schema: Schema,
    isolation: IsolationLevel,
    labels: MetricLabels,
    lookup: LookupFirst,
    /// How often keys were found taken lately, for [`LookupFirst::Adaptive`].
    taken: Arc<TakenShare>,
    waiters: Arc<Waiters>,
}

impl Inbox {
    /// An inbox over a pool whose database has the [`migrate`](crate::migrate) migrations
    /// applied, in the default schema; claims run at `READ COMMITTED`, look a key up before
    /// opening a transaction for it while duplicates are common (see
    /// [`with_lookup_first`](Self::with_lookup_first)), and metrics carry the consumer label.
    pub fn new(pool: PgPool) -> Self {
        // A quarter of the pool: enough for a few keys in flight, never the whole pool.
        let limit = usize::try_from(pool.options().get_max_connections() / 4).unwrap_or(1);
        Self {
            pool,
            schema: Schema::default(),
            isolation: IsolationLevel::default(),
            labels: MetricLabels::default(),
            lookup: LookupFirst::default(),
            taken: Arc::new(TakenShare::new()),
            waiters: Arc::new(Waiters::new(limit)),
        }
    }

    /// How many keys this inbox waits on at once (default: a quarter of the pool's
    /// connections, at least one). One claim polls each such key for all its duplicates,
    /// holding a pooled connection only while a poll runs; past the limit a duplicate of
    /// an in-flight command is answered [`Claim::InProgress`] at once, so retry storms
    /// cannot take the pool from other work.
    pub fn with_waiting_keys_limit(mut self, keys: usize) -> Self {
        self.waiters = Arc::new(Waiters::new(keys));
        self
    }

    /// The most keys waited on at once.
    pub fn waiting_keys_limit(&self) -> usize {
        self.waiters.limit()
    }

    /// How many claims of this inbox (and its clones) are waiting for an original in flight
    /// right now.
    pub fn waiting_claims(&self) -> usize {
        self.waiters.waiting()
    }

    /// The tables are in `schema` (migrated there with
    /// [`migrate_schema`](crate::migrate_schema)).
    pub fn with_schema(mut self, schema: Schema) -> Self {
        self.schema = schema;
        self
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

    /// Whether a claim first reads the key's row outside any transaction: always (`true`) or
    /// never (`false`). The default decides from the traffic.
    ///
    /// The read answers a duplicate of a finished command from one primary-key read, with no
    /// transaction and no write, and lets one of an in-flight command wait without opening
    /// one; it costs a first-seen message one round trip more. Without it a duplicate learns
    /// it is one from the claim: `BEGIN`, the claim, a read in the same transaction (three
    /// round trips). By default the inbox reads first while more than a fifth of the recent
    /// messages (about the last 32) found their key taken, and claims at once otherwise: a
    /// steady stream of new commands costs the protocol's own round trips, and a retry storm
    /// turns the read on within a message or two.
    pub fn with_lookup_first(mut self, on: bool) -> Self {
        self.lookup = if on {
            LookupFirst::Always
        } else {
            LookupFirst::Never
        };
        self
    }

    /// Counts a message whose key was (or was not) found taken, for the default lookup
    /// decision.
    pub(crate) fn observe_taken(&self, taken: bool) {
        self.taken.observe(taken);
    }

    /// The pool claims are made from.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The schema the tables are in.
    pub fn schema(&self) -> &Schema {
        &self.schema
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

    /// Claims `identity`: opens a transaction and inserts the key's row in it, `INSERT ...
    /// ON CONFLICT DO NOTHING`; the primary key serialises concurrent claims.
    ///
    /// If another transaction is processing the same identity, this waits up to `wait` for
    /// it (in this process, see the [module docs](self)): if it commits, the result is
    /// [`Claim::Duplicate`] or [`Claim::Conflict`]; if it rolls back, this claim may win;
    /// otherwise [`Claim::InProgress`].
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
            message_id = %identity.message_id(),
            outcome = tracing::field::Empty,
        );
        let labels = self.labels.of(&identity);
        let wait_labels = self.labels.of_consumer(identity.consumer());
        let started = Instant::now();
        let mut timed = false;
        let claim = self
            .claim_in_span(identity, fingerprint, handler_version, wait, &mut timed)
            .instrument(span.clone())
            .await;
        if claim.is_ok() && timed {
            m::observe_seconds(m::CLAIM_WAIT, &wait_labels, started.elapsed().as_secs_f64());
        }
        let outcome = match &claim {
            Ok(claim) => {
                self.observe_taken(!matches!(claim, Claim::Claimed(_)));
                count_claim(claim, &labels)
            }
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
        timed: &mut bool,
    ) -> Result<Claim, InboxError> {
        let consumer = identity.consumer();
        let lock = ClaimLock::of(&self.schema, &identity);
        let deadline = Instant::now() + wait;
        if let Some(answer) = self
            .answer_before_claim(&identity, &fingerprint, deadline, timed)
            .await?
        {
            return Ok(answer);
        }
        let fingerprint_hex = fingerprint.to_hex();
        let claim_sql = self.schema.sql(sql::CLAIM);
        let read_sql = self.schema.sql(sql::LOOKUP_OR_BUSY);
        let mut vanished = 0;
        loop {
            let mut tx = self
                .pool
                .begin_with(self.isolation.begin())
                .await
                .map_err(|e| self.failed(consumer, e))?;
            let claimed = bind_identity!(sqlx::query(&claim_sql), &identity)
                .bind(&fingerprint_hex)
                .bind(handler_version.as_bytes())
                .bind(lock.0)
                .bind(lock.1)
                .fetch_optional(&mut *tx)
                .await
                .map_err(|e| self.failed(consumer, e))?;
            *timed = true;
            if let Some(row) = claimed {
                let failed_before = row.try_get("failed").map_err(InboxError::Database)?;
                return Ok(Claim::Claimed(ClaimedMessage::new(
                    tx,
                    identity,
                    self.clone(),
                    message::Claimed::First { failed_before },
                )));
            }
            // Taken: by a committed row, or by a claim in flight. A read in the same
            // transaction (a new snapshot) tells which.
            let row = bind_identity!(sqlx::query(&read_sql), &identity)
                .bind(lock.0)
                .bind(lock.1)
                .fetch_one(&mut *tx)
                .await
                .map_err(|e| self.failed(consumer, e))?;
            // Nothing was written: dropping the transaction rolls it back (and releases the
            // key's lock) when the connection is next used, which the pool does at once on
            // release, so the duplicate pays no round trip for its ROLLBACK.
            drop(tx);
            if let Some(entry) = entry::entry_from_row(&row)? {
                return Ok(seen(entry, &fingerprint));
            }
            let free: bool = row.try_get("free").map_err(InboxError::Database)?;
            if free {
                // Taken, then gone before it could be read: the original rolled back, or a
                // purge deleted the row. Contention; retried like it, a few times.
                vanished += 1;
                if vanished >= VANISHED_ATTEMPTS {
                    return Err(InboxError::Rerun(RetryReason::SerializationFailure));
                }
                continue;
            }
            match self.settle(&identity, lock, deadline, timed).await? {
                Settled::Held(entry) => return Ok(seen(entry, &fingerprint)),
                Settled::Busy => return Ok(Claim::InProgress),
                // It rolled back: claim again.
                Settled::Free => {}
            }
        }
    }

    /// Waits until `identity` is no longer in flight in another transaction, or `deadline`
    /// passes (see [`waiters`]): follows the key's poller if another claim polls it, else
    /// reads the key once and, while it is in flight, polls it with a growing pause between
    /// polls and no connection held during a pause. Sets `waited` if it waited at all.
    async fn settle(
        &self,
        identity: &MessageIdentity,
        lock: ClaimLock,
        deadline: Instant,
        waited: &mut bool,
    ) -> Result<Settled, InboxError> {
        if self.waiters.following(lock).is_none() {
            if let Some(settled) = self.poll_once(identity, lock).await? {
                return Ok(settled);
            }
        }
        *waited = true;
        let _counted = self.waiters.count();
        loop {
            match self.waiters.join(lock) {
                Role::Full => return Ok(Settled::Busy),
                Role::Poll(poller) => {
                    let settled = self.poll_until(identity, lock, deadline).await?;
                    poller.publish(&settled);
                    return Ok(settled);
                }
                Role::Follow(mut result) => {
                    let settled =
                        tokio::time::timeout_at(deadline.into(), result.wait_for(Option::is_some))
                            .await;
                    match settled {
                        Err(_) => return Ok(Settled::Busy),
                        // The poller failed or gave up before this claim's wait is over:
                        // take its place.
                        Ok(Err(_)) => continue,
                        Ok(Ok(settled)) => match settled.clone() {
                            Some(Settled::Busy) if Instant::now() < deadline => continue,
                            Some(settled) => return Ok(settled),
                            None => continue,
                        },
                    }
                }
            }
        }
    }

    /// Polls until the key settles or `deadline` passes.
    async fn poll_until(
        &self,
        identity: &MessageIdentity,
        lock: ClaimLock,
        deadline: Instant,
    ) -> Result<Settled, InboxError> {
        let mut pause = Duration::from_millis(2);
        loop {
            let now = Instant::now();
            if now >= deadline {
                return Ok(Settled::Busy);
            }
            // Jittered, so that the pollers of many keys do not poll in lockstep.
            let jittered = pause.mul_f64(0.5 + fastrand::f64() * 0.5);
            tokio::time::sleep(jittered.min(deadline - now)).await;
            pause = (pause * 2).min(Duration::from_millis(50));
            if let Some(settled) = self.poll_once(identity, lock).await? {
                return Ok(settled);
            }
        }
    }

    /// One read of the key's row and its claim lock: `None` while it is in flight elsewhere.
    async fn poll_once(
        &self,
        identity: &MessageIdentity,
        lock: ClaimLock,
    ) -> Result<Option<Settled>, InboxError> {
        let sql = self.schema.sql(sql::LOOKUP_OR_BUSY);
        let row = bind_identity!(sqlx::query(&sql), identity)
            .bind(lock.0)
            .bind(lock.1)
            .fetch_one(&self.pool)
            .await
            .map_err(|e| self.failed(identity.consumer(), e))?;
        if let Some(entry) = entry::entry_from_row(&row)? {
            return Ok(Some(Settled::Held(entry)));
        }
        let free: bool = row.try_get("free").map_err(InboxError::Database)?;
        Ok(free.then_some(Settled::Free))
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
        let tx = self
            .pool
            .begin_with(self.isolation.begin())
            .await
            .map_err(|e| self.failed(identity.consumer(), e))?;
        let at_commit = message::ClaimAtCommit {
            fingerprint,
            handler_version: handler_version.to_owned(),
            wait,
        };
        Ok(ClaimedMessage::new(
            tx,
            identity,
            self.clone(),
            message::Claimed::AtCommit(at_commit),
        ))
    }

    /// With [lookup first](Self::with_lookup_first) on, the answer a message gets without
    /// a transaction of its own: a finished command's outcome or conflict, or
    /// [`Claim::InProgress`] once `deadline` passes with the original still in flight.
    /// `None` when the key is free and a transaction must claim it (or lookup first is off).
    pub(crate) async fn answer_before_claim(
        &self,
        identity: &MessageIdentity,
        fingerprint: &Fingerprint,
        deadline: Instant,
        waited: &mut bool,
    ) -> Result<Option<Claim>, InboxError> {
        if !self.lookup.now(&self.taken) {
            return Ok(None);
        }
        let lock = ClaimLock::of(&self.schema, identity);
        Ok(match self.settle(identity, lock, deadline, waited).await? {
            Settled::Held(entry) => Some(seen(entry, fingerprint)),
            Settled::Busy => Some(Claim::InProgress),
            Settled::Free => None,
        })
    }

    /// Reads what the inbox holds for `identity`, outside any transaction: the committed
    /// state only.
    pub async fn lookup(
        &self,
        identity: &MessageIdentity,
    ) -> Result<Option<InboxEntry>, InboxError> {
        let sql = self.schema.sql(sql::LOOKUP);
        let row = bind_identity!(sqlx::query(&sql), identity)
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| self.failed(identity.consumer(), e))?;
        match row {
            Some(row) => entry::entry_from_row(&row),
            None => Ok(None),
        }
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
        let sql = self.schema.sql(sql::RECORD_FAILURE);
        let item: Option<(i64, bool)> = bind_identity!(sqlx::query_as(&sql), identity)
            .bind(fingerprint.to_hex())
            .bind(handler_version.as_bytes())
            .bind(reason.as_bytes())
            .bind(i32::try_from(quarantine_after.max(1)).unwrap_or(i32::MAX))
            .bind(item_key.as_bytes())
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
        let item_key = identity_item_key(source, identity, &sha);
        let sql = self.schema.sql(sql::QUARANTINE_MESSAGE);
        let (id, attempts): (i64, i32) = bind_identity!(sqlx::query_as(&sql), identity)
            .bind(source.as_str())
            .bind(item_key.as_bytes())
            .bind(&sha)
            .bind(reason_code.as_bytes())
            .bind(handler_version.as_bytes())
            .fetch_one(&self.pool)
            .await
            .map_err(|e| self.failed(identity.consumer(), e))?;
        if attempts == 1 {
            quarantine_moved(source);
        }
        Ok((id, attempts))
    }
}

/// The two keys of a message's advisory lock (`pg_try_advisory_xact_lock(int4, int4)`, a key
/// space apart from the one-`bigint` form), from the schema and the identity: the same for
/// every process, so that instances of a service see each other's claims in flight. Two
/// identities that share a lock (one chance in 2^64) only make one wait for the other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct ClaimLock(i32, i32);

impl ClaimLock {
    pub(crate) fn of(schema: &Schema, identity: &MessageIdentity) -> Self {
        let mut hasher = Sha256::new();
        hasher.update(b"tower-inbox/claim-lock/v1");
        for part in std::iter::once(schema.name()).chain(identity.key_parts()) {
            hasher.update((part.len() as u64).to_be_bytes());
            hasher.update(part.as_bytes());
        }
        let digest = hasher.finalize();
        let half = |at: usize| {
            i32::from_be_bytes([digest[at], digest[at + 1], digest[at + 2], digest[at + 3]])
        };
        Self(half(0), half(4))
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
pub(crate) fn count_claim(claim: &Claim, labels: &[::metrics::Label]) -> &'static str {
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
