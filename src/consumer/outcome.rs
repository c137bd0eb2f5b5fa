//! What processing one message came to, and what the broker is told.

use std::time::Duration;

use crate::inbox::{InboxEntry, InboxError};
use crate::retention::ExpiredMessage;

/// What [`Consumer::process`](super::Consumer::process) did with one message.
#[derive(Debug)]
pub enum Processed<T, E> {
    /// First seen: the handler ran and its writes committed with the claim. `T` is what the
    /// handler returned.
    Applied(T),
    /// Applied before (this is a redelivery or a republish): nothing ran. The entry is the
    /// recorded outcome.
    Duplicate(InboxEntry),
    /// Another consumer holds the message and did not finish within the wait: nothing ran.
    InProgress,
    /// The same message ID was applied before with a different payload: nothing ran, and the
    /// conflict is kept in the quarantine.
    Conflict(InboxEntry),
    /// The handler failed and everything it wrote rolled back. The attempt was counted; the
    /// message may be delivered again after `retry_in`.
    Failed {
        /// The handler's error.
        error: E,
        /// A suggested delay before the redelivery (exponential in the delivery count).
        retry_in: Duration,
    },
    /// The handler failed for the `quarantine_after`th time: the message is in the
    /// quarantine (item `quarantine_id`) for a person to decide on, and must not be
    /// redelivered.
    Quarantined {
        /// The handler's last error.
        error: E,
        /// The quarantine item.
        quarantine_id: i64,
    },
    /// First seen, but produced before the retention window: not processed, kept in the
    /// quarantine (see [`RetentionGuard`](crate::retention::RetentionGuard)).
    Expired(ExpiredMessage),
    /// The database failed: unreachable, or conflicting past the re-run budget. Nothing
    /// committed, or (a lost `COMMIT`) the redelivery will find out; retry after `retry_in`.
    Unavailable {
        /// What failed.
        error: InboxError,
        /// A suggested delay before the redelivery.
        retry_in: Duration,
    },
}

impl<T, E> Processed<T, E> {
    /// The disposition by the default table (see the [module docs](super)).
    pub fn disposition(&self) -> Disposition {
        match self {
            Self::Applied(_) | Self::Duplicate(_) => Disposition::Ack,
            Self::InProgress => Disposition::Retry(IN_PROGRESS_DELAY),
            Self::Failed { retry_in, .. } | Self::Unavailable { retry_in, .. } => {
                Disposition::Retry(*retry_in)
            }
            Self::Conflict(_) | Self::Quarantined { .. } | Self::Expired(_) => Disposition::Reject,
        }
    }

    /// A short stable name, for logs and metric labels.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Applied(_) => "applied",
            Self::Duplicate(_) => "duplicate",
            Self::InProgress => "in-progress",
            Self::Conflict(_) => "conflict",
            Self::Failed { .. } => "failed",
            Self::Quarantined { .. } => "quarantined",
            Self::Expired(_) => "expired",
            Self::Unavailable { .. } => "unavailable",
        }
    }
}

/// How long a message held by another consumer waits before its redelivery, by default.
pub const IN_PROGRESS_DELAY: Duration = Duration::from_secs(1);

/// What the broker is told about a message, once the outcome is durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disposition {
    /// Done with it: acknowledge (NATS `ack`, AMQP `basic.ack`).
    Ack,
    /// Deliver it again after the delay (NATS `nak` with delay; AMQP `basic.nack` with
    /// requeue, the delay left to the queue's own policy).
    Retry(Duration),
    /// Never deliver it again (NATS `term`; AMQP `basic.reject` without requeue, to the
    /// dead-letter exchange if the queue has one). What it needs is in the quarantine.
    Reject,
}
