//! What can go wrong in the inbox's own database work, and which of it a re-run cures.

use crate::metrics as m;

/// A failure of the inbox's own database work.
#[derive(Debug, thiserror::Error)]
pub enum InboxError {
    /// The database cannot be reached or has no room right now (connection refused, pool
    /// timed out, server shutting down, too many connections). Nothing was committed;
    /// retrying later may succeed.
    #[error("the inbox database is unavailable: {0}")]
    Unavailable(#[source] sqlx::Error),
    /// The connection failed while `COMMIT` was in flight: the server may or may not have
    /// committed. A retry of the same command is safe: its claim finds the committed row
    /// and replays it, or finds the key free and runs the command once.
    #[error("the connection failed during COMMIT; whether it committed is unknown: {0}")]
    OutcomeUnknown(#[source] sqlx::Error),
    /// A serialization failure or deadlock: the transaction can be retried from the start.
    #[error("the inbox transaction hit a transient conflict: {0}")]
    Transient(#[source] sqlx::Error),
    /// The transaction was rolled back instead of committed because it has to be re-run:
    /// a watched statement failed with a serialization failure or deadlock (which aborted
    /// it), or a re-run was requested with
    /// [`ClaimedMessage::request_retry`](crate::ClaimedMessage::request_retry).
    #[error("the inbox transaction was rolled back to be re-run ({0})")]
    Rerun(RetryReason),
    /// The row this transaction claimed was gone when its outcome was to be recorded (a
    /// statement of the handler deleted it, say). The transaction was rolled back, so the
    /// claim never commits without its response and the message stays retryable.
    #[error("the claimed inbox row was missing when its outcome was recorded; rolled back")]
    ClaimMissing,
    /// Any other database error, such as missing migrations.
    #[error("the inbox query failed: {0}")]
    Database(#[source] sqlx::Error),
}

impl InboxError {
    /// The error a statement failed with, by what it says about the database.
    pub(crate) fn classify(err: sqlx::Error) -> Self {
        if is_connection_failure(&err) {
            return Self::Unavailable(err);
        }
        match RetryReason::of(&err) {
            Some(_) => Self::Transient(err),
            None => Self::Database(err),
        }
    }

    /// The error `COMMIT` failed with: a lost connection leaves the outcome unknown.
    pub(crate) fn classify_commit(err: sqlx::Error) -> Self {
        if is_connection_lost(&err) {
            return Self::OutcomeUnknown(err);
        }
        Self::classify(err)
    }

    /// Whether a later retry of the whole command may succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            Self::Unavailable(_) | Self::OutcomeUnknown(_) | Self::Transient(_) | Self::Rerun(_)
        )
    }

    /// Whether something may have been committed: only a `COMMIT` whose answer was lost.
    pub fn may_have_committed(&self) -> bool {
        matches!(self, Self::OutcomeUnknown(_))
    }

    /// Counts the error in [`DATABASE_ERRORS`](m::DATABASE_ERRORS); serialization failures
    /// and deadlocks are contention, not errors, and are counted as re-runs instead.
    pub(crate) fn count(&self, consumer: &[::metrics::Label]) {
        if !matches!(self, Self::Transient(_) | Self::Rerun(_)) {
            m::count_with(m::DATABASE_ERRORS, consumer, "kind", self.kind());
        }
    }

    /// The kind, as a stable span field and metric label.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Self::Unavailable(_) => "unavailable",
            Self::OutcomeUnknown(_) => "outcome-unknown",
            Self::Transient(_) | Self::Rerun(_) => "transient",
            Self::ClaimMissing | Self::Database(_) => "internal",
        }
    }

    /// Why running the message again from its claim is safe and may succeed, if it is: a
    /// serialization failure or deadlock, a requested re-run, or a lost connection (before
    /// or during `COMMIT`: the new claim finds the committed row and replays it, or finds the
    /// key free and runs the message once). `None` for errors a re-run would meet again.
    pub fn retry_reason(&self) -> Option<RetryReason> {
        match self {
            Self::Transient(err) => RetryReason::of(err),
            Self::Rerun(reason) => Some(*reason),
            Self::Unavailable(err) | Self::OutcomeUnknown(err) => {
                is_connection_lost(err).then_some(RetryReason::ConnectionLost)
            }
            Self::ClaimMissing | Self::Database(_) => None,
        }
    }
}

/// Whether `err` says the connection went away or could not be made: the server restarted,
/// failed over or ended the session, or the network failed. Rerunning on another connection
/// is the cure. (A pool that timed out is full or cannot connect, and was waited for already.)
pub(crate) fn is_connection_lost(err: &sqlx::Error) -> bool {
    use sqlx::Error as E;
    match err {
        E::Io(_) | E::Tls(_) | E::Protocol(_) | E::WorkerCrashed => true,
        // connection exceptions; administrator, crash or startup shutdown
        E::Database(db) => db.code().is_some_and(|code| {
            code.starts_with("08") || matches!(&*code, "57P01" | "57P02" | "57P03")
        }),
        _ => false,
    }
}

/// Whether `err` says the database or the connection to it is gone or full, rather than
/// that a statement was wrong.
fn is_connection_failure(err: &sqlx::Error) -> bool {
    use sqlx::Error as E;
    match err {
        E::Io(_)
        | E::Tls(_)
        | E::PoolTimedOut
        | E::PoolClosed
        | E::WorkerCrashed
        | E::Protocol(_) => true,
        // connection exceptions, insufficient resources, operator intervention
        E::Database(db) => db.code().is_some_and(|code| {
            code.starts_with("08")
                || code.starts_with("53")
                || matches!(&*code, "57P01" | "57P02" | "57P03")
        }),
        _ => false,
    }
}

/// Why a transaction is rolled back and re-run from the start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RetryReason {
    /// `40001`: the transaction could not be serialized with a concurrent one.
    SerializationFailure,
    /// `40P01`: the transaction was chosen as the victim of a deadlock.
    Deadlock,
    /// The handler asked for it
    /// ([`ClaimedMessage::request_retry`](crate::ClaimedMessage::request_retry)).
    Requested,
    /// The connection was lost (the server restarted, failed over, ended the session, or the
    /// network failed), before or during `COMMIT`. The next run claims on another connection,
    /// and the claim decides: a committed run is replayed, an uncommitted one runs again.
    ConnectionLost,
}

impl RetryReason {
    /// The stable name, also a metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::SerializationFailure => "serialization-failure",
            Self::Deadlock => "deadlock",
            Self::Requested => "requested",
            Self::ConnectionLost => "connection-lost",
        }
    }

    /// The reason a database error calls for a re-run, if it does.
    ///
    /// ```
    /// use tower_inbox::RetryReason;
    /// assert_eq!(RetryReason::of(&sqlx::Error::RowNotFound), None);
    /// let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
    /// assert_eq!(RetryReason::of(&sqlx::Error::Io(reset)), Some(RetryReason::ConnectionLost));
    /// ```
    pub fn of(err: &sqlx::Error) -> Option<Self> {
        if is_connection_lost(err) {
            return Some(Self::ConnectionLost);
        }
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
