//! The partitioned layout's inbox purge: whole partitions past the window are dropped, each
//! in a transaction of its own under the purge's lock timeout, before the default partition
//! is purged in batches like the plain inbox.

use std::ops::ControlFlow;

use time::OffsetDateTime;

use super::{Purger, TablePurge};
use crate::inbox::InboxError;
use crate::partition::sql;

impl Purger {
    /// Creates the partitions ahead (not in a dry run, nor when they are created elsewhere),
    /// then drops every inbox partition whose whole range ends at or before `cutoff`, or in a
    /// dry run counts the rows each drop would take. Each dropped partition counts as one
    /// batch. `Break` when `observe` stopped it.
    pub(super) async fn drop_partitions(
        &self,
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
                tracing::info!(created, "created inbox partitions ahead");
            }
        }
        let expired: Vec<(String, OffsetDateTime, OffsetDateTime)> =
            sqlx::query_as(&self.schema.sql(sql::EXPIRED_PARTITIONS))
                .bind(cutoff)
                .fetch_all(self.db())
                .await
                .map_err(InboxError::classify)?;
        for (partition, lower, upper) in expired {
            let rows = if dry_run {
                self.count_partition(cutoff, lower, upper).await?
            } else {
                let mut tx = self.begin().await?;
                let dropped: Option<(i64, i64)> =
                    sqlx::query_as(&self.schema.sql(sql::DROP_PARTITION))
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
                tracing::info!(%partition, dropped, kept, "dropped an inbox partition");
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

    /// The rows a drop of the partition from `lower` to `upper` would take.
    async fn count_partition(
        &self,
        cutoff: OffsetDateTime,
        lower: OffsetDateTime,
        upper: OffsetDateTime,
    ) -> Result<u64, InboxError> {
        let mut tx = self.begin().await?;
        let rows: i64 = sqlx::query_scalar(&self.schema.sql(super::sql::PARTITION_COUNT))
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
