//! The connections the crate's own statements run on: each statement gets an answer within a
//! deadline, and a connection whose state is unknown is closed, never returned to the pool.
//!
//! (Over 400 lines: the guarded pool, the owned transaction and the statement wrapper share one
//! rule, when a connection may go back to the pool, and read best side by side.)
//!
//! A connection can go half-open: a network partition, or a database host that vanished,
//! leaves both ends open with nothing passing and neither end told. A statement on it waits
//! for ever, and so does the pool when the connection comes back to it: sqlx pings a
//! returned connection (and sends the rollback a dropped transaction left queued), with no
//! limit of its own, and the pool's slot is held while it waits. A few half-open connections
//! would take a service's whole pool for good. So every statement the crate sends runs
//! within a deadline, and a connection that missed one, or was dropped in the middle of a
//! statement or a transaction, is closed (sqlx's documented `PoolConnection::close_on_drop`):
//! the pool opens a new one, and the server ends the old session's transaction when it hears
//! of the close, or after `idle_in_transaction_session_timeout` when it cannot.

use std::ops::{Deref, DerefMut};
use std::time::Duration;

use futures_util::future::BoxFuture;
use futures_util::stream::{self, BoxStream, StreamExt, TryStreamExt};
use futures_util::FutureExt;
use sqlx::error::BoxDynError;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgArguments, PgConnection, PgQueryResult, PgRow, PgStatement, PgTypeInfo};
use sqlx::{Database, Describe, Either, Execute, Executor, PgPool, Postgres};

use crate::schema::Pooling;

/// The deadline of a statement the crate sends, unless configured otherwise: far above any
/// statement's normal time (they are single-row reads and writes), well below the time a
/// client waits for its answer.
pub(crate) const DEFAULT_STATEMENT_DEADLINE: Duration = Duration::from_secs(10);

/// The error a statement that got no answer within `deadline` fails with: an I/O error, so
/// it is classified as a lost connection (a re-run on a new connection is safe, and a lost
/// `COMMIT` has an unknown outcome).
pub(crate) fn timed_out(deadline: Duration) -> sqlx::Error {
    sqlx::Error::Io(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!(
            "no answer from the database within {} ms; the connection is closed",
            deadline.as_millis()
        ),
    ))
}

/// Runs `statement`, failing with [`timed_out`] if it has not finished within `deadline`.
pub(crate) async fn within<T>(
    deadline: Duration,
    statement: impl std::future::Future<Output = Result<T, sqlx::Error>>,
) -> Result<T, sqlx::Error> {
    tokio::time::timeout(deadline, statement)
        .await
        .unwrap_or_else(|_| Err(timed_out(deadline)))
}

/// A statement as the [`Pooling`] lets it go: as it is, or unnamed when the next transaction
/// may run on a server connection that never saw it prepared.
pub(crate) struct Sent<E> {
    statement: E,
    unnamed: bool,
}

impl<E> Sent<E> {
    pub(crate) fn new(statement: E, pooling: Pooling) -> Self {
        Self {
            statement,
            unnamed: pooling.per_transaction(),
        }
    }
}

impl<'q, E: Execute<'q, Postgres>> Execute<'q, Postgres> for Sent<E> {
    fn sql(&self) -> &'q str {
        self.statement.sql()
    }

    fn statement(&self) -> Option<&PgStatement<'q>> {
        self.statement.statement()
    }

    fn take_arguments(&mut self) -> Result<Option<PgArguments>, BoxDynError> {
        self.statement.take_arguments()
    }

    fn persistent(&self) -> bool {
        self.statement.persistent() && !self.unnamed
    }
}

/// A pooled connection that goes back to the pool only once marked [`clean`](Self::clean),
/// and is closed otherwise.
#[derive(Debug)]
pub(crate) struct Lease {
    conn: PoolConnection<Postgres>,
    clean: bool,
}

impl Lease {
    pub(crate) async fn acquire(pool: &PgPool) -> Result<Self, sqlx::Error> {
        Ok(Self {
            conn: pool.acquire().await?,
            clean: false,
        })
    }

    /// Marks the connection as between statements and outside any transaction: dropped, it
    /// goes back to the pool.
    pub(crate) fn clean(&mut self) {
        self.clean = true;
    }
}

impl Deref for Lease {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        &self.conn
    }
}

impl DerefMut for Lease {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.conn
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if !self.clean {
            self.conn.close_on_drop();
        }
    }
}

/// The pool as an executor for autocommit statements: each one on a [`Lease`], within the
/// deadline. The rows are read in full before the first is handed on (the crate's
/// statements return a bounded number), so the connection is back in the pool, or closed,
/// by then. With [`Pooling::Transaction`] each statement is unnamed and runs in a
/// transaction of its own. Preparing and describing (which the crate never does) go to the
/// pool as they are, within the deadline only.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Guarded<'p> {
    pub(crate) pool: &'p PgPool,
    pub(crate) deadline: Duration,
    pub(crate) pooling: Pooling,
}

impl<'p> Guarded<'p> {
    pub(crate) fn new(pool: &'p PgPool, deadline: Duration, pooling: Pooling) -> Self {
        Self {
            pool,
            deadline,
            pooling,
        }
    }

    /// `pool` within [`DEFAULT_STATEMENT_DEADLINE`], sent as `schema`'s pooling needs: what
    /// the crate's components without a deadline setting of their own use.
    pub(crate) fn for_schema(pool: &'p PgPool, schema: &crate::schema::Schema) -> Self {
        Self::new(pool, DEFAULT_STATEMENT_DEADLINE, schema.pooling())
    }

    /// Takes a connection and opens a transaction on it with `begin` (a `BEGIN` statement).
    pub(crate) async fn begin(self, begin: &'static str) -> Result<OwnedTx, sqlx::Error> {
        let mut lease = Lease::acquire(self.pool).await?;
        within(self.deadline, (&mut *lease).execute(begin)).await?;
        Ok(OwnedTx {
            lease: Some(lease),
            deadline: self.deadline,
            pooling: self.pooling,
        })
    }
}

/// Opens the transaction an autocommit statement runs in with `pooling`, if it needs one:
/// through a transaction-mode pooler, the `Sync` after an unnamed statement's parse ends the
/// client's hold on its server connection when no transaction is open, and the statement's
/// run could go to another.
async fn open(conn: &mut PgConnection, pooling: Pooling) -> Result<(), sqlx::Error> {
    if pooling.per_transaction() {
        conn.execute("BEGIN").await?;
    }
    Ok(())
}

/// Ends what [`open`] opened, committing if `result` is a success, and answers whether the
/// connection is left outside any transaction, with the result.
async fn close<T>(
    conn: &mut PgConnection,
    pooling: Pooling,
    result: Result<T, sqlx::Error>,
) -> (bool, Result<T, sqlx::Error>) {
    if !pooling.per_transaction() {
        return (true, result);
    }
    let end = if result.is_ok() { "COMMIT" } else { "ROLLBACK" };
    match (conn.execute(end).await, result) {
        (Ok(_), result) => (true, result),
        // A failed COMMIT the server answered (a deferred constraint, say) ends the
        // transaction all the same.
        (Err(err), Ok(_)) => (matches!(err, sqlx::Error::Database(_)), Err(err)),
        (Err(_), Err(err)) => (false, Err(err)),
    }
}

/// Whether `result` failed for want of an answer within the deadline: the connection may
/// still owe one.
fn missed_deadline<T>(result: &Result<T, sqlx::Error>) -> bool {
    matches!(result, Err(sqlx::Error::Io(e)) if e.kind() == std::io::ErrorKind::TimedOut)
}

impl<'c> Executor<'c> for Guarded<'c> {
    type Database = Postgres;

    fn fetch_many<'e, 'q: 'e, E>(
        self,
        query: E,
    ) -> BoxStream<'e, Result<Either<PgQueryResult, PgRow>, sqlx::Error>>
    where
        'c: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        let Self {
            pool,
            deadline,
            pooling,
        } = self;
        let all = async move {
            let mut lease = Lease::acquire(pool).await?;
            let run = async {
                if let Err(err) = open(&mut lease, pooling).await {
                    return (false, Err(err));
                }
                let items = (&mut *lease)
                    .fetch_many(Sent::new(query, pooling))
                    .try_collect::<Vec<_>>()
                    .await;
                close(&mut lease, pooling, items).await
            };
            let (ended, items) = within(deadline, async { Ok(run.await) })
                .await
                .unwrap_or_else(|err| (false, Err(err)));
            // A database error leaves the connection usable; a lost one fails the pool's
            // ping at once. Only a missed deadline leaves it waiting for an answer.
            if ended && !missed_deadline(&items) {
                lease.clean();
            }
            items
        };
        stream::once(all)
            .flat_map(|all| match all {
                Ok(items) => stream::iter(items.into_iter().map(Ok).collect::<Vec<_>>()),
                Err(err) => stream::iter(vec![Err(err)]),
            })
            .boxed()
    }

    fn fetch_optional<'e, 'q: 'e, E>(
        self,
        query: E,
    ) -> BoxFuture<'e, Result<Option<PgRow>, sqlx::Error>>
    where
        'c: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        // The statement has ended, and its connection gone back, before the first item.
        let mut items = self.fetch_many(query);
        async move {
            while let Some(item) = items.try_next().await? {
                if let Either::Right(row) = item {
                    return Ok(Some(row));
                }
            }
            Ok(None)
        }
        .boxed()
    }

    fn prepare_with<'e, 'q: 'e>(
        self,
        sql: &'q str,
        parameters: &'e [PgTypeInfo],
    ) -> BoxFuture<'e, Result<<Postgres as Database>::Statement<'q>, sqlx::Error>>
    where
        'c: 'e,
    {
        let Self { pool, deadline, .. } = self;
        async move { within(deadline, pool.prepare_with(sql, parameters)).await }.boxed()
    }

    fn describe<'e, 'q: 'e>(
        self,
        sql: &'q str,
    ) -> BoxFuture<'e, Result<Describe<Postgres>, sqlx::Error>>
    where
        'c: 'e,
    {
        let Self { pool, deadline, .. } = self;
        async move { within(deadline, pool.describe(sql)).await }.boxed()
    }
}

/// A transaction on a [`Lease`] of its own ([`Guarded::begin`]), whose statements the caller
/// runs within its deadline, through the transaction as an executor (which sends them as the
/// [`Pooling`] needs). Committed or rolled back, the connection goes back to the pool;
/// dropped while open (a handler's future dropped, a client gone, a deadline missed), it is
/// rolled back in a task of its own within the deadline, and closed if that fails.
#[derive(Debug)]
pub(crate) struct OwnedTx {
    lease: Option<Lease>,
    deadline: Duration,
    pooling: Pooling,
}

impl OwnedTx {
    pub(crate) async fn commit(self) -> Result<(), sqlx::Error> {
        self.end("COMMIT").await
    }

    pub(crate) async fn rollback(self) -> Result<(), sqlx::Error> {
        self.end("ROLLBACK").await
    }

    async fn end(mut self, statement: &'static str) -> Result<(), sqlx::Error> {
        let mut lease = self
            .lease
            .take()
            .expect("an open transaction has its connection");
        let ended = within(self.deadline, (&mut *lease).execute(statement)).await;
        // An error the server sent (a serialization failure at COMMIT, say) ends the
        // transaction too: the connection is idle and goes back.
        if matches!(ended, Ok(_) | Err(sqlx::Error::Database(_))) {
            lease.clean();
        }
        ended.map(drop)
    }

    /// The plain connection, for a handler's code that takes one: what it sends there is
    /// sent as it is, whatever the [`Pooling`].
    pub(crate) fn connection(&mut self) -> &mut PgConnection {
        self.lease
            .as_mut()
            .expect("an open transaction has its connection")
    }
}

impl<'c> Executor<'c> for &'c mut OwnedTx {
    type Database = Postgres;

    fn fetch_many<'e, 'q: 'e, E>(
        self,
        query: E,
    ) -> BoxStream<'e, Result<Either<PgQueryResult, PgRow>, sqlx::Error>>
    where
        'c: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        let pooling = self.pooling;
        self.connection().fetch_many(Sent::new(query, pooling))
    }

    fn fetch_optional<'e, 'q: 'e, E>(
        self,
        query: E,
    ) -> BoxFuture<'e, Result<Option<PgRow>, sqlx::Error>>
    where
        'c: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        let pooling = self.pooling;
        self.connection().fetch_optional(Sent::new(query, pooling))
    }

    fn prepare_with<'e, 'q: 'e>(
        self,
        sql: &'q str,
        parameters: &'e [PgTypeInfo],
    ) -> BoxFuture<'e, Result<<Postgres as Database>::Statement<'q>, sqlx::Error>>
    where
        'c: 'e,
    {
        self.connection().prepare_with(sql, parameters)
    }

    fn describe<'e, 'q: 'e>(
        self,
        sql: &'q str,
    ) -> BoxFuture<'e, Result<Describe<Postgres>, sqlx::Error>>
    where
        'c: 'e,
    {
        self.connection().describe(sql)
    }
}

impl Drop for OwnedTx {
    fn drop(&mut self) {
        let Some(lease) = self.lease.take() else {
            return;
        };
        // Without a runtime the lease is dropped as it is: closed.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let deadline = self.deadline;
            runtime.spawn(async move {
                let mut lease = lease;
                // Waits out what an interrupted statement left unanswered first.
                if within(deadline, (&mut *lease).execute("ROLLBACK"))
                    .await
                    .is_ok()
                {
                    lease.clean();
                }
            });
        }
    }
}
