//! The partitioned layout's purge of the inbox and the outbox: whole partitions past the
//! window are dropped, each in a transaction of its own under the purge's lock timeout,
//! before the default partition is purged in batches like the plain table.

use std::ops::ControlFlow;

use time::OffsetDateTime;

use super::{Purger, TablePurge};
use crate::inbox::InboxError;
use crate::partition::sql;
use crate::retention::report::PurgedTable;

/// How one partitioned table's partitions are listed, dropped and, in a dry run, counted.
#[derive(Debug)]
pub(super) struct Partitioned {
    /// Its name in logs.
    name: &'static str,
    /// The partitions past a cutoff (`$1`).
    expired: &'static str,
    /// Drops one (`$1`) keeping what must be kept (cutoff `$2`).
    drop: &'static str,
    /// What a drop of the range `$2` to `$3` would take (cutoff `$1`).
    count: &'static str,
}

impl Partitioned {
    /// The partitioned table a purge target's partitions are dropped from, if it has any.
    pub(super) fn of(table: PurgedTable) -> Option<&'static Self> {
        const INBOX: Partitioned = Partitioned {
            name: "consumer_inbox",
            expired: sql::EXPIRED_PARTITIONS,
            drop: sql::DROP_PARTITION,
            count: crate::retention::sql::PARTITION_COUNT,
        };
        const OUTBOX: Partitioned = Partitioned {
            name: "message_outbox",
            expired: sql::EXPIRED_OUTBOX_PARTITIONS,
            drop: sql::DROP_OUTBOX_PARTITION,
            count: crate::retention::sql::OUTBOX_PARTITION_COUNT,
        };
        match table {
            PurgedTable::ConsumerInbox => Some(&INBOX),
            PurgedTable::MessageOutbox => Some(&OUTBOX),
            _ => None,
        }
    }
}

impl Purger {
    /// Creates the partitions ahead, of both tables (not in a dry run, nor when they are
    /// created elsewhere), then drops every partition of `table` whose whole range ends at
    /// or before `cutoff`, or in a dry run counts the rows each drop would take. Each dropped
    /// partition counts as one batch. `Break` when `observe` stopped it.
    pub(super) async fn drop_partitions(
        &self,
        table: &Partitioned,
        cutoff: OffsetDateTime,
        dry_run: bool,
        purged: &mut TablePurge,
        observe: &mut (dyn FnMut(&TablePurge) -> ControlFlow<()> + Send),
    ) -> Result<ControlFlow<()>, InboxError> {
        if let (false, Some(plan)) = (dry_run, self.partitions) {
            let mut tx = self.begin().await?;
            let created: i32 = sqlx::query_scalar(&self.schema.sql(sql::CREATE_PARTITIONS))
                .bind(plan.step().as_secs_f64())
                .bind(OffsetDateTime::now_utc())
                .bind(i32::try_from(plan.ahead()).unwrap_or(i32::MAX))
                .fetch_one(&mut tx)
                .await
                .map_err(InboxError::classify)?;
            tx.commit().await.map_err(InboxError::classify)?;
            if created > 0 {
                tracing::info!(created, "created partitions ahead");
            }
        }
        let expired: Vec<(String, OffsetDateTime, OffsetDateTime)> =
            sqlx::query_as(&self.schema.sql(table.expired))
                .bind(cutoff)
                .fetch_all(self.db())
                .await
                .map_err(InboxError::classify)?;
        for (partition, lower, upper) in expired {
            let rows = if dry_run {
                self.count_partition(table, cutoff, lower, upper).await?
            } else {
                let mut tx = self.begin().await?;
                let dropped: Option<(i64, i64)> = sqlx::query_as(&self.schema.sql(table.drop))
                    .bind(&partition)
                    .bind(cutoff)
                    .fetch_optional(&mut tx)
                    .await
                    .map_err(InboxError::classify)?;
                tx.commit().await.map_err(InboxError::classify)?;
                // None: another purger dropped it, or is dropping one right now.
                let Some((dropped, kept)) = dropped else {
                    continue;
                };
                tracing::info!(table = table.name, %partition, dropped, kept, "dropped a partition");
                let dropped = u64::try_from(dropped).unwrap_or(0);
                purged.table.count_purged(dropped);
                purged.batches += 1;
                dropped
            };
            purged.rows += rows;
            if observe(purged).is_break() {
                return Ok(ControlFlow::Break(()));
            }
        }
        Ok(ControlFlow::Continue(()))
    }

    /// The rows a drop of `table`'s partition from `lower` to `upper` would take.
    async fn count_partition(
        &self,
        table: &Partitioned,
        cutoff: OffsetDateTime,
        lower: OffsetDateTime,
        upper: OffsetDateTime,
    ) -> Result<u64, InboxError> {
        let mut tx = self.begin().await?;
        let rows: i64 = sqlx::query_scalar(&self.schema.sql(table.count))
            .bind(cutoff)
            .bind(lower)
            .bind(upper)
            .fetch_one(&mut tx)
            .await
            .map_err(InboxError::classify)?;
        tx.rollback().await.map_err(InboxError::classify)?;
        Ok(u64::try_from(rows).unwrap_or(0))
    }
}
