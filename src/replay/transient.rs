//! Telling a serialization failure or deadlock apart from other errors a step returns.

use std::error::Error;

use crate::inbox::{InboxError, RetryReason};

/// An error that can say whether it was a serialization failure or a deadlock: the
/// transaction that hit it can be re-run from the start and may then succeed.
///
/// The error type of a [`CompensatedMigration`](super::CompensatedMigration) step implements
/// it, so that such a step is re-run under the migration's
/// [`TransientRetry`](crate::inbox::TransientRetry) instead of failing. It is implemented for
/// [`sqlx::Error`], [`InboxError`], boxed errors (looking through their
/// [`source`](Error::source) chain for either) and [`Infallible`](std::convert::Infallible).
/// For an error type of your own, answer from the `sqlx::Error` it wraps:
///
/// ```
/// use tower_inbox::replay::TransientError;
/// use tower_inbox::inbox::RetryReason;
///
/// #[derive(Debug)]
/// enum FixError {
///     Db(sqlx::Error),
///     AccountClosed(String),
/// }
///
/// impl TransientError for FixError {
///     fn retry_reason(&self) -> Option<RetryReason> {
///         match self {
///             FixError::Db(e) => e.retry_reason(),
///             FixError::AccountClosed(_) => None,
///         }
///     }
/// }
/// # assert!(!FixError::AccountClosed("a1".into()).is_transient());
/// ```
pub trait TransientError {
    /// Why the transaction should be re-run: a serialization failure or deadlock, or `None`
    /// for any other error.
    fn retry_reason(&self) -> Option<RetryReason>;

    /// Whether the transaction that returned this error may succeed when re-run.
    fn is_transient(&self) -> bool {
        self.retry_reason().is_some()
    }
}

impl TransientError for sqlx::Error {
    fn retry_reason(&self) -> Option<RetryReason> {
        RetryReason::of(self)
    }
}

impl TransientError for InboxError {
    fn retry_reason(&self) -> Option<RetryReason> {
        InboxError::retry_reason(self)
    }
}

impl TransientError for Box<dyn Error + Send + Sync> {
    fn retry_reason(&self) -> Option<RetryReason> {
        let mut next: Option<&(dyn Error + 'static)> = Some(self.as_ref());
        while let Some(err) = next {
            if let Some(sqlx) = err.downcast_ref::<sqlx::Error>() {
                return sqlx.retry_reason();
            }
            if let Some(inbox) = err.downcast_ref::<InboxError>() {
                return inbox.retry_reason();
            }
            next = err.source();
        }
        None
    }
}

impl TransientError for std::convert::Infallible {
    fn retry_reason(&self) -> Option<RetryReason> {
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
