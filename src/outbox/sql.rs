//! The outbox statements, next to `migrations/20261204000002_outbox_quarantine.sql`.

use crate::sql::utf8;

/// Writes an effect unless its ID is there already. The identity's names (`$3` to `$5`) are
/// bound as UTF-8 bytes, like the inbox's; null for an effect without a message identity.
pub(crate) const ENQUEUE: &str = concat!(
    "insert into tower_inbox.message_outbox \
         (effect_id, effect_name, consumer_name, producer_name, tenant_id, message_id, \
          destination, payload, header_names, header_values) \
     values ($1, $2, ",
    utf8!("$3"),
    ", ",
    utf8!("$4"),
    ", ",
    utf8!("$5"),
    ", $6, $7, $8, $9, $10) \
     on conflict (effect_id) do nothing"
);

/// [`ENQUEUE`] for the partitioned layout: its primary key includes `created_at`, so
/// `on conflict (effect_id)` has no unique index to meet. `outbox_enqueue`
/// (`migrations/partitioned/`) takes the effect ID's advisory lock in a statement of its own,
/// then inserts only if no row of the ID is in any partition, with a snapshot taken after
/// the lock; it refuses isolation levels above `READ COMMITTED`. One statement from here,
/// so it runs on any executor, a pool included. Returns whether it inserted.
pub(crate) const ENQUEUE_PARTITIONED: &str = concat!(
    "select tower_inbox.outbox_enqueue($1, $2, ",
    utf8!("$3"),
    ", ",
    utf8!("$4"),
    ", ",
    utf8!("$5"),
    ", $6, $7, $8, $9, $10)"
);

/// Leases up to `$1` due rows for `$2` for `$3` seconds in one short statement. The lease
/// deadline is also the next attempt time, so a lease left by a dead dispatcher simply makes
/// the row due again when it expires. No attempt is counted yet: [`START`] counts each one
/// when its delivery really begins.
pub(crate) const LEASE: &str = "\
with due as ( \
    select effect_id from tower_inbox.message_outbox \
    where status = 'pending' and next_attempt_at <= pg_catalog.now() \
    order by next_attempt_at \
    limit $1 \
    for update skip locked \
) \
update tower_inbox.message_outbox o \
set lease_owner = $2, lease_until = pg_catalog.now() + pg_catalog.make_interval(secs => $3), \
    next_attempt_at = pg_catalog.now() + pg_catalog.make_interval(secs => $3) \
from due where o.effect_id = due.effect_id \
returning o.effect_id, o.effect_name, o.destination, o.payload, o.header_names, \
          o.header_values, o.attempts";

/// Begins one attempt of effect `$1` leased by `$2`, right before its send: renews the lease
/// for `$3` seconds from now (a batch's later sends start long after the batch was leased)
/// and counts the attempt. No row means another dispatcher took the effect after this lease
/// ran out: the send must not happen.
pub(crate) const START: &str = "\
update tower_inbox.message_outbox \
set lease_until = pg_catalog.now() + pg_catalog.make_interval(secs => $3), \
    next_attempt_at = pg_catalog.now() + pg_catalog.make_interval(secs => $3), attempts = attempts + 1 \
where effect_id = $1 and lease_owner = $2 and status = 'pending' \
returning attempts";

/// Records a delivery, if the lease is still ours, and marks a repaired quarantine item
/// (key `$5`) recovered in the same statement.
pub(crate) const DELIVERED: &str = "\
with done as ( \
    update tower_inbox.message_outbox \
    set status = 'delivered', delivered_at = pg_catalog.now(), remote_status = $3, remote_result = $4, \
        last_error = null, lease_owner = null, lease_until = null \
    where effect_id = $1 and lease_owner = $2 and status = 'pending' \
    returning effect_id \
), recovered as ( \
    update tower_inbox.inbox_quarantine q set recovered_at = pg_catalog.now() \
    from done \
    where q.item_key = $5 and q.decision = 'repair' and q.recovered_at is null \
    returning q.id \
) \
select (select pg_catalog.count(*) from done) as delivered, (select pg_catalog.count(*) from recovered) as recovered";

pub(crate) const RETRY: &str = "\
update tower_inbox.message_outbox \
set next_attempt_at = pg_catalog.now() + pg_catalog.make_interval(secs => $3), last_error = $4, remote_status = $5, \
    lease_owner = null, lease_until = null \
where effect_id = $1 and lease_owner = $2 and status = 'pending'";

/// Moves an effect to dead letters and opens (or counts) its quarantine item, atomically.
/// Returns the item and whether this statement opened it.
pub(crate) const DEAD: &str = "\
with dead as ( \
    update tower_inbox.message_outbox \
    set status = 'dead', last_error = $3, remote_status = $4, lease_owner = null, lease_until = null \
    where effect_id = $1 and lease_owner = $2 and status = 'pending' \
    returning * \
) \
insert into tower_inbox.inbox_quarantine as q \
    (source, item_key, consumer_name, producer_name, tenant_id, message_id, effect_id, \
     payload_sha256, payload_ref, reason_code, attempts) \
select 'dead-effect', $5, consumer_name, producer_name, tenant_id, message_id, effect_id, \
       pg_catalog.encode(pg_catalog.sha256(payload), 'hex'), 'message_outbox:' || effect_id, $6, attempts \
from dead \
on conflict (item_key) where decision is null do update \
set attempts = excluded.attempts, last_failed_at = pg_catalog.now(), reason_code = excluded.reason_code \
returning q.id, (q.xmax = 0) as opened";

/// Gives back leases a stopping dispatcher did not start on; they were not attempted.
pub(crate) const RELEASE: &str = "\
update tower_inbox.message_outbox \
set next_attempt_at = pg_catalog.now(), lease_owner = null, lease_until = null \
where effect_id = $1 and lease_owner = $2 and status = 'pending'";

/// The columns of an [`OutboxEntry`](super::OutboxEntry): everything but the payload and
/// headers, which an operator's listing has no use for and which may be large.
macro_rules! entry {
    () => {
        "select o.effect_id, o.effect_name, o.status, o.attempts, o.last_error, \
                o.remote_status, o.remote_result, o.created_at, o.delivered_at, o.destination, \
                o.consumer_name, o.producer_name, o.tenant_id, o.message_id, \
                o.next_attempt_at, o.lease_owner, o.lease_until \
         from tower_inbox.message_outbox o "
    };
}

/// Seconds until the next pending row is due (negative when overdue), or null.
pub(crate) const NEXT_DUE: &str = "\
select extract(epoch from (pg_catalog.min(next_attempt_at) - pg_catalog.now()))::float8 \
from tower_inbox.message_outbox where status = 'pending'";

/// One effect's row.
pub(crate) const ENTRY: &str = concat!(entry!(), "where o.effect_id = $1");

/// Pending effects (`$1` an effect name or null for all), next due first, at most `$2`:
/// through the partial index of pending rows.
pub(crate) const LIST_PENDING: &str = concat!(
    entry!(),
    "where o.status = 'pending' and ($1::text is null or o.effect_name = $1) \
     order by o.next_attempt_at, o.effect_id limit $2"
);

/// Dead effects, oldest first, at most `$2`. Dead rows have no index of their own: this
/// reads the table (dead effects are rare; the purge keeps the table to its window).
pub(crate) const LIST_DEAD: &str = concat!(
    entry!(),
    "where o.status = 'dead' and ($1::text is null or o.effect_name = $1) \
     order by o.created_at, o.effect_id limit $2"
);

/// Every effect, newest first, at most `$2`.
pub(crate) const LIST_ALL: &str = concat!(
    entry!(),
    "where ($1::text is null or o.effect_name = $1) \
     order by o.created_at desc, o.effect_id limit $2"
);

/// The effects written by one message (`$1` to `$4`, bound by `bind_identity!`). No index
/// leads with the identity: this reads the table, which is fine for an operator's look at
/// one key and not for a hot path.
pub(crate) const FOR_MESSAGE: &str = concat!(
    entry!(),
    "where ",
    crate::sql::key_is!("o"),
    " order by o.created_at, o.effect_id"
);
