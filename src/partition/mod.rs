//! The partitioned layout: the inbox and the outbox partitioned by time, so the purge drops
//! a whole partition instead of deleting its rows in batches.
//!
//! Opt in with [`Layout::Partitioned`] on the [`Schema`] given to
//! [`migrate_schema`](crate::schema::migrate_schema), the layer (or
//! [`Inbox`](crate::inbox::Inbox), or the consumer), the [`Outbox`](crate::outbox::Outbox),
//! the [`Dispatcher`](crate::outbox::Dispatcher) and the
//! [`Purger`](crate::retention::Purger). `consumer_inbox` is then partitioned by range of
//! `received_at` and `message_outbox` by range of `created_at` (`migrations/partitioned/`),
//! each with a default partition as a safety net; the failure records and the quarantine
//! stay as they are.
//!
//! **What keeps one row per identity.** A unique key of a partitioned table must include the
//! partition column, so the primary key (now with `received_at`) no longer catches a
//! duplicate claimed at another time. Every claim already holds its key's advisory lock
//! until its transaction ends; with this layout the claim takes it in a statement of its
//! own, then inserts only if no committed row of the key exists in any partition. That
//! statement's snapshot is taken after the lock was granted, so it sees the row of any claim
//! that held the lock before (a claim releases it only after its commit is visible). This
//! holds under `READ COMMITTED` only: under `REPEATABLE READ` or `SERIALIZABLE` every
//! statement reads the transaction's first snapshot, taken before the lock, and a duplicate
//! committed in between would go unseen. So the layer, the consumer and the inbox **refuse
//! those isolation levels** with this layout ([`LayoutError::Isolation`]), and the first
//! claim refuses a database whose table has the other layout ([`LayoutError::Mismatch`]).
//!
//! **One row per effect** is kept the same way. The outbox's primary key is now
//! `(effect_id, created_at)`, so the enqueue cannot rely on `on conflict (effect_id)`: it
//! calls `outbox_enqueue`, which takes an advisory lock on the effect ID (a hash of the
//! schema and the ID, in the one-`bigint` key space, apart from the claim locks' two-`int4`
//! one) in a statement of its own, then inserts only if no row of the ID is in any
//! partition. A second enqueue of the ID waits for the first's transaction, then finds its
//! row (or, after a rollback, inserts). An enqueue may run in a transaction of the
//! caller's own ([`Outbox::enqueue`](crate::outbox::Outbox::enqueue) takes any executor),
//! so the function itself refuses `REPEATABLE READ` and `SERIALIZABLE`: the enqueue fails
//! with [`OutboxError::Database`](crate::outbox::OutboxError::Database), SQLSTATE `0A000`.
//!
//! **Lookups** by identity (the duplicate's read, the claim's check, the failure record's
//! guard, the operator's reads) and by effect ID (the enqueue's check; the dispatcher's
//! lease, start, delivery, retry and dead letter; the quarantine's repair; `outbox show`)
//! probe each partition's primary key: their cost grows with the number of partitions, so
//! keep them to tens (the window divided by the partition step, plus the ones created
//! ahead). The inbox's record step names the partition (`received_at = now()`, the claim's
//! own time), so it touches one; the dispatcher's updates do not carry `created_at` yet.
//!
//! **Partitions** of both tables are created ahead by the purger ([`PartitionPlan`], one
//! day, two ahead by default) or with [`PartitionPlan::create`]; a claim or an enqueue made
//! while none covers its time lands in the default partition, which the next creation
//! empties into the new partition. The purge drops a partition whose whole range is past
//! its table's window, after moving into the default partition the rows it must keep: for
//! the inbox, those the batched purge keeps (in flight, processed within the window, a
//! migration step, an open quarantine item's); for the outbox, every effect not delivered
//! before the cutoff (pending, dead and not discarded before it) and every one delivered
//! after it. The default partitions are then purged in batches like the plain tables. With
//! pg_partman instead, let it create the partitions of `consumer_inbox` (`received_at`) and
//! `message_outbox` (`created_at`) and build the purger with
//! [`partitions_created_elsewhere`](crate::retention::PurgerBuilder::partitions_created_elsewhere):
//! the purger's drops keep what must be kept; see `docs/scaling.md`.

pub(crate) mod sql;

use std::time::Duration;

use sqlx::PgPool;
use time::OffsetDateTime;

use crate::inbox::InboxError;
use crate::schema::Schema;

pub use crate::inbox::LayoutError;
pub use crate::schema::Layout;

/// Which partitions to keep ahead of time: ranges of `step`, aligned to multiples of it
/// since the Unix epoch (UTC), from the one holding now to `ahead` more.
///
/// ```
/// use std::time::Duration;
/// use tower_inbox::partition::PartitionPlan;
///
/// let plan = PartitionPlan::new(Duration::from_secs(6 * 3600), 4)?; // six hours, a day ahead
/// assert_eq!(plan.step(), Duration::from_secs(6 * 3600));
/// assert!(PartitionPlan::new(Duration::from_secs(1), 4).is_err());
/// # Ok::<(), tower_inbox::partition::PlanError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartitionPlan {
    step: Duration,
    ahead: u32,
}

/// A [`PartitionPlan`] refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a partition step must be a whole number of minutes, 1 minute to 366 days, and at most 1000 partitions ahead")]
pub struct PlanError;

impl Default for PartitionPlan {
    /// A partition a day, two days ahead.
    fn default() -> Self {
        Self {
            step: Duration::from_secs(24 * 3600),
            ahead: 2,
        }
    }
}

impl PartitionPlan {
    /// Partitions of `step` (whole minutes, one minute to 366 days), `ahead` of the current
    /// one (at most 1000).
    pub fn new(step: Duration, ahead: u32) -> Result<Self, PlanError> {
        let minutes_only = step.subsec_nanos() == 0 && step.as_secs().is_multiple_of(60);
        if !minutes_only || step.as_secs() == 0 || step.as_secs() > 366 * 24 * 3600 || ahead > 1000
        {
            return Err(PlanError);
        }
        Ok(Self { step, ahead })
    }

    /// Each partition's range.
    pub fn step(&self) -> Duration {
        self.step
    }

    /// How many partitions past the current one are kept created.
    pub fn ahead(&self) -> u32 {
        self.ahead
    }

    /// Creates the missing partitions of this plan in `schema` (partitioned layout), of the
    /// inbox and of the outbox, as the tables' owner through `inbox_create_partitions` and
    /// `outbox_create_partitions` (the role needs
    /// [`Access::ServiceAndPurge`](crate::schema::Access)); how many it created, of both.
    /// None are created while another session is creating or dropping partitions: it is
    /// doing this.
    pub async fn create(&self, pool: &PgPool, schema: &Schema) -> Result<u32, InboxError> {
        self.create_since(pool, schema, None).await
    }

    /// As [`create`](Self::create), also creating the partitions from the one holding
    /// `since` on, for rows to be loaded with past times (at most 10 000 partitions at
    /// once).
    pub async fn create_since(
        &self,
        pool: &PgPool,
        schema: &Schema,
        since: Option<OffsetDateTime>,
    ) -> Result<u32, InboxError> {
        let created: i32 = sqlx::query_scalar(&schema.sql(sql::CREATE_PARTITIONS))
            .bind(self.step.as_secs_f64())
            .bind(since.unwrap_or_else(OffsetDateTime::now_utc))
            .bind(i32::try_from(self.ahead).unwrap_or(i32::MAX))
            .fetch_one(pool)
            .await
            .map_err(InboxError::classify)?;
        Ok(u32::try_from(created).unwrap_or(0))
    }
}
