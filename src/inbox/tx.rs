//! The claimed transaction's connection.
//!
//! The claim travels in the same message as the `BEGIN`, and a taken key answers with an
//! error. sqlx's `Transaction::begin` can send such a message, but when it fails it drops
//! the connection, and the pool takes it back inside the aborted transaction (sqlx's
//! release ping does not look at the transaction status). So the transaction is begun and
//! ended here through sqlx's [`TransactionManager`], on a connection this module keeps: on
//! failure it is rolled back before it goes back, and sqlx's own bookkeeping (the
//! connection's transaction depth) stays exactly as a `Transaction` would keep it. Dropped
//! unfinished, the transaction is rolled back by a `ROLLBACK` queued on the connection and
//! sent with the pool's release ping.

use std::ops::{Deref, DerefMut};

use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnection, PgRow, PgTransactionManager};
use sqlx::{Postgres, TransactionManager};

/// An open transaction on a pooled connection.
#[derive(Debug)]
pub(crate) struct OpenTx {
    conn: PoolConnection<Postgres>,
}

/// A `BEGIN` message that failed. The connection may be left inside a transaction that sqlx
/// does not count (the `BEGIN` ran, a later statement of the message failed), so it is not
/// handed back to the pool before [`rollback_then`](Self::rollback_then) has ended it.
#[derive(Debug)]
pub(crate) struct BeginError {
    error: sqlx::Error,
    conn: CloseUnlessReleased,
}

/// Closes the connection instead of returning it to the pool if dropped while it still
/// holds it: a future cancelled in the middle of a message leaves the session in a state
/// sqlx cannot see, and closing it is the one way to be sure it ends.
#[derive(Debug)]
struct CloseUnlessReleased(Option<PoolConnection<Postgres>>);

impl CloseUnlessReleased {
    fn conn(&mut self) -> &mut PgConnection {
        self.0.as_mut().expect("held until released")
    }

    fn release(mut self) -> PoolConnection<Postgres> {
        self.0.take().expect("held until released")
    }
}

impl Drop for CloseUnlessReleased {
    fn drop(&mut self) {
        if let Some(conn) = &mut self.0 {
            conn.close_on_drop();
        }
    }
}

impl OpenTx {
    /// Sends `statement` on `conn` as one simple query: a `BEGIN …`, possibly followed by
    /// more statements that run inside the new transaction. Their results are not returned;
    /// their failure is the error.
    pub(crate) async fn begin(
        conn: PoolConnection<Postgres>,
        statement: String,
    ) -> Result<Self, BeginError> {
        let mut conn = CloseUnlessReleased(Some(conn));
        match PgTransactionManager::begin(conn.conn(), Some(statement.into())).await {
            Ok(()) => Ok(Self {
                conn: conn.release(),
            }),
            Err(error) => Err(BeginError { error, conn }),
        }
    }

    /// Commits.
    pub(crate) async fn commit(mut self) -> Result<(), sqlx::Error> {
        PgTransactionManager::commit(&mut self.conn).await
    }

    /// Rolls back.
    pub(crate) async fn rollback(mut self) -> Result<(), sqlx::Error> {
        PgTransactionManager::rollback(&mut self.conn).await
    }
}

impl Drop for OpenTx {
    fn drop(&mut self) {
        // Queues a ROLLBACK when the transaction is still open (sqlx's depth says so);
        // nothing after a commit or rollback.
        PgTransactionManager::start_rollback(&mut self.conn);
    }
}

impl Deref for OpenTx {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        &self.conn
    }
}

impl DerefMut for OpenTx {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.conn
    }
}

impl BeginError {
    /// The SQLSTATE of the failure, if the server answered with one.
    pub(crate) fn code(&self) -> Option<String> {
        match &self.error {
            sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
            _ => None,
        }
    }

    /// Ends whatever the failed message left open with `ROLLBACK`, followed in the same
    /// message by `then` (more statements, or nothing), and returns the rows `then` read.
    /// The connection goes back to the pool only when that succeeded; it is closed otherwise.
    pub(crate) async fn rollback_then(self, then: &str) -> Result<Vec<PgRow>, sqlx::Error> {
        end(self.conn, then).await
    }

    /// Ends whatever the failed message left open, and gives back the failure. A failed
    /// `ROLLBACK` closes the connection and is not reported: the first failure is the news.
    pub(crate) async fn rollback_into_error(self) -> sqlx::Error {
        let _ = end(self.conn, "").await;
        self.error
    }
}

async fn end(mut conn: CloseUnlessReleased, then: &str) -> Result<Vec<PgRow>, sqlx::Error> {
    let sql = if then.is_empty() {
        "rollback".to_owned()
    } else {
        format!("rollback; {then}")
    };
    // Through the Executor trait: its boxed future is Send, RawSql's own is not provably.
    let rows = sqlx::Executor::fetch_all(conn.conn(), sqlx::raw_sql(&sql)).await?;
    drop(conn.release());
    Ok(rows)
}
