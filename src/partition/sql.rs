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

/// The inbox's range partitions in schema `$1`, oldest first: name, start and end, read
/// from the catalog (as `inbox_partitions` does, but needing no EXECUTE grant: the
/// operator's reads run as any role). The default partition has no bounds and is left out.
pub(crate) const LIST_PARTITIONS: &str = r"
select name, lower_bound, upper_bound from (
    select c.relname::text as name,
           pg_catalog.substring(pg_catalog.pg_get_expr(c.relpartbound, c.oid),
                                'FROM \(''([^'']*)''\)')::timestamptz as lower_bound,
           pg_catalog.substring(pg_catalog.pg_get_expr(c.relpartbound, c.oid),
                                'TO \(''([^'']*)''\)')::timestamptz as upper_bound
    from pg_catalog.pg_inherits h
    join pg_catalog.pg_class c on c.oid = h.inhrelid
    join pg_catalog.pg_class p on p.oid = h.inhparent
    join pg_catalog.pg_namespace n on n.oid = p.relnamespace
    where n.nspname = $1 and p.relname = 'consumer_inbox'
) b
where lower_bound is not null and upper_bound is not null
order by lower_bound";

/// For [`LIST_PARTITIONS`], in its own transaction: the bounds read back as printed.
pub(crate) const ISO_DATESTYLE: &str = "set local datestyle to 'ISO, YMD'";

/// The rows the inbox holds from `$1` to `$2` (one partition's range).
pub(crate) const RANGE_COUNT: &str = "\
select pg_catalog.count(*) from tower_inbox.consumer_inbox i \
where i.received_at >= $1 and i.received_at < $2";
