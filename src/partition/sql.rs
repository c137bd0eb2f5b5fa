//! The partitioned layout's own statements, next to `migrations/partitioned/` (the
//! functions they call). The layout's variants of the protocol's statements are next to
//! theirs (`src/inbox/sql.rs`, `src/retention/sql.rs`).

/// Creates the missing partitions of `$1` seconds from the one holding `$2` (or now) to
/// `$3` steps ahead, as the tables' owner; how many it created.
pub(crate) const CREATE_PARTITIONS: &str = "\
select tower_inbox.inbox_create_partitions(pg_catalog.make_interval(secs => $1), $2, $3)";

/// The inbox's range partitions whose whole range ends at or before `$1`, oldest first:
/// name, start and end (`inbox_partitions`, which `inbox_drop_partition` reads too).
pub(crate) const EXPIRED_PARTITIONS: &str = "\
select name, lower_bound, upper_bound from tower_inbox.inbox_partitions() \
where upper_bound <= $1 order by upper_bound";

/// Drops partition `$1` if its whole range ends at or before `$2`, keeping what must be
/// kept; the rows dropped and kept, or no row if it was not dropped.
pub(crate) const DROP_PARTITION: &str =
    "select dropped, kept from tower_inbox.inbox_drop_partition($1, $2)";
