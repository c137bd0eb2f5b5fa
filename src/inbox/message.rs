//! A claimed message: its transaction, and the record-and-commit that ends it.

use std::time::{Duration, Instant};

use sqlx::postgres::PgConnection;
use sqlx::Row;
use time::OffsetDateTime;
use tracing::Instrument;

use super::entry::{response_binds, seen, Claim, RecordedResponse};
use super::executor::watch;
use super::{count_claim, sql, ClaimLock, Inbox, InboxError, RetryReason, Settled};
use crate::connection::{within, OwnedTx};
use crate::fingerprint::Fingerprint;
use crate::identity::{bind_identity, MessageIdentity};
use crate::metrics as m;
use crate::metrics::quarantine_recovered;
use crate::outbox::{Enqueued, OutboxMessage};
use crate::quarantine::{identity_item_key, QuarantineSource};
use crate::schema::Schema;

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
/// on it, so a retry can process the message again: in a task of its own, within the
/// inbox's [statement deadline](Inbox::with_statement_deadline), or by closing the
/// connection when the rollback does not get through.
#[derive(Debug)]
pub struct ClaimedMessage {
    pub(super) tx: OwnedTx,
    identity: MessageIdentity,
    pub(super) retry: Option<RetryReason>,
    inbox: Inbox,
    claimed: Claimed,
}

/// How the message was (or is to be) claimed.
#[derive(Debug)]
pub(crate) enum Claimed {
    /// By the transaction's first statement, which also saw whether earlier attempts
    /// failed (then the success recovers their quarantine item), and where it put the row
    /// (its `ctid`, which the record updates: see `sql::RECORD`).
    First { failed_before: bool, row: String },
    /// Not yet: at commit, with the recorded response.
    AtCommit(ClaimAtCommit),
}

/// What a claim made at commit needs.
#[derive(Debug)]
pub(crate) struct ClaimAtCommit {
    pub(crate) fingerprint: Fingerprint,
    pub(crate) handler_version: String,
    pub(crate) wait: Duration,
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
    pub(super) fn new(
        tx: OwnedTx,
        identity: MessageIdentity,
        inbox: Inbox,
        claimed: Claimed,
    ) -> Self {
        Self {
            tx,
            identity,
            retry: None,
            inbox,
            claimed,
        }
    }

    /// The identity this transaction claimed.
    pub fn identity(&self) -> &MessageIdentity {
        &self.identity
    }

    /// The schema the inbox's tables (and the outbox's) are in.
    pub fn schema(&self) -> &Schema {
        self.inbox.schema()
    }

    /// Writes the effect `effect_name` of this message to the outbox, in this transaction (and
    /// the inbox's schema): it commits with the claim and the business change, or not at all.
    /// Its ID is derived from the identity and the name, so re-running the command never
    /// writes a second one. See [`outbox`](crate::outbox).
    pub async fn enqueue(
        &mut self,
        effect_name: &str,
        message: &OutboxMessage,
    ) -> Result<Enqueued, InboxError> {
        let schema = self.inbox.schema().clone();
        let identity = self.identity.clone();
        crate::outbox::enqueue_in(&schema, self, &identity, effect_name, message)
            .await
            .map_err(InboxError::classify)
    }

    /// Asks for this transaction to be rolled back and run again from the start, as after a
    /// serialization failure. The layer honours it whatever the handler answers, within its
    /// [`TransientRetry`](crate::inbox::TransientRetry) bound.
    pub fn request_retry(&mut self) {
        self.retry.get_or_insert(RetryReason::Requested);
    }

    /// Runs `f` with the transaction's plain connection, for code that takes a
    /// `&mut PgConnection` rather than an executor. The error `f` returns is watched like a
    /// statement run through the message: a serialization failure or deadlock makes the
    /// transaction re-run. Return the database errors met inside `f`; one swallowed there
    /// still leaves the transaction aborted, so its record fails and nothing commits.
    ///
    /// Statements sent here go as they are: through a transaction-mode pooler
    /// ([`Pooling::Transaction`](crate::schema::Pooling::Transaction)), make them unnamed
    /// with sqlx's `.persistent(false)`, as the message itself does for statements run
    /// through it.
    ///
    /// ```no_run
    /// # async fn f(message: &mut tower_inbox::inbox::ClaimedMessage) -> Result<(), sqlx::Error> {
    /// let n: i64 = message
    ///     .with_connection(async |conn| sqlx::query_scalar("select 1").fetch_one(conn).await)
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub async fn with_connection<T, F>(&mut self, f: F) -> Result<T, sqlx::Error>
    where
        F: AsyncFnOnce(&mut PgConnection) -> Result<T, sqlx::Error>,
    {
        let result = f(self.tx.connection()).await;
        if let Err(err) = &result {
            watch(&mut self.retry, err);
        }
        result
    }

    /// Why this transaction has to be re-run, if a watched statement failed with a
    /// serialization failure or deadlock (which aborted it), or a re-run was requested.
    /// [`commit`](Self::commit) then rolls back instead and answers
    /// [`InboxError::Rerun`].
    pub fn retry_reason(&self) -> Option<RetryReason> {
        self.retry
    }

    /// Records the outcome on the claim and commits: claim, business writes and recorded
    /// response become durable together or not at all. The record must find the claimed
    /// row; if it does not, everything is rolled back ([`InboxError::ClaimMissing`]).
    ///
    /// If the connection fails while `COMMIT` is in flight the outcome is unknown
    /// ([`InboxError::OutcomeUnknown`]); a retry of the command resolves it, as a replay or
    /// a new run.
    ///
    /// A transaction that has to be re-run ([`retry_reason`](Self::retry_reason)) is rolled
    /// back instead, with [`InboxError::Rerun`]: claim again and run it from the start.
    pub async fn commit(self, response: Option<&RecordedResponse>) -> Result<(), InboxError> {
        match self.finish(response).await? {
            Finished::Committed => Ok(()),
            // Only a claim made at commit, which the layer alone opens, can find its key
            // taken; like any transaction that lost a race, it is to be run again.
            Finished::ClaimedElsewhere(_) => {
                Err(InboxError::Rerun(RetryReason::SerializationFailure))
            }
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
            message_id = %self.identity.message_id(),
            status = response.map(|r| r.status),
            outcome = tracing::field::Empty,
        );
        let labels = self.inbox.metric_labels();
        let identity = self.identity.clone();
        let inbox = matches!(self.claimed, Claimed::AtCommit(_)).then(|| self.inbox.clone());
        let result = self
            .record_and_commit(response)
            .instrument(span.clone())
            .await;
        if let (Some(inbox), Ok(finished)) = (&inbox, &result) {
            // A claim at commit learns only now whether the key was taken.
            inbox.observe_taken(matches!(finished, Finished::ClaimedElsewhere(_)));
        }
        let outcome = match &result {
            Ok(Finished::Committed) => {
                m::count(m::FIRST_SEEN, &labels.of(&identity), 1);
                "committed"
            }
            Ok(Finished::ClaimedElsewhere(claim)) => count_claim(claim, || labels.of(&identity)),
            Err(err) => {
                err.count(&labels.of_consumer_shared(identity.consumer_shared()));
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
        let (status, names, values, body) = response_binds(response);
        let failed_before = match &self.claimed {
            Claimed::First { failed_before, row } => {
                let sql = self
                    .inbox
                    .schema()
                    .sql_for(sql::RECORD, sql::RECORD_PARTITIONED);
                let record = crate::sql::query(&sql)
                    .bind(row.as_str())
                    .bind(self.identity.message_id().as_str())
                    .bind(status)
                    .bind(names)
                    .bind(values)
                    .bind(body)
                    .fetch_optional(&mut self.tx);
                let recorded = within(self.inbox.deadline, record)
                    .await
                    .map_err(InboxError::classify)?;
                if recorded.is_none() {
                    // A claim never commits without its response.
                    self.tx.rollback().await.map_err(InboxError::classify)?;
                    return Err(InboxError::ClaimMissing);
                }
                *failed_before
            }
            Claimed::AtCommit(claim) => {
                let lock = ClaimLock::of(self.inbox.schema(), &self.identity);
                let sql = self
                    .inbox
                    .schema()
                    .sql_for(sql::CLAIM_AT_COMMIT, sql::CLAIM_AT_COMMIT_PARTITIONED);
                let started = Instant::now();
                let free = self
                    .inbox
                    .lock_before_claim(&mut self.tx, lock)
                    .await
                    .map_err(InboxError::classify)?;
                let claimed = if free {
                    let claim_now = bind_identity!(crate::sql::query(&sql), &self.identity)
                        .bind(claim.fingerprint.to_hex())
                        .bind(claim.handler_version.as_bytes())
                        .bind(lock.0)
                        .bind(lock.1)
                        .bind(status)
                        .bind(names)
                        .bind(values)
                        .bind(body)
                        .fetch_optional(&mut self.tx);
                    within(self.inbox.deadline, claim_now)
                        .await
                        .map_err(InboxError::classify)
                } else {
                    Ok(None)
                };
                m::observe_seconds(
                    m::CLAIM_WAIT,
                    &self
                        .inbox
                        .metric_labels()
                        .of_consumer_shared(self.identity.consumer_shared()),
                    started.elapsed().as_secs_f64(),
                );
                match claimed? {
                    Some(row) => row.try_get("failed").map_err(InboxError::Database)?,
                    None => {
                        // Everything the handler wrote goes, and its locks with it.
                        self.tx.rollback().await.map_err(InboxError::classify)?;
                        return taken_at_commit(&self.inbox, &self.identity, lock, claim).await;
                    }
                }
            }
        };
        let mut recovered = 0;
        if failed_before {
            let item_key = identity_item_key(QuarantineSource::HandlerFailure, &self.identity, "");
            let sql = self.inbox.schema().sql(sql::RECOVER);
            let recover = sqlx::query(&sql)
                .bind(item_key.as_bytes())
                .execute(&mut self.tx);
            recovered = within(self.inbox.deadline, recover)
                .await
                .map_err(InboxError::classify)?
                .rows_affected();
        }
        self.tx
            .commit()
            .await
            .map_err(InboxError::classify_commit)?;
        quarantine_recovered(QuarantineSource::HandlerFailure, recovered);
        Ok(Finished::Committed)
    }

    /// Whether a message produced at `produced_at` is older than `window` by the database's
    /// clock, and the oldest production time the window accepts now. Read in this
    /// transaction, unwatched.
    pub(crate) async fn produced_before_window(
        &mut self,
        produced_at: OffsetDateTime,
        window: Duration,
    ) -> Result<(bool, OffsetDateTime), InboxError> {
        let deadline = self.inbox.deadline;
        let read = sqlx::query_as(sql::EXPIRED)
            .bind(produced_at)
            .bind(window.as_secs_f64())
            .fetch_one(&mut self.tx);
        within(deadline, read).await.map_err(InboxError::classify)
    }

    /// Rolls back the claim and everything written in its transaction.
    pub async fn rollback(self) -> Result<(), InboxError> {
        self.tx.rollback().await.map_err(InboxError::classify)
    }
}

/// What a claim at commit that found its key taken answers, after its rollback: the row that
/// holds it, once the original (if in flight) has finished or the wait has run out.
async fn taken_at_commit(
    inbox: &Inbox,
    identity: &MessageIdentity,
    lock: ClaimLock,
    claim: &ClaimAtCommit,
) -> Result<Finished, InboxError> {
    let deadline = Instant::now() + claim.wait;
    match inbox.settle(identity, lock, deadline, &mut false).await? {
        Settled::Held(entry) => Ok(Finished::ClaimedElsewhere(Box::new(seen(
            entry,
            &claim.fingerprint,
        )))),
        Settled::Busy => Ok(Finished::ClaimedElsewhere(Box::new(Claim::InProgress))),
        // Taken, then gone (the original rolled back, or a purge): run again.
        Settled::Free => Err(InboxError::Rerun(RetryReason::SerializationFailure)),
    }
}
