//! Telling a serialization failure or deadlock apart from other errors a step returns.

use std::error::Error;
use std::fmt;

use crate::inbox::InboxError;

/// Why a transaction may succeed when re-run from the start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TransientKind {
    /// SQLSTATE `40001`: the transaction could not be serialized with a concurrent one.
    SerializationFailure,
    /// SQLSTATE `40P01`: the transaction was chosen as a deadlock victim.
    Deadlock,
}

impl TransientKind {
    /// The stable name, also the `reason` label of
    /// [`inbox_transaction_retries_total`](crate::metrics::TRANSACTION_RETRIES).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::SerializationFailure => "serialization-failure",
            Self::Deadlock => "deadlock",
        }
    }

    /// The kind of a database error, if it is transient.
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

impl fmt::Display for TransientKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An error that can say whether it was a serialization failure or a deadlock: the
/// transaction that hit it can be re-run from the start and may then succeed.
///
/// The error type of a [`CompensatedMigration`](super::CompensatedMigration) step implements
/// it, so that such a step is re-run under the migration's
/// [`TransientRetry`](crate::TransientRetry) instead of failing. It is implemented for
/// [`sqlx::Error`], [`InboxError`], boxed errors (looking through their
/// [`source`](Error::source) chain for either) and [`Infallible`](std::convert::Infallible).
/// For an error type of your own, answer from the `sqlx::Error` it wraps:
///
/// ```
/// use tower_inbox::replay::{TransientError, TransientKind};
///
/// #[derive(Debug)]
/// enum FixError {
///     Db(sqlx::Error),
///     AccountClosed(String),
/// }
///
/// impl TransientError for FixError {
///     fn transient_kind(&self) -> Option<TransientKind> {
///         match self {
///             FixError::Db(e) => e.transient_kind(),
///             FixError::AccountClosed(_) => None,
///         }
///     }
/// }
/// # assert!(!FixError::AccountClosed("a1".into()).is_transient());
/// ```
pub trait TransientError {
    /// The kind of transient failure this is, or `None` for any other error.
    fn transient_kind(&self) -> Option<TransientKind>;

    /// Whether the transaction that returned this error may succeed when re-run.
    fn is_transient(&self) -> bool {
        self.transient_kind().is_some()
    }
}

impl TransientError for sqlx::Error {
    fn transient_kind(&self) -> Option<TransientKind> {
        TransientKind::of(self)
    }
}

impl TransientError for InboxError {
    fn transient_kind(&self) -> Option<TransientKind> {
        match self {
            InboxError::Transient(err) => TransientKind::of(err),
            _ => None,
        }
    }
}

impl TransientError for Box<dyn Error + Send + Sync> {
    fn transient_kind(&self) -> Option<TransientKind> {
        let mut next: Option<&(dyn Error + 'static)> = Some(self.as_ref());
        while let Some(err) = next {
            if let Some(sqlx) = err.downcast_ref::<sqlx::Error>() {
                return sqlx.transient_kind();
            }
            if let Some(inbox) = err.downcast_ref::<InboxError>() {
                return inbox.transient_kind();
            }
            next = err.source();
        }
        None
    }
}

impl TransientError for std::convert::Infallible {
    fn transient_kind(&self) -> Option<TransientKind> {
        match *self {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn other_errors_are_not_transient() {
        assert!(!sqlx::Error::RowNotFound.is_transient());
        assert!(!InboxError::Database(sqlx::Error::RowNotFound).is_transient());
        let boxed: Box<dyn Error + Send + Sync> = "account closed".into();
        assert!(!boxed.is_transient());
        let boxed: Box<dyn Error + Send + Sync> = Box::new(sqlx::Error::PoolTimedOut);
        assert!(!boxed.is_transient());
    }
}
