//! What a database error says: the connection is gone, the server is full, the transaction
//! hit a transient conflict, or the statement itself failed. Every component classifies its
//! failures with these, so "retryable" means the same thing everywhere.

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
pub(crate) fn is_connection_failure(err: &sqlx::Error) -> bool {
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
    /// ([`ClaimedMessage::request_retry`](crate::inbox::ClaimedMessage::request_retry)).
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
    /// use tower_inbox::inbox::RetryReason;
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

/// Declares a component's error: the database could not be reached or was full
/// (`Unavailable`), the transaction hit a serialization failure or deadlock (`Transient`),
/// both worth retrying, or a statement failed (`Database`).
macro_rules! database_error {
    ($(#[$doc:meta])* $name:ident, $what:literal) => {
        $(#[$doc])*
        #[derive(Debug, thiserror::Error)]
        pub enum $name {
            /// The database cannot be reached or has no room right now (connection refused,
            /// pool timed out, server shutting down, too many connections). Nothing was
            /// changed; retrying later may succeed.
            #[error("{} database is unavailable: {}", $what, .0)]
            Unavailable(#[source] sqlx::Error),
            /// A serialization failure or deadlock: the transaction can be run again from
            /// the start.
            #[error("{} transaction hit a transient conflict: {}", $what, .0)]
            Transient(#[source] sqlx::Error),
            /// Any other database error, such as missing migrations.
            #[error("{} query failed: {}", $what, .0)]
            Database(#[source] sqlx::Error),
        }

        impl $name {
            /// Whether retrying later may succeed.
            pub fn is_retryable(&self) -> bool {
                matches!(self, Self::Unavailable(_) | Self::Transient(_))
            }
        }

        impl From<sqlx::Error> for $name {
            fn from(err: sqlx::Error) -> Self {
                if $crate::db::is_connection_failure(&err) {
                    Self::Unavailable(err)
                } else if $crate::db::RetryReason::of(&err).is_some() {
                    Self::Transient(err)
                } else {
                    Self::Database(err)
                }
            }
        }
    };
}
pub(crate) use database_error;
