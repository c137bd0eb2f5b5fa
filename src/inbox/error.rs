//! What can go wrong in the inbox's own database work, and which of it a re-run cures.

use crate::db::{is_connection_failure, is_connection_lost, RetryReason};
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
    /// [`ClaimedMessage::request_retry`](crate::inbox::ClaimedMessage::request_retry).
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
    /// The schema's layout and the settings or the database disagree: an isolation level
    /// the [partitioned layout](crate::partition) refuses, or tables migrated with another
    /// layout. Nothing was claimed.
    #[error(transparent)]
    Layout(#[from] super::LayoutError),
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
            Self::ClaimMissing | Self::Database(_) | Self::Layout(_) => "internal",
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
            Self::ClaimMissing | Self::Database(_) | Self::Layout(_) => None,
        }
    }
}
