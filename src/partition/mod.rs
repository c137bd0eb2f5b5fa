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
//! after it. The default partitions are then purged in batches like the plain tables.
//! [`list`] reads the inbox's partitions, [`InboxPartition::drop_preview`] what a drop would
//! take, and [`Layout::detect`] the layout a schema has in the database (the command line's
//! `status` and `purge` use them).
//!
//! **pg_partman** (tested with 4.7.2, `tests/partman.rs`) can create the partitions
//! instead, of the inbox by `received_at` and of the outbox's `message_outbox` by
//! `created_at`, the same way.
//! On the new, empty inbox, as its owner: drop the migration's default partition
//! (pg_partman 4.x creates `consumer_inbox_default` itself and fails if it exists), create a
//! template with `fillfactor = 80`, then
//! `partman.create_parent('<schema>.consumer_inbox', 'received_at', 'native', 'daily',
//! p_premake := 2, p_template_table := '<the template>')`, set `infinite_time_partitions =
//! true` and leave `retention` null in `partman.part_config`, run
//! `partman.run_maintenance`, and grant the roles after it (the default partition is a new
//! table). Build the purger with
//! [`partitions_created_elsewhere`](crate::retention::PurgerBuilder::partitions_created_elsewhere):
//! its drops keep what must be kept (claims in flight, rows processed within the window,
//! migration steps, open quarantine items' rows), which pg_partman's own retention would drop
//! with their partition; so that stays off. The exact statements are in `docs/scaling.md`.

pub(crate) mod sql;

use std::time::Duration;

use sqlx::PgPool;
use time::OffsetDateTime;

use crate::connection::Guarded;
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
    /// doing this. Both tables get this plan's step: give every purger of one schema the
    /// same plan, or ranges of different steps leave gaps their rows fill the default
    /// partitions with.
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

impl Layout {
    /// The layout `schema`'s `consumer_inbox` has in the database, whatever `schema` says
    /// (`None` when the schema has no such table): an operator's tool builds its [`Schema`]
    /// with it instead of asking.
    ///
    /// ```no_run
    /// use tower_inbox::schema::{Layout, Schema};
    ///
    /// # async fn run(pool: sqlx::PgPool) -> Result<(), tower_inbox::inbox::InboxError> {
    /// let schema = Schema::default();
    /// let layout = Layout::detect(&pool, &schema).await?.unwrap_or_default();
    /// let schema = schema.with_layout(layout);
    /// # Ok(()) }
    /// ```
    pub async fn detect(pool: &PgPool, schema: &Schema) -> Result<Option<Self>, InboxError> {
        let relkind: Option<String> = sqlx::query_scalar(crate::inbox::sql::RELKIND)
            .bind(schema.name())
            .fetch_optional(Guarded::for_schema(pool, schema))
            .await
            .map_err(InboxError::classify)?;
        Ok(relkind.map(|kind| Self::of_relkind(&kind)))
    }

    /// The layout of a `consumer_inbox` of `pg_class.relkind` `kind`: `p` is partitioned.
    pub(crate) fn of_relkind(kind: &str) -> Self {
        if kind == "p" {
            Self::Partitioned
        } else {
            Self::Plain
        }
    }
}

/// One range partition of the inbox: its table's name and the times it takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InboxPartition {
    /// The partition's table, in the inbox's schema.
    pub name: String,
    /// The first `received_at` it takes.
    pub from: OffsetDateTime,
    /// The first `received_at` past it: the purge drops it once this is at or before its
    /// cutoff.
    pub to: OffsetDateTime,
}

/// What the purge's drop of one partition would do at a cutoff
/// ([`InboxPartition::drop_preview`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DropPreview {
    /// The rows dropped with it (what the batched purge would delete).
    pub dropped: u64,
    /// The rows it keeps (in flight, processed after the cutoff, a migration step, or an
    /// open quarantine item's): moved into the default partition before the drop.
    pub kept: u64,
}

/// The inbox's range partitions in `schema` (partitioned layout), oldest first; the default
/// partition is not one. Read from the catalog: any role that can connect may list them,
/// whoever created them (the purger, [`PartitionPlan::create`], or pg_partman).
pub async fn list(pool: &PgPool, schema: &Schema) -> Result<Vec<InboxPartition>, InboxError> {
    // The bounds are printed by pg_get_expr and read back in the session's DateStyle and
    // TimeZone, which a pool's connections may have changed: ISO output carries the offset,
    // so the value read back is the bound whatever the time zone.
    let mut tx = Guarded::for_schema(pool, schema)
        .begin("BEGIN")
        .await
        .map_err(InboxError::classify)?;
    sqlx::query(sql::ISO_DATESTYLE)
        .execute(&mut tx)
        .await
        .map_err(InboxError::classify)?;
    let rows: Vec<(String, OffsetDateTime, OffsetDateTime)> = sqlx::query_as(sql::LIST_PARTITIONS)
        .bind(schema.name())
        .fetch_all(&mut tx)
        .await
        .map_err(InboxError::classify)?;
    tx.rollback().await.map_err(InboxError::classify)?;
    Ok(rows
        .into_iter()
        .map(|(name, from, to)| InboxPartition { name, from, to })
        .collect())
}

impl InboxPartition {
    /// Whether the purge with this `cutoff` drops it: its whole range ends at or before it.
    pub fn expired_at(&self, cutoff: OffsetDateTime) -> bool {
        self.to <= cutoff
    }
}
