//! The partitioned layout's own statements, next to `migrations/partitioned/` (the
//! functions they call). The layout's variants of the protocol's statements are next to
//! theirs (`src/inbox/sql.rs`, `src/outbox/sql.rs`, `src/retention/sql.rs`).

/// Creates the missing partitions of the inbox and the outbox, of `$1` seconds from the one
/// holding `$2` (or now) to `$3` steps ahead, as the tables' owner; how many it created.
/// One transaction: the maintainer's lock, taken by the first, is the second's too.
pub(crate) const CREATE_PARTITIONS: &str = "\
select tower_inbox.inbox_create_partitions(pg_catalog.make_interval(secs => $1), $2, $3) \
     + tower_inbox.outbox_create_partitions(pg_catalog.make_interval(secs => $1), $2, $3)";

/// The statements that list and drop a partitioned table's partitions: the functions
/// `<prefix>_partitions` and `<prefix>_drop_partition`, the same for both tables.
macro_rules! maintenance {
    ($expired:ident, $drop:ident, $prefix:literal) => {
        /// The range partitions whose whole range ends at or before `$1`, oldest first:
        /// name, start and end (the drop function reads the same list).
        pub(crate) const $expired: &str = concat!(
            "select name, lower_bound, upper_bound from tower_inbox.",
            $prefix,
            "_partitions() where upper_bound <= $1 order by upper_bound"
        );

        /// Drops partition `$1` if its whole range ends at or before `$2`, keeping what must
        /// be kept; the rows dropped and kept, or no row if it was not dropped.
        pub(crate) const $drop: &str = concat!(
            "select dropped, kept from tower_inbox.",
            $prefix,
            "_drop_partition($1, $2)"
        );
    };
}

maintenance!(EXPIRED_PARTITIONS, DROP_PARTITION, "inbox");
maintenance!(EXPIRED_OUTBOX_PARTITIONS, DROP_OUTBOX_PARTITION, "outbox");
