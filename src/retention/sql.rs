//! The retention statements, next to `migrations/20261204000003_retention.sql` (the purge's
//! indexes).
//!
//! Each purgeable set is written once, as a `from ... where ...` fragment over `$1` (the
//! cutoff), and both its dry-run count and its batch delete are built from that fragment:
//! a dry run counts exactly the rows the purge would delete.

/// The cutoff of a window of `$1` seconds, on the database's clock (the one that wrote
/// `received_at`, `delivered_at` and `decided_at`).
pub(crate) const CUTOFF: &str = "select pg_catalog.now() - pg_catalog.make_interval(secs => $1)";

/// Bounds every lock wait of the batch's transaction, so a purge never queues behind (and
/// holds up claims behind) a lock it cannot get soon.
pub(crate) const LOCK_TIMEOUT: &str = "select pg_catalog.set_config('lock_timeout', $1, true)";

/// No open quarantine item refers to the command of row `i` (any source: a conflict, a
/// failing command, a dead effect of it). Deleting that row would drop what the item is
/// about while a person still has to decide on it.
macro_rules! no_open_item {
    () => {
        "not exists ( \
             select 1 from tower_inbox.inbox_quarantine q \
             where q.decision is null and q.consumer_name = i.consumer_name \
               and q.producer_name = i.producer_name and q.tenant_id = i.tenant_id \
               and q.message_id = i.message_id)"
    };
}

/// Processed inbox rows past the cutoff that no open quarantine item refers to. In-flight
/// rows (`processed_at is null`) never match. `received_at` drives the index scan;
/// `processed_at` is only filtered, never indexed, so recording stays a HOT update.
///
/// The steps of a [compensated migration](crate::replay::CompensatedMigration) (producer
/// `migration:<name>`, [`MIGRATION_PRODUCER_PREFIX`](crate::replay::MIGRATION_PRODUCER_PREFIX))
/// are never purged: running a finished migration again must apply nothing, however long
/// after.
macro_rules! inbox_expired {
    () => {
        inbox_expired!("consumer_inbox")
    };
    ($table:literal) => {
        concat!(
            "from tower_inbox.",
            $table,
            " i \
             where i.received_at < $1 and i.processed_at < $1 \
               and i.producer_name not like 'migration:%' and ",
            no_open_item!()
        )
    };
}

/// The failing command of failure record `i` has no item decided `repair` and not yet
/// recovered. Its recovery is the commit of a retry, which sends it only when its claim finds
/// the failure record: deleting the record would leave the item awaiting a recovery that can
/// never come (and kept by the quarantine purge for ever). The item is found by its key, as
/// `quarantine::identity_item_key` writes it, through `inbox_quarantine_unrecovered`.
macro_rules! no_repair_awaiting_recovery {
    () => {
        "not exists ( \
             select 1 from tower_inbox.inbox_quarantine q \
             where q.item_key = 'handler-failure:' || i.consumer_name \
                   || pg_catalog.chr(31) || i.producer_name || pg_catalog.chr(31) \
                   || i.tenant_id || pg_catalog.chr(31) || i.message_id \
               and q.recovered_at is null and q.decision = 'repair')"
    };
}

/// Failure records whose last failure is past the cutoff, unless an open quarantine item
/// refers to the same command, or its failure item was repaired and awaits the retry that
/// recovers it.
macro_rules! failures_expired {
    () => {
        concat!(
            "from tower_inbox.consumer_inbox_failure i where i.last_failed_at < $1 and ",
            no_open_item!(),
            " and ",
            no_repair_awaiting_recovery!()
        )
    };
}

/// Effects delivered before the cutoff (in `$table`, the outbox unless named).
macro_rules! delivered_expired {
    () => {
        delivered_expired!("message_outbox")
    };
    ($table:literal) => {
        concat!(
            "from tower_inbox.",
            $table,
            " o \
             where o.status = 'delivered' and o.delivered_at < $1"
        )
    };
}

/// Dead effects whose quarantine item was discarded before the cutoff, and that have no
/// open item (a dead effect reopened since); in `$table`, the outbox unless named.
macro_rules! discarded_expired {
    () => {
        discarded_expired!("message_outbox")
    };
    ($table:literal) => {
        concat!(
            "from tower_inbox.",
            $table,
            " o \
             where o.status = 'dead' \
               and exists ( \
                   select 1 from tower_inbox.inbox_quarantine q \
                   where q.effect_id = o.effect_id and q.source = 'dead-effect' \
                     and q.decision = 'discard' and q.decided_at < $1) \
               and not exists ( \
                   select 1 from tower_inbox.inbox_quarantine q \
                   where q.effect_id = o.effect_id and q.decision is null)"
        )
    };
}

/// Decided quarantine items whose decision (and recovery, if any) is past the cutoff. Kept
/// regardless of age:
/// * a failing command decided `repair` and not recovered: its recovery (a retry that
///   commits) is still expected, and an operator must be able to see that it never came;
/// * an item about an effect still in the outbox and not delivered: a repaired effect
///   awaiting delivery (its recovery), or a dead one whose discard decision is the reason
///   the outbox purge may delete it.
macro_rules! decided_expired {
    () => {
        "from tower_inbox.inbox_quarantine q \
         where q.decision is not null and q.decided_at < $1 \
           and coalesce(q.recovered_at, q.decided_at) < $1 \
           and not (q.source = 'handler-failure' and q.decision = 'repair' \
                    and q.recovered_at is null) \
           and not (q.source = 'dead-effect' and exists ( \
               select 1 from tower_inbox.message_outbox o \
               where o.effect_id = q.effect_id and o.status <> 'delivered'))"
    };
}

/// Declares the dry-run count and the batch delete of one purgeable set. The delete takes up
/// to `$2` rows of the set, oldest first, and skips rows another transaction has locked
/// (another purger, an operator's update): it never waits on a row lock.
///
/// The rows are deleted by the physical address (`ctid`) the locking scan found them at,
/// a TID scan, rather than looked up again by key: that saves a primary key descent per row
/// (614 rather than 1 414 buffers for a batch of 200 inbox rows at 1M rows). It is exact:
/// the statement's snapshot keeps vacuum from reclaiming, and so reusing, the address of
/// any row it can see; the row lock keeps every other writer off the row until the batch
/// commits; and a row updated since the snapshot has a new address the delete cannot
/// see, so it is left for the next run (a short batch), never deleted unchecked. An
/// address is unique only within one table: the delete also requires the row to be in the
/// table itself (`tableoid`), so on a partitioned table, whose rows live in its partitions,
/// it deletes nothing rather than a row of another partition at the same address (drop
/// old partitions instead: see the module docs on partitioning). A claim takes no
/// row lock on a row it conflicts with, so a purge may delete a row a duplicate has just
/// met; the claim then finds it gone and claims it as new. That is only possible for rows
/// past the window, which is what the window is for.
macro_rules! purgeable {
    (
        $count:ident, $delete:ident: $table:literal as $alias:literal,
        rows $set:ident, oldest $order:literal
    ) => {
        pub(crate) const $count: &str = concat!("select pg_catalog.count(*) ", $set!());
        pub(crate) const $delete: &str = concat!(
            "delete from tower_inbox.",
            $table,
            " where ctid = any(array(select ",
            $alias,
            ".ctid ",
            $set!(),
            " order by ",
            $order,
            " limit $2 for update of ",
            $alias,
            " skip locked)) and tableoid = 'tower_inbox.",
            $table,
            "'::regclass"
        );
    };
}

purgeable!(
    INBOX_COUNT, INBOX_DELETE: "consumer_inbox" as "i",
    rows inbox_expired, oldest "received_at"
);
/// The partitioned layout's rows in its default partition that the purge deletes in
/// batches (what a partition drop kept, and claims made while no partition covered their
/// time): [`INBOX_COUNT`] and [`INBOX_DELETE`] on that partition. The other partitions are
/// dropped whole (`src/retention/purge/partitions.rs`).
macro_rules! default_partition_expired {
    () => {
        inbox_expired!("consumer_inbox_default")
    };
}
purgeable!(
    DEFAULT_INBOX_COUNT, DEFAULT_INBOX_DELETE: "consumer_inbox_default" as "i",
    rows default_partition_expired, oldest "received_at"
);

/// The rows of one partition (`$2` to `$3`) a drop would take: [`INBOX_COUNT`] within its
/// range, for the dry run.
pub(crate) const PARTITION_COUNT: &str = concat!(
    "select pg_catalog.count(*) ",
    inbox_expired!(),
    " and i.received_at >= $2 and i.received_at < $3"
);

purgeable!(
    FAILURES_COUNT, FAILURES_DELETE: "consumer_inbox_failure" as "i",
    rows failures_expired, oldest "last_failed_at"
);
purgeable!(
    DELIVERED_COUNT, DELIVERED_DELETE: "message_outbox" as "o",
    rows delivered_expired, oldest "delivered_at"
);
// Dead rows have no death time; they are few, any order will do.
purgeable!(
    DISCARDED_COUNT, DISCARDED_DELETE: "message_outbox" as "o",
    rows discarded_expired, oldest "effect_id"
);
/// The partitioned layout's rows in the outbox's default partition that the purge deletes
/// in batches (what a partition drop kept, and effects enqueued while no partition covered
/// their time): the two sets above on that partition. The other partitions are dropped whole.
macro_rules! default_partition_delivered {
    () => {
        delivered_expired!("message_outbox_default")
    };
}
macro_rules! default_partition_discarded {
    () => {
        discarded_expired!("message_outbox_default")
    };
}
purgeable!(
    DEFAULT_DELIVERED_COUNT, DEFAULT_DELIVERED_DELETE: "message_outbox_default" as "o",
    rows default_partition_delivered, oldest "delivered_at"
);
purgeable!(
    DEFAULT_DISCARDED_COUNT, DEFAULT_DISCARDED_DELETE: "message_outbox_default" as "o",
    rows default_partition_discarded, oldest "effect_id"
);

/// The rows of one outbox partition (`$2` to `$3`) a drop would take: both sets, which no
/// row is in twice (one is delivered, the other dead), within its range, for the dry run.
pub(crate) const OUTBOX_PARTITION_COUNT: &str = concat!(
    "select (select pg_catalog.count(*) ",
    delivered_expired!(),
    " and o.created_at >= $2 and o.created_at < $3) \
          + (select pg_catalog.count(*) ",
    discarded_expired!(),
    " and o.created_at >= $2 and o.created_at < $3)"
);

purgeable!(
    DECIDED_COUNT, DECIDED_DELETE: "inbox_quarantine" as "q",
    rows decided_expired, oldest "decided_at"
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn migration_steps_are_never_purged() {
        let kept = format!(
            "producer_name not like '{}%'",
            crate::identity::RESERVED_PRODUCER_PREFIX
        );
        assert!(INBOX_COUNT.contains(&kept) && INBOX_DELETE.contains(&kept));
    }

    #[test]
    fn failure_records_awaiting_recovery_are_found_by_their_item_key() {
        use crate::quarantine::{identity_item_key, QuarantineSource};
        use crate::{MessageIdentity, MessageKey, Producer};
        // The purge writes the failure item's key in SQL from the record's columns: it must
        // be the key the inbox gives the item.
        let identity = MessageIdentity::new(
            "c",
            Producer::new("p").unwrap(),
            MessageKey::new("m").unwrap(),
        );
        let key = identity_item_key(QuarantineSource::HandlerFailure, &identity, "");
        assert_eq!(key, "handler-failure:c\u{1f}p\u{1f}\u{1f}m");
        let in_sql = "q.item_key = 'handler-failure:' || i.consumer_name || pg_catalog.chr(31) \
                      || i.producer_name || pg_catalog.chr(31) || i.tenant_id \
                      || pg_catalog.chr(31) || i.message_id";
        assert!(FAILURES_COUNT.contains(in_sql) && FAILURES_DELETE.contains(in_sql));
    }
}
