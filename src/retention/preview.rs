//! What the purge's drop of a partition would take, for a dry run to show per partition
//! (here, beside the purge's statements, rather than in `partition`, which the purge
//! imports).

use sqlx::PgPool;
use time::OffsetDateTime;

use crate::connection::Guarded;
use crate::inbox::InboxError;
use crate::partition::sql as partition_sql;
use crate::partition::{DropPreview, InboxPartition};
use crate::schema::Schema;

impl InboxPartition {
    /// Counts what the purge's drop of this partition would take and keep at `cutoff` (the
    /// [`TablePurge::cutoff`](crate::retention::TablePurge::cutoff) of a dry run), reading
    /// its rows through the inbox (the role needs SELECT on it); changes nothing.
    pub async fn drop_preview(
        &self,
        pool: &PgPool,
        schema: &Schema,
        cutoff: OffsetDateTime,
    ) -> Result<DropPreview, InboxError> {
        let dropped: i64 = sqlx::query_scalar(&schema.sql(super::sql::PARTITION_COUNT))
            .bind(cutoff)
            .bind(self.from)
            .bind(self.to)
            .fetch_one(Guarded::for_schema(pool, schema))
            .await
            .map_err(InboxError::classify)?;
        let total: i64 = sqlx::query_scalar(&schema.sql(partition_sql::RANGE_COUNT))
            .bind(self.from)
            .bind(self.to)
            .fetch_one(Guarded::for_schema(pool, schema))
            .await
            .map_err(InboxError::classify)?;
        let count = |n: i64| u64::try_from(n).unwrap_or(0);
        Ok(DropPreview {
            dropped: count(dropped),
            kept: count(total - dropped),
        })
    }
}
