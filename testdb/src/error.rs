//! The crate's error type.

use std::fmt;
use std::sync::Arc;

/// Why a PostgreSQL server or a test database could not be provided.
///
/// [`Display`](fmt::Display) gives the top-level message only (what was being
/// attempted and, where it helps, what to do about it); the underlying cause,
/// if any, is available through [`std::error::Error::source`]. [`Debug`]
/// prints the whole chain, so `.expect(..)` and `unwrap()` in a test show
/// everything at once.
///
/// The error is cheap to clone because [`server()`](crate::server) caches a
/// failed discovery and hands the same error to every caller in the process.
#[derive(Clone)]
pub struct Error {
    message: String,
    source: Option<Arc<dyn std::error::Error + Send + Sync + 'static>>,
}

impl Error {
    /// An error with a message and no underlying cause.
    pub(crate) fn msg(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            source: None,
        }
    }

    /// An error with a message explaining what failed, caused by `source`.
    pub(crate) fn with_source(
        message: impl Into<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Self {
            message: message.into(),
            source: Some(Arc::new(source)),
        }
    }

    /// The same error with `prefix` put before its message.
    pub(crate) fn prefixed(mut self, prefix: &str) -> Self {
        self.message = format!("{prefix}{}", self.message);
        self
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)?;
        let mut cause = std::error::Error::source(self);
        while let Some(err) = cause {
            write!(f, "\n  caused by: {err}")?;
            cause = err.source();
        }
        Ok(())
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|err| err as &(dyn std::error::Error + 'static))
    }
}

/// Attaches a message to the error of a fallible operation.
pub(crate) trait Context<T> {
    /// Wraps the error, if any, in an [`Error`] whose message is `message()`.
    fn context<M: Into<String>>(self, message: impl FnOnce() -> M) -> Result<T, Error>;
}

impl<T, E> Context<T> for Result<T, E>
where
    E: std::error::Error + Send + Sync + 'static,
{
    fn context<M: Into<String>>(self, message: impl FnOnce() -> M) -> Result<T, Error> {
        self.map_err(|err| Error::with_source(message(), err))
    }
}
