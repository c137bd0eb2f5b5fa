//! Broker consumers: one call runs the whole protocol for one delivered message.
//!
//! (Over 400 lines: the runner, its builder and the outcome table they document belong together.)
//!
//! A broker redelivers after a lost acknowledgement and a producer republishes after a
//! timeout; the consumer must apply each intent once. [`Consumer::process`] claims the
//! message in a transaction, runs the handler on it, commits the claim with the handler's
//! writes (outbox effects included), re-runs the whole transaction after a serialization
//! failure, deadlock or lost connection, keeps conflicts and repeatedly failing messages in
//! the [quarantine](crate::quarantine), refuses messages older than the retention window, and
//! returns what happened. [`Processed::disposition`] turns that into what the broker is told:
//!
//! | outcome | meaning | disposition |
//! |---|---|---|
//! | [`Applied`](Processed::Applied) | first seen; the handler's writes committed with the claim | ack |
//! | [`Duplicate`](Processed::Duplicate) | applied before; nothing ran | ack |
//! | [`InProgress`](Processed::InProgress) | another consumer holds it past the wait | retry after 1 s |
//! | [`Failed`](Processed::Failed) | the handler failed; rolled back and counted | retry after the backoff |
//! | [`Unavailable`](Processed::Unavailable) | the database failed or kept conflicting; nothing committed | retry after the backoff |
//! | [`Conflict`](Processed::Conflict) | the same ID with another payload; kept in the quarantine | reject |
//! | [`Quarantined`](Processed::Quarantined) | failed `quarantine_after` times; kept in the quarantine | reject |
//! | [`Expired`](Processed::Expired) | produced before the retention window; kept in the quarantine | reject |
//!
//! A caller with other needs maps the [`Processed`] itself; the table is only the default.
//! `consumer::amqp` (feature `amqp`) runs it on RabbitMQ deliveries and settles them.
//!
//! **Acknowledge after the commit, never before.** `process` returns once the outcome is
//! durable. A crash between its return and the acknowledgement makes the broker deliver the
//! message again, and that delivery is a [`Duplicate`](Processed::Duplicate): acknowledged,
//! nothing applied twice.
//!
//! **The handler may run more than once** for one message (after a serialization failure, a
//! deadlock or a lost connection); only its transaction's writes count, so effects on other
//! systems go through the [outbox](crate::outbox) ([`ClaimedMessage::enqueue`]). A handler
//! that panics unwinds through `process`; its transaction rolls back and the broker
//! redelivers the message when its acknowledgement deadline passes.
//!
//! ```no_run
//! use tower_inbox::consumer::{Consumer, Incoming, Processed};
//! use tower_inbox::fingerprint::Fingerprint;
//! use tower_inbox::{MessageKey, Producer};
//! use futures_util::FutureExt;
//!
//! # async fn consume(pool: sqlx::PgPool, body: Vec<u8>) -> Result<(), Box<dyn std::error::Error>> {
//! let consumer = Consumer::builder(pool, "ledger-projector").build()?;
//! let incoming = Incoming::new(
//!     Producer::new("payments")?,
//!     MessageKey::new("evt-0042")?,
//!     Fingerprint::of_bytes(&body),
//! );
//! let processed = consumer
//!     .process(incoming, |message| {
//!         async move {
//!             sqlx::query("update account set balance = balance + 10 where id = 'a1'")
//!                 .execute(&mut *message)
//!                 .await
//!         }
//!         .boxed()
//!     })
//!     .await;
//! match processed.disposition() {
//!     _ => { /* ack, nak with the delay, or terminate */ }
//! }
//! # Ok(()) }
//! ```

#[cfg(feature = "amqp")]
pub mod amqp;
#[cfg(feature = "nats")]
pub mod nats;
mod outcome;

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use sqlx::PgPool;
use time::OffsetDateTime;
use tracing::Instrument;

use crate::connection::DEFAULT_STATEMENT_DEADLINE;
use crate::fingerprint::Fingerprint;
use crate::identity::{MessageIdentity, Producer};
use crate::inbox::{
    Claim, ClaimedMessage, Inbox, InboxError, IsolationLevel, Reruns, RetryReason, TransientRetry,
    DEFAULT_IN_FLIGHT_WAIT,
};
use crate::key::MessageKey;
use crate::metrics::{self as m, MetricLabels};
use crate::replay::{ConsumerNameError, ReplayPolicy};
use crate::retention::{GuardedClaim, RetentionGuard, RetentionPolicy};
use crate::retry::jittered;
use crate::schema::Schema;

pub use outcome::{Disposition, Processed, IN_PROGRESS_DELAY};

/// One delivered message, as the protocol needs it.
#[derive(Debug, Clone)]
pub struct Incoming {
    producer: Producer,
    message_id: MessageKey,
    fingerprint: Fingerprint,
    produced_at: Option<OffsetDateTime>,
    delivery: u32,
}

impl Incoming {
    /// A message with its producer, its ID, and the fingerprint of what makes it this
    /// command (usually [`Fingerprint::of_bytes`] of the body).
    pub fn new(producer: Producer, message_id: MessageKey, fingerprint: Fingerprint) -> Self {
        Self {
            producer,
            message_id,
            fingerprint,
            produced_at: None,
            delivery: 1,
        }
    }

    /// When the producer produced it (the broker's publish time): lets the retention
    /// window refuse copies older than what the inbox remembers.
    pub fn produced_at(mut self, at: OffsetDateTime) -> Self {
        self.produced_at = Some(at);
        self
    }

    /// Which delivery of the message this is, from 1 (the broker's count, when it keeps
    /// one): the backoff after a failure grows with it.
    pub fn delivery(mut self, delivery: u32) -> Self {
        self.delivery = delivery.max(1);
        self
    }
}

/// Runs the inbox protocol for delivered messages; see the [module docs](self).
#[derive(Clone, Debug)]
pub struct Consumer {
    inbox: Inbox,
    guard: Option<RetentionGuard>,
    consumer: Arc<str>,
    handler_version: Arc<str>,
    retry: TransientRetry,
    quarantine_after: u32,
    in_flight_wait: Duration,
    backoff: (Duration, Duration),
}

/// Configures a [`Consumer`]; every setting has a default.
#[derive(Debug)]
#[must_use]
pub struct ConsumerBuilder {
    pool: PgPool,
    consumer: String,
    handler_version: String,
    replay_policy: ReplayPolicy,
    retry: TransientRetry,
    quarantine_after: u32,
    in_flight_wait: Duration,
    retention: Option<RetentionPolicy>,
    schema: Schema,
    isolation: IsolationLevel,
    metric_labels: MetricLabels,
    backoff: (Duration, Duration),
    statement_deadline: Duration,
}

/// A consumer setting that cannot work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConsumerConfigError {
    /// The consumer name or handler version cannot make an identity.
    #[error(transparent)]
    Name(#[from] ConsumerNameError),
    /// `quarantine_after` is zero: every message would be quarantined before it ran.
    #[error("quarantine_after must be positive")]
    ZeroQuarantineAfter,
    /// The isolation level is one the schema's [layout](crate::partition::Layout) refuses.
    #[error(transparent)]
    Layout(#[from] crate::inbox::LayoutError),
}

impl Consumer {
    /// Starts a consumer named `consumer` (part of every message identity) over `pool`.
    pub fn builder(pool: PgPool, consumer: impl Into<String>) -> ConsumerBuilder {
        ConsumerBuilder {
            pool,
            consumer: consumer.into(),
            handler_version: "1".to_owned(),
            replay_policy: ReplayPolicy::default(),
            retry: TransientRetry::default(),
            quarantine_after: 3,
            in_flight_wait: DEFAULT_IN_FLIGHT_WAIT,
            retention: None,
            schema: Schema::default(),
            isolation: IsolationLevel::default(),
            metric_labels: MetricLabels::default(),
            backoff: (Duration::from_secs(1), Duration::from_secs(300)),
            statement_deadline: DEFAULT_STATEMENT_DEADLINE,
        }
    }

    /// The inbox it claims in.
    pub fn inbox(&self) -> &Inbox {
        &self.inbox
    }

    /// The consumer name in every identity (with the handler version under
    /// [`ReplayPolicy::VersionedProjection`]).
    pub fn name(&self) -> &str {
        &self.consumer
    }

    /// The identity `incoming` is claimed under.
    pub fn identity(&self, incoming: &Incoming) -> MessageIdentity {
        MessageIdentity::new(
            self.consumer.clone(),
            incoming.producer.clone(),
            incoming.message_id.clone(),
        )
    }

    /// Runs the protocol for one message: claim, `handler` on the claimed transaction,
    /// commit; see the [module docs](self) for the outcomes. Returns once the outcome is
    /// durable: acknowledge to the broker after this, never before.
    ///
    /// `handler` runs again after a serialization failure, deadlock or lost connection, on a
    /// new transaction, within the [`TransientRetry`] budget (lost connections get the pool's
    /// size on top). An `Err` from it rolls everything back and counts a failed attempt.
    pub async fn process<T, E, F>(&self, incoming: Incoming, mut handler: F) -> Processed<T, E>
    where
        F: for<'m> FnMut(&'m mut ClaimedMessage) -> BoxFuture<'m, Result<T, E>>,
    {
        let identity = self.identity(&incoming);
        let span = tracing::debug_span!(
            "inbox.consume",
            consumer = %identity.consumer(),
            message_id = %identity.message_id(),
            outcome = tracing::field::Empty,
        );
        let processed = async {
            let mut reruns = Reruns::new(self.retry, self.inbox.pool());
            loop {
                let reason = match self.run_once(&identity, &incoming, &mut handler).await {
                    Run::Done(processed) => return processed,
                    Run::Again(reason, error) => match reruns.next(reason) {
                        Some(delay) => {
                            self.count_rerun(reason);
                            tokio::time::sleep(delay).await;
                            continue;
                        }
                        None => (reason, error),
                    },
                };
                return self.gave_up(&identity, &incoming, reason).await;
            }
        }
        .instrument(span.clone())
        .await;
        span.record("outcome", processed.kind());
        processed
    }

    /// One run: the claim, the handler and the commit.
    async fn run_once<T, E, F>(
        &self,
        identity: &MessageIdentity,
        incoming: &Incoming,
        handler: &mut F,
    ) -> Run<T, E>
    where
        F: for<'m> FnMut(&'m mut ClaimedMessage) -> BoxFuture<'m, Result<T, E>>,
    {
        let mut message = match self.claim(identity, incoming).await {
            Ok(Claimed::Message(message)) => message,
            Ok(Claimed::Done(processed)) => return Run::Done(processed),
            Err(err) => return self.database_failed(err, incoming),
        };
        match handler(&mut message).await {
            Ok(value) => match message.commit(None).await {
                Ok(()) => Run::Done(Processed::Applied(value)),
                Err(err) => self.database_failed(err, incoming),
            },
            Err(error) => {
                // A watched statement failed with 40001/40P01 (or a re-run was asked for):
                // the error is that failure's, and a new run may well succeed.
                if let Some(reason) = message.retry_reason() {
                    let _ = message.rollback().await;
                    return Run::Again(reason, None);
                }
                let _ = message.rollback().await;
                Run::Done(self.failed(identity, incoming, error).await)
            }
        }
    }

    async fn claim<T, E>(
        &self,
        identity: &MessageIdentity,
        incoming: &Incoming,
    ) -> Result<Claimed<T, E>, InboxError> {
        let (fingerprint, version, wait) = (
            incoming.fingerprint,
            &*self.handler_version,
            self.in_flight_wait,
        );
        let claim = match (&self.guard, incoming.produced_at) {
            (Some(guard), Some(produced_at)) => {
                let guarded = guard
                    .claim(identity.clone(), fingerprint, version, wait, produced_at)
                    .await?;
                match guarded {
                    GuardedClaim::Claim(claim) => claim,
                    GuardedClaim::Expired(expired) => {
                        return Ok(Claimed::Done(Processed::Expired(expired)))
                    }
                }
            }
            _ => {
                self.inbox
                    .claim(identity.clone(), fingerprint, version, wait)
                    .await?
            }
        };
        Ok(match claim {
            Claim::Claimed(message) => Claimed::Message(message),
            Claim::Duplicate(entry) => Claimed::Done(Processed::Duplicate(entry)),
            Claim::InProgress => Claimed::Done(Processed::InProgress),
            Claim::Conflict(entry) => {
                // The answer does not depend on keeping the record: a failure is logged and
                // the conflict is still refused.
                if let Err(err) = self
                    .inbox
                    .record_conflict(identity, fingerprint, version)
                    .await
                {
                    tracing::error!(error = %err, "could not quarantine the identity conflict");
                }
                Claimed::Done(Processed::Conflict(entry))
            }
        })
    }

    /// A handler error: counted, and past the limit quarantined.
    async fn failed<T, E>(
        &self,
        identity: &MessageIdentity,
        incoming: &Incoming,
        error: E,
    ) -> Processed<T, E> {
        let recorded = self
            .inbox
            .record_failure(
                identity,
                incoming.fingerprint,
                &self.handler_version,
                "handler-error",
                self.quarantine_after,
            )
            .await;
        match recorded {
            Ok(Some(quarantine_id)) => Processed::Quarantined {
                error,
                quarantine_id,
            },
            Ok(None) => Processed::Failed {
                error,
                retry_in: self.backoff(incoming),
            },
            Err(err) => {
                // The attempt is not counted; the redelivery will try again all the same.
                tracing::warn!(error = %err, "could not count the failed attempt");
                Processed::Failed {
                    error,
                    retry_in: self.backoff(incoming),
                }
            }
        }
    }

    /// A database error of the claim or the commit: a re-run when one may cure it.
    fn database_failed<T, E>(&self, err: InboxError, incoming: &Incoming) -> Run<T, E> {
        match err.retry_reason() {
            Some(reason) => Run::Again(reason, Some(err)),
            None => Run::Done(Processed::Unavailable {
                error: err,
                retry_in: self.backoff(incoming),
            }),
        }
    }

    /// The re-runs ran out: nothing committed (or a lost `COMMIT` the redelivery resolves).
    async fn gave_up<T, E>(
        &self,
        identity: &MessageIdentity,
        incoming: &Incoming,
        reason: (RetryReason, Option<InboxError>),
    ) -> Processed<T, E> {
        let (reason, error) = reason;
        tracing::warn!(%reason, "message kept conflicting or losing its connection; giving up");
        if reason != RetryReason::ConnectionLost {
            let _ = self
                .inbox
                .record_failure(
                    identity,
                    incoming.fingerprint,
                    &self.handler_version,
                    "transaction-conflict",
                    self.quarantine_after,
                )
                .await;
        }
        Processed::Unavailable {
            error: error.unwrap_or(InboxError::Rerun(reason)),
            retry_in: self.backoff(incoming),
        }
    }

    fn backoff(&self, incoming: &Incoming) -> Duration {
        jittered(self.backoff.0, self.backoff.1, incoming.delivery)
    }

    fn count_rerun(&self, reason: RetryReason) {
        m::count_with(
            m::TRANSACTION_RETRIES,
            &self.inbox.metric_labels().of_consumer(&self.consumer),
            "reason",
            reason.as_str(),
        );
    }
}

/// How one run ended.
enum Run<T, E> {
    Done(Processed<T, E>),
    /// Rolled back for a re-run, with the database error when there was one.
    Again(RetryReason, Option<InboxError>),
}

enum Claimed<T, E> {
    Message(ClaimedMessage),
    Done(Processed<T, E>),
}

impl ConsumerBuilder {
    /// The handler version stored with each claim (default `"1"`).
    pub fn handler_version(mut self, version: impl Into<String>) -> Self {
        self.handler_version = version.into();
        self
    }

    /// What a new handler version does with messages an older one processed (default
    /// [`ReplayPolicy::NoReapplication`]).
    pub fn replay_policy(mut self, policy: ReplayPolicy) -> Self {
        self.replay_policy = policy;
        self
    }

    /// Re-runs after serialization failures, deadlocks and lost connections (default
    /// [`TransientRetry::default`]).
    pub fn transient_retry(mut self, retry: TransientRetry) -> Self {
        self.retry = retry;
        self
    }

    /// Failed attempts at one message before it goes to the quarantine (default 3).
    pub fn quarantine_after(mut self, attempts: u32) -> Self {
        self.quarantine_after = attempts;
        self
    }

    /// How long a message held by another consumer is waited for (default 2 s).
    pub fn in_flight_wait(mut self, wait: Duration) -> Self {
        self.in_flight_wait = wait;
        self
    }

    /// Refuse first-seen messages produced before `policy`'s window (those that carry a
    /// production time, [`Incoming::produced_at`]); see [`RetentionGuard`].
    pub fn retention(mut self, policy: RetentionPolicy) -> Self {
        self.retention = Some(policy);
        self
    }

    /// The delay suggested after the first failure, doubling with each delivery up to `cap`
    /// (default 1 s to 5 min), jittered.
    pub fn failure_backoff(mut self, base: Duration, cap: Duration) -> Self {
        self.backoff = (base, cap.max(base));
        self
    }

    /// The schema the tables are in (default `tower_inbox`).
    pub fn schema(mut self, schema: Schema) -> Self {
        self.schema = schema;
        self
    }

    /// The isolation level of the claimed transaction (default
    /// [`DatabaseDefault`](IsolationLevel::DatabaseDefault): the database's default level,
    /// `READ COMMITTED` unless configured otherwise).
    pub fn isolation_level(mut self, level: IsolationLevel) -> Self {
        self.isolation = level;
        self
    }

    /// The labels on the consumer's metrics (default: the consumer).
    pub fn metric_labels(mut self, labels: MetricLabels) -> Self {
        self.metric_labels = labels;
        self
    }

    /// How long each of the consumer's own statements (claim, record, `COMMIT`, failure
    /// records) may wait for its answer (default 10 s); see
    /// [`Inbox::with_statement_deadline`].
    pub fn statement_deadline(mut self, deadline: Duration) -> Self {
        self.statement_deadline = deadline;
        self
    }

    /// Checks the names and builds the consumer.
    pub fn build(self) -> Result<Consumer, ConsumerConfigError> {
        let consumer = self
            .replay_policy
            .consumer_name(&self.consumer, &self.handler_version)?;
        if self.quarantine_after == 0 {
            return Err(ConsumerConfigError::ZeroQuarantineAfter);
        }
        crate::inbox::check_isolation(&self.schema, self.isolation)?;
        let inbox = Inbox::new(self.pool)
            .with_schema(self.schema)
            .with_isolation(self.isolation)
            .with_metric_labels(self.metric_labels)
            .with_statement_deadline(self.statement_deadline);
        let guard = self
            .retention
            .map(|policy| RetentionGuard::new(inbox.clone(), &policy));
        Ok(Consumer {
            inbox,
            guard,
            consumer: consumer.into(),
            handler_version: self.handler_version.into(),
            retry: self.retry,
            quarantine_after: self.quarantine_after,
            in_flight_wait: self.in_flight_wait,
            backoff: self.backoff,
        })
    }
}
