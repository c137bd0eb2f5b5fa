//! Refuses first-seen messages too old for the inbox to vouch for.

use std::time::Duration;

use time::OffsetDateTime;

use super::policy::RetentionPolicy;
use crate::fingerprint::Fingerprint;
use crate::identity::MessageIdentity;
use crate::inbox::{Claim, Inbox, InboxError};
use crate::metrics::{count, EXPIRED};
use crate::quarantine::QuarantineSource;

/// The result of [`RetentionGuard::claim`].
#[derive(Debug)]
pub enum GuardedClaim {
    /// The inbox's answer, as [`Inbox::claim`] gives it: a duplicate, conflict or in-flight
    /// original is answered as usual however old the message is (its row is still there),
    /// and a first-seen message produced within the window is [`Claim::Claimed`].
    Claim(Claim),
    /// First seen, but produced before the window: the inbox may have processed it and
    /// forgotten it. The claim was rolled back and the message kept in the quarantine; do not
    /// process it, and acknowledge it to the broker only once the quarantine item is safely
    /// written (it is, when this is returned).
    Expired(ExpiredMessage),
}

/// A first-seen message the guard refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpiredMessage {
    /// Its identity.
    pub identity: MessageIdentity,
    /// When its producer produced it.
    pub produced_at: OffsetDateTime,
    /// The oldest production time accepted when it arrived: the database's now minus the
    /// window.
    pub oldest_accepted: OffsetDateTime,
    /// The open quarantine item (source `expired-message`, reason `retention-expired`).
    pub quarantine_id: i64,
}

/// Claims messages like [`Inbox::claim`], refusing first-seen ones produced before the
/// retention window.
///
/// Once the purge has deleted a processed message's row, a late copy of it (a redrive, a
/// rewind, a replay) would be claimed as new and applied again. A consumer that knows when
/// each message was produced (brokers carry the production timestamp) can tell such a copy
/// from a new message: anything produced before `now - window` may be one the inbox has
/// forgotten. The guard claims as usual and only when the claim is first-seen **and** the
/// message is that old does it roll the claim back, keep the message in the
/// [quarantine](crate::quarantine) for a person to decide on, count
/// [`EXPIRED`](crate::metrics::EXPIRED) (and [`QUARANTINE_MOVES`](crate::metrics::QUARANTINE_MOVES)
/// when the item is new) and return [`GuardedClaim::Expired`].
///
/// "Now" is the database's clock, the one that stamps `received_at` for the purge, so the
/// guard and the purge agree on what the window holds however far this process's clock is
/// off. The policy's safety margin must still cover the producer's clock skew.
///
/// The HTTP layer has no production timestamp: a request carries only its key. There the
/// window alone protects, so it must cover every way a request can be retried.
///
/// The guard refuses every later copy of an expired message too: deciding its quarantine
/// item does not let it through. Once a person has checked that it was never applied (or
/// decided it must be applied again), process it with [`Inbox::claim`] directly, which
/// the guard does not stand in front of, and decide the item.
///
/// ```no_run
/// use std::time::Duration;
/// use tower_inbox::retention::{GuardedClaim, RetentionGuard, RetentionPolicy};
/// use tower_inbox::{MessageIdentity, MessageKey, Producer};
/// use tower_inbox::inbox::{Claim, Inbox};
/// use tower_inbox::fingerprint::{Fingerprint};
///
/// # async fn consume(pool: sqlx::PgPool, body: &[u8], produced_at: time::OffsetDateTime)
/// # -> Result<(), Box<dyn std::error::Error>> {
/// const DAY: Duration = Duration::from_secs(24 * 3600);
/// let policy = RetentionPolicy::builder()
///     .retry_horizon(DAY)
///     .offset_rewind(7 * DAY)
///     .safety_margin(DAY)
///     .build()?;
/// let guard = RetentionGuard::new(Inbox::new(pool), &policy);
/// let identity = MessageIdentity::new(
///     "ledger-projector",
///     Producer::new("payments")?,
///     MessageKey::new("evt-0042")?,
/// );
/// let fingerprint = Fingerprint::of_bytes(body);
/// match guard
///     .claim(identity, fingerprint, "v3", Duration::from_secs(1), produced_at)
///     .await?
/// {
///     GuardedClaim::Claim(Claim::Claimed(mut message)) => {
///         sqlx::query("update account set balance = balance + 10 where id = 'a1'")
///             .execute(&mut message)
///             .await?;
///         message.commit(None).await?;
///     }
///     GuardedClaim::Claim(_) => { /* duplicate, conflict or in progress: as usual */ }
///     GuardedClaim::Expired(expired) => {
///         // Kept in the quarantine; acknowledge it, do not apply it.
///         eprintln!("refused {}: quarantine item {}", expired.identity, expired.quarantine_id);
///     }
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct RetentionGuard {
    inbox: Inbox,
    window: Duration,
}

impl RetentionGuard {
    /// A guard over `inbox` with the window of the policy the inbox is purged by.
    pub fn new(inbox: Inbox, policy: &RetentionPolicy) -> Self {
        Self {
            inbox,
            window: policy.window(),
        }
    }

    /// The window: first-seen messages produced longer ago than this are refused.
    pub fn window(&self) -> Duration {
        self.window
    }

    /// The inbox it claims in.
    pub fn inbox(&self) -> &Inbox {
        &self.inbox
    }

    /// Claims `identity` as [`Inbox::claim`] does, then refuses it if it is first seen and
    /// was produced before the window.
    ///
    /// On an error nothing was applied and no claim is left (a refused message's claim is
    /// rolled back before its quarantine item is written), so a redelivery meets the guard
    /// again.
    pub async fn claim(
        &self,
        identity: MessageIdentity,
        fingerprint: Fingerprint,
        handler_version: &str,
        wait: Duration,
        produced_at: OffsetDateTime,
    ) -> Result<GuardedClaim, InboxError> {
        let mut message = match self
            .inbox
            .claim(identity, fingerprint, handler_version, wait)
            .await?
        {
            Claim::Claimed(message) => message,
            answered => return Ok(GuardedClaim::Claim(answered)),
        };
        // The database's clock, not this process's: the purge compares `received_at`, which
        // the database stamped, against its own `now()`.
        let (expired, oldest_accepted) = message
            .produced_before_window(produced_at, self.window)
            .await?;
        if !expired {
            return Ok(GuardedClaim::Claim(Claim::Claimed(message)));
        }
        let identity = message.identity().clone();
        message.rollback().await?;
        let (quarantine_id, _) = self
            .inbox
            .quarantine_message(
                QuarantineSource::ExpiredMessage,
                "retention-expired",
                &identity,
                fingerprint,
                handler_version,
            )
            .await?;
        let labels = self
            .inbox
            .metric_labels()
            .of_consumer_shared(identity.consumer_shared());
        count(EXPIRED, &labels, 1);
        tracing::warn!(
            consumer = identity.consumer(),
            message_id = %identity.message_id(),
            %produced_at,
            %oldest_accepted,
            quarantine_id,
            "first-seen message older than the retention window refused and quarantined"
        );
        Ok(GuardedClaim::Expired(ExpiredMessage {
            identity,
            produced_at,
            oldest_accepted,
            quarantine_id,
        }))
    }
}
