//! `&mut ClaimedMessage` as an sqlx executor that watches for transient failures.
//!
//! A handler maps database errors to its own responses, so by the time the layer sees the
//! answer a serialization failure looks like any other 500. Watching the statements as they
//! run is the only place the `SQLSTATE` is still known; the layer reads it afterwards to
//! decide on a re-run.

use futures_util::future::BoxFuture;
use futures_util::stream::{BoxStream, StreamExt};
use futures_util::FutureExt;
use sqlx::postgres::{PgQueryResult, PgRow, PgTypeInfo};
use sqlx::{Database, Describe, Either, Execute, Executor, Postgres};

use super::{ClaimedMessage, RetryReason};

/// Notes why the transaction must re-run, if `err` says it must (the first reason wins).
pub(super) fn watch(retry: &mut Option<RetryReason>, err: &sqlx::Error) {
    if retry.is_none() {
        *retry = RetryReason::of(err);
    }
}

impl<'c> Executor<'c> for &'c mut ClaimedMessage {
    type Database = Postgres;

    fn fetch_many<'e, 'q: 'e, E>(
        self,
        query: E,
    ) -> BoxStream<'e, Result<Either<PgQueryResult, PgRow>, sqlx::Error>>
    where
        'c: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        let ClaimedMessage { tx, retry, .. } = self;
        tx.fetch_many(query)
            .map(move |item| {
                if let Err(err) = &item {
                    watch(retry, err);
                }
                item
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
        let ClaimedMessage { tx, retry, .. } = self;
        async move {
            let row = tx.fetch_optional(query).await;
            if let Err(err) = &row {
                watch(retry, err);
            }
            row
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
        self.tx.prepare_with(sql, parameters)
    }

    fn describe<'e, 'q: 'e>(
        self,
        sql: &'q str,
    ) -> BoxFuture<'e, Result<Describe<Postgres>, sqlx::Error>>
    where
        'c: 'e,
    {
        self.tx.describe(sql)
    }
}
