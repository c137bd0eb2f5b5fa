//! The claim: a transaction that inserts the key's row, or learns who holds it and waits for
//! the holder in this process.

use std::time::{Duration, Instant};

use sqlx::Row;
use tracing::Instrument;

use super::lock::ClaimLock;
use super::waiters::{Role, Settled};
use super::{
    entry, message, seen, sql, Claim, ClaimedMessage, Inbox, InboxError, RetryReason,
    VANISHED_ATTEMPTS,
};
use crate::connection::within;
use crate::fingerprint::Fingerprint;
use crate::identity::{bind_identity, MessageIdentity};
use crate::metrics as m;
use crate::retry::jittered;

impl Inbox {
    /// Claims `identity`: opens a transaction and inserts the key's row in it, `INSERT ...
    /// ON CONFLICT DO NOTHING`; the primary key serialises concurrent claims.
    ///
    /// If another transaction is processing the same identity, this waits up to `wait` for
    /// it (in this process, see the [module docs](crate::inbox)): if it commits, the result is
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
        // What the metrics need of the identity, which the claim takes: two reference counts.
        let counted = identity.clone();
        let started = Instant::now();
        let mut timed = false;
        let claim = self
            .claim_in_span(identity, fingerprint, handler_version, wait, &mut timed)
            .instrument(span.clone())
            .await;
        if claim.is_ok() && timed {
            let wait_labels = self.labels.of_consumer_shared(counted.consumer_shared());
            m::observe_seconds(m::CLAIM_WAIT, &wait_labels, started.elapsed().as_secs_f64());
        }
        let outcome = match &claim {
            Ok(claim) => {
                self.observe_taken(!matches!(claim, Claim::Claimed(_)));
                count_claim(claim, || self.labels.of(&counted))
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
        self.check_layout(consumer).await?;
        let lock = ClaimLock::of(&self.schema, &identity);
        let deadline = Instant::now() + wait;
        if let Some(answer) = self
            .answer_before_claim(&identity, &fingerprint, deadline, timed)
            .await?
        {
            return Ok(answer);
        }
        let fingerprint_hex = fingerprint.to_hex();
        let claim_sql = self.schema.sql_for(sql::CLAIM, sql::CLAIM_PARTITIONED);
        let read_sql = self.schema.sql(sql::LOOKUP_OR_BUSY);
        let mut vanished = 0;
        loop {
            let mut tx = self
                .guarded()
                .begin(self.isolation.begin(self.schema.layout()))
                .await
                .map_err(|e| self.failed(consumer, e))?;
            let free = self
                .lock_before_claim(&mut tx, lock)
                .await
                .map_err(|e| self.failed(consumer, e))?;
            let claimed = if free {
                let claim = bind_identity!(crate::sql::query(&claim_sql), &identity)
                    .bind(&fingerprint_hex)
                    .bind(handler_version.as_bytes())
                    .bind(lock.0)
                    .bind(lock.1)
                    .fetch_optional(&mut tx);
                within(self.deadline, claim)
                    .await
                    .map_err(|e| self.failed(consumer, e))?
            } else {
                None
            };
            *timed = true;
            if let Some(row) = claimed {
                let failed_before = row.try_get("failed").map_err(InboxError::Database)?;
                let row = row.try_get("claimed_row").map_err(InboxError::Database)?;
                return Ok(Claim::Claimed(ClaimedMessage::new(
                    tx,
                    identity,
                    self.clone(),
                    message::Claimed::First { failed_before, row },
                )));
            }
            // Taken: by a committed row, or by a claim in flight. A read in the same
            // transaction (a new snapshot) tells which.
            let read = bind_identity!(crate::sql::query(&read_sql), &identity)
                .bind(lock.0)
                .bind(lock.1)
                .fetch_one(&mut tx);
            let row = within(self.deadline, read)
                .await
                .map_err(|e| self.failed(consumer, e))?;
            // Nothing was written: dropping the transaction rolls it back (and releases the
            // key's lock) in a task of its own, so the duplicate's answer does not wait for
            // its ROLLBACK.
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
    pub(super) async fn settle(
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
        const FIRST: Duration = Duration::from_millis(2);
        const LONGEST: Duration = Duration::from_millis(50);
        let mut poll = 0u32;
        loop {
            poll = poll.saturating_add(1);
            let now = Instant::now();
            if now >= deadline {
                return Ok(Settled::Busy);
            }
            // Jittered, so that the pollers of many keys do not poll in lockstep.
            let pause = jittered(FIRST, LONGEST, poll);
            tokio::time::sleep(pause.min(deadline - now)).await;
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
        let row = bind_identity!(crate::sql::query(&sql), identity)
            .bind(lock.0)
            .bind(lock.1)
            .fetch_one(self.guarded())
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
        self.check_layout(identity.consumer()).await?;
        let tx = self
            .guarded()
            .begin(self.isolation.begin(self.schema.layout()))
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
}

/// Counts a claim's outcome and names it (for the span).
pub(crate) fn count_claim(
    claim: &Claim,
    labels: impl FnOnce() -> Vec<::metrics::Label>,
) -> &'static str {
    let (counter, outcome) = match claim {
        // Nothing to count: the labels are not even built on a first-seen command's path.
        Claim::Claimed(_) => return "claimed",
        Claim::Duplicate(_) => (m::DUPLICATES, "duplicate"),
        Claim::Conflict(_) => (m::IDENTITY_CONFLICTS, "conflict"),
        Claim::InProgress => (m::IN_PROGRESS, "in-progress"),
    };
    m::count(counter, &labels(), 1);
    outcome
}
