//! The statements the protocol core sends, next to the tables they rely on
//! (`migrations/20261204000001_inbox.sql`, `…02_outbox_quarantine.sql`).
//! (Over 400 lines: every statement of the protocol, and the partitioned layout's variants
//! next to the plain ones they replace.)
//!
//! Every value is a bound parameter, so no value is ever part of the statement's text: the
//! server's log shows the text of a failing statement, never what a client sent, and no
//! session setting (`standard_conforming_strings`, `backslash_quote`) changes what a value
//! means. Text that may hold non-ASCII characters (names, versions, quarantine keys) is bound
//! as its UTF-8 bytes and decoded by [`utf8!`], so a session whose `client_encoding` was
//! changed cannot store or look up a different identity either.
//!
//! Tables are named `tower_inbox.<table>` and functions `pg_catalog.<function>`;
//! [`Schema::sql`](crate::schema::Schema) swaps the schema's name when another is configured.
//! Each statement is one plain SQL statement (no PL/pgSQL, no exception block), prepared once
//! per connection by sqlx and run from its cached plan afterwards.

use crate::sql::{key_is, utf8};

/// What a row of the inbox answers a duplicate with, from the table aliased `i`.
macro_rules! entry_columns {
    () => {
        "i.payload_sha256, i.handler_version, i.processed_at is not null as processed, \
         i.response_status, i.response_header_names, i.response_header_values, i.response_body"
    };
}

/// Whether an attempt at the command bound as `$1`..`$4` failed before (it has a row in
/// `consumer_inbox_failure`): then its success must mark the quarantine item about those
/// failures recovered ([`RECOVER`]). One primary-key probe of a table that holds failures
/// only.
macro_rules! failed_before {
    () => {
        concat!(
            "exists (select 1 from tower_inbox.consumer_inbox_failure f where ",
            $crate::sql::key_is!("f"),
            ")"
        )
    };
}

/// The values of a message's row as the claim and the failure record bind them: the
/// identity (`$1`..`$4`), the fingerprint (`$5`) and the handler version (`$6`).
macro_rules! message_values {
    () => {
        concat!(
            utf8!("$1"),
            ", ",
            utf8!("$2"),
            ", ",
            utf8!("$3"),
            ", $4, $5, ",
            utf8!("$6")
        )
    };
}

/// The partitioned claim's condition: the lock is free and no committed row holds the key,
/// in any partition.
macro_rules! partitioned_free {
    () => {
        concat!(
            "pg_catalog.pg_try_advisory_xact_lock($7, $8) \
             and not exists (select 1 from tower_inbox.consumer_inbox c where ",
            key_is!("c"),
            ")"
        )
    };
}

/// The claim's statement: the key's advisory try-lock, then the insert of the identity
/// (`$1`..`$4`), fingerprint (`$5`) and handler version (`$6`), `received_at`, then
/// `$response` (`processed_at` and the four response columns), unless the lock is held; a
/// row comes back when it inserted, saying whether earlier attempts failed, and
/// `$returning` after that.
///
/// The try-lock is the condition of a `SELECT` without `FROM`, which makes one row: the
/// condition is evaluated once, for that row, before the row reaches the insert and its
/// conflict check (the plan shows it as the "One-Time Filter" of a `Result` node). Never give
/// this `SELECT` a `FROM`: the lock would then be tried once per row. It was a CTE before;
/// the filter does the same with two plan nodes fewer to set up on every run (BENCHMARKS.md
/// measures both against the hand-written minimal protocol). In the partitioned claim the
/// planner may evaluate the `NOT EXISTS` first and skip the try-lock when a row exists; the
/// lock is held already there ([`CLAIM_PARTITIONED`]).
///
/// The `SELECT` names every column of the table, in the table's order, `received_at`'s
/// default included: then the insert takes the `SELECT`'s row as it is. Otherwise the claim
/// at commit, whose `clock_timestamp()` is volatile and keeps the `SELECT` from being merged
/// into the insert, gets a `Subquery Scan` between them to add the missing columns, one more
/// node to set up on every run (about 1 000 of PostgreSQL's instructions; a test in
/// `tests/claim_connection.rs` reads both claims' plans).
macro_rules! claim {
    ($response:literal, $returning:literal,) => {
        claim!($response, $returning, "pg_catalog.pg_try_advisory_xact_lock($7, $8)")
    };
    ($response:literal, $returning:literal, $($free:tt)+) => {
        concat!(
            "insert into tower_inbox.consumer_inbox \
                 (consumer_name, producer_name, tenant_id, message_id, payload_sha256, \
                  handler_version, received_at, processed_at, response_status, \
                  response_header_names, response_header_values, response_body) \
             select ",
            message_values!(),
            ", pg_catalog.now(), ",
            $response,
            " where ",
            $($free)+,
            " on conflict do nothing \
             returning ",
            failed_before!(),
            " as failed",
            $returning
        )
    };
}

/// What a claim made first inserts for the response (none yet), and returns after `failed`:
/// where the row it inserted is (`claimed_row`, its `ctid`), for [`RECORD`].
macro_rules! claim_first {
    ($($free:tt)*) => {
        claim!(
            "null, null, null, null, null",
            ", ctid::text as claimed_row",
            $($free)*
        )
    };
}

/// What a claim at commit inserts for the response: `processed_at`, then `$9` status, `$10`
/// header names, `$11` header values, `$12` body; only `failed` comes back.
macro_rules! claim_at_commit {
    ($($free:tt)*) => {
        claim!("pg_catalog.clock_timestamp(), $9, $10, $11, $12", "", $($free)*)
    };
}

/// Claims a message as the first statement of its transaction. Parameters: the identity
/// (`$1`..`$4`), the fingerprint (`$5`), the handler version (`$6`) and the claim lock's
/// two keys (`$7`, `$8`). A row comes back when it claimed, with `failed`: whether earlier
/// attempts failed ([`failed_before!`]), and `claimed_row`: the row's `ctid`, which
/// [`RECORD`] updates.
///
/// The claim never waits and never raises. It first tries the key's advisory lock, which
/// every claim of the key holds until its transaction ends: held elsewhere, the original is
/// in flight and nothing is inserted. Otherwise the insert either claims the key or meets a
/// committed row. When no row comes back, [`LOOKUP_OR_BUSY`], in the same transaction (a new
/// snapshot under `READ COMMITTED`), tells which: the committed row, or the lock held.
///
/// Under `REPEATABLE READ` and `SERIALIZABLE`, meeting a row committed after the snapshot is
/// a serialization failure (`40001`) instead, and the caller re-runs the transaction.
pub(crate) const CLAIM: &str = claim_first!();

/// Claims at commit: the transaction's last statement before `COMMIT` inserts the inbox row
/// with the recorded response, so the claim and the record are one statement. As [`CLAIM`],
/// with the response after the lock keys (`$9` status, `$10` header names, `$11` header
/// values, `$12` body), and `failed` alone coming back.
pub(crate) const CLAIM_AT_COMMIT: &str = claim_at_commit!();

/// The partitioned layout's claim: the key's row may be in any partition, and the primary
/// key (which includes `received_at`) no longer meets it, so the claim looks for a
/// committed row of the key itself. **It must follow [`TRY_CLAIM_LOCK`], granted, in the
/// same transaction** (`Inbox::lock_before_claim`): a statement reads with a snapshot taken
/// when it starts, so only a statement that starts after the lock was granted sees the row
/// of every claim that held the lock before (a claim releases it only after its commit is
/// visible). Its own try-lock is then the same lock taken again, always free. That holds
/// under `READ COMMITTED`; under `REPEATABLE READ` or `SERIALIZABLE` the transaction's first
/// snapshot would be used, so the layer refuses those levels with this layout. Parameters
/// and result as [`CLAIM`].
pub(crate) const CLAIM_PARTITIONED: &str = claim_first!(partitioned_free!());

/// [`CLAIM_AT_COMMIT`] for the partitioned layout, as [`CLAIM_PARTITIONED`].
pub(crate) const CLAIM_AT_COMMIT_PARTITIONED: &str = claim_at_commit!(partitioned_free!());

/// The record's update of the claimed row, found where the claim put it and by `$rest`.
macro_rules! record {
    ($rest:literal) => {
        concat!(
            "update tower_inbox.consumer_inbox i \
             set processed_at = pg_catalog.clock_timestamp(), response_status = $3, \
                 response_header_names = $4, response_header_values = $5, response_body = $6 \
             where i.ctid = $1::tid and i.message_id = $2",
            $rest,
            " returning 1"
        )
    };
}

/// Records the outcome on the row this transaction claimed: `$1` the `claimed_row` the
/// claim returned, `$2` the message ID, then `$3` status, `$4` header names, `$5` header
/// values, `$6` body. A row comes back when it found the claimed row, and it must: a claim
/// never commits without its response. The update touches no indexed column, so it can be
/// HOT. `processed_at` is the time of recording (`clock_timestamp()`), not the start of the
/// transaction (`now()`, which `received_at` holds).
///
/// The row is found by its `ctid` (a `Tid Scan`), not by its key: the claim inserted it in
/// this transaction, so no other transaction can update, lock or vacuum it, and nothing in
/// the protocol updates it before the record. Finding it by its four key columns took a
/// primary-key descent comparing text in the database's collation and three conversions of
/// the bound names: about 45 000 of PostgreSQL's instructions per command, 7% of what the
/// layer's first-seen statements cost it (callgrind, BENCHMARKS.md). The message ID must
/// match too: should the row have moved (a handler that updated the inbox row itself) or a
/// `ctid` ever name another row, the record finds none and the transaction rolls back rather
/// than commit a response on the wrong command.
pub(crate) const RECORD: &str = record!("");

/// [`RECORD`] for the partitioned layout: a `ctid` is a place within one partition, so the
/// update also needs the claimed row's `received_at`, this transaction's `now()` (the claim
/// wrote it): no two partitions hold rows with the same `received_at`, so no row of another
/// partition at the same place can match.
pub(crate) const RECORD_PARTITIONED: &str = record!(" and i.received_at = pg_catalog.now()");

/// Marks the quarantine item about earlier failed attempts of a command (key `$1`)
/// recovered, in the transaction that commits its success: the recovery commits exactly when
/// the success does. Sent only when the claim saw earlier failures.
pub(crate) const RECOVER: &str = concat!(
    "update tower_inbox.inbox_quarantine q \
     set recovered_at = pg_catalog.now(), \
         decision = coalesce(q.decision, 'repair'), \
         decided_by = coalesce(q.decided_by, 'tower-inbox'), \
         decided_at = coalesce(q.decided_at, pg_catalog.now()), \
         decision_reason = coalesce(q.decision_reason, 'a later attempt committed') \
     where q.item_key = ",
    utf8!("$1"),
    " and q.recovered_at is null"
);

/// Reads one inbox row (the committed state; nothing in flight is visible).
pub(crate) const LOOKUP: &str = concat!(
    "select ",
    entry_columns!(),
    " from tower_inbox.consumer_inbox i where ",
    key_is!("i")
);

/// [`LOOKUP`], outside any transaction, together with whether the key's claim lock is free
/// (`$5`, `$6`): a key without a committed row whose lock is held is in flight elsewhere.
/// The lock is released again when the statement ends.
pub(crate) const LOOKUP_OR_BUSY: &str = concat!(
    "select pg_catalog.pg_try_advisory_xact_lock($5, $6) as free, ",
    entry_columns!(),
    " from (select) as one left join tower_inbox.consumer_inbox i on ",
    key_is!("i")
);

/// Counts a rolled-back attempt, in its own transaction; from the `$8`th attempt on, the
/// command also has an open quarantine item (key `$9`) carrying the same count. Returns the
/// item and whether this statement opened it (`xmax = 0` marks a row inserted, not updated).
/// `$5` fingerprint, `$6` handler version, `$7` reason.
///
/// `$10` says whether this transaction holds the key's claim lock ([`TRY_CLAIM_LOCK`], sent
/// before, so that this statement's snapshot is taken after the lock was granted). Only then,
/// and only if no attempt has committed the command, may an item be opened: a retry that
/// claimed the key since this attempt rolled back did not see this failure, so its commit
/// would not mark a new item recovered. Otherwise an item already open is counted (an update
/// re-checks `decision is null` on the latest version of the row, so an item the retry
/// recovered meanwhile is left alone, where an insert would open a second one), and the
/// retry's own outcome decides the rest: its success needs no item, and its failure is
/// recorded with the lock free and opens the item with the count so far.
pub(crate) const RECORD_FAILURE: &str = concat!(
    "with failure as ( \
         insert into tower_inbox.consumer_inbox_failure as f \
             (consumer_name, producer_name, tenant_id, message_id, payload_sha256, \
              handler_version, last_reason) \
         values (",
    message_values!(),
    ", ",
    utf8!("$7"),
    ") \
         on conflict (consumer_name, producer_name, tenant_id, message_id) do update \
         set attempts = f.attempts + 1, last_failed_at = pg_catalog.now(), \
             last_reason = excluded.last_reason, payload_sha256 = excluded.payload_sha256, \
             handler_version = excluded.handler_version \
         returning * \
     ), \
     guard as ( \
         select $10 and not exists (select 1 from tower_inbox.consumer_inbox i where ",
    key_is!("i"),
    ") as may_open \
     ), \
     opened as ( \
         insert into tower_inbox.inbox_quarantine as q \
             (source, item_key, consumer_name, producer_name, tenant_id, message_id, \
              payload_sha256, payload_ref, reason_code, attempts, first_failed_at, \
              last_failed_at, handler_version) \
         select 'handler-failure', ",
    utf8!("$9"),
    ", consumer_name, producer_name, tenant_id, message_id, payload_sha256, \
                'sha256:' || payload_sha256, last_reason, attempts, first_failed_at, \
                last_failed_at, handler_version \
         from failure, guard where guard.may_open and failure.attempts >= $8 \
         on conflict (item_key) where decision is null do update \
         set attempts = excluded.attempts, last_failed_at = excluded.last_failed_at, \
             reason_code = excluded.reason_code, payload_sha256 = excluded.payload_sha256, \
             payload_ref = excluded.payload_ref, handler_version = excluded.handler_version \
         returning q.id, (q.xmax = 0) as opened \
     ), \
     counted as ( \
         update tower_inbox.inbox_quarantine q \
         set attempts = failure.attempts, last_failed_at = failure.last_failed_at, \
             reason_code = failure.last_reason, payload_sha256 = failure.payload_sha256, \
             payload_ref = 'sha256:' || failure.payload_sha256, \
             handler_version = failure.handler_version \
         from failure, guard \
         where not guard.may_open and q.item_key = ",
    utf8!("$9"),
    " and q.decision is null \
         returning q.id, false as opened \
     ) \
     select id, opened from opened union all select id, opened from counted"
);

/// Tries the claim lock of a key (`$1`, `$2`, see `ClaimLock`) for the rest of the
/// transaction, without waiting: held, another attempt is in flight with the key.
pub(crate) const TRY_CLAIM_LOCK: &str = "select pg_catalog.pg_try_advisory_xact_lock($1, $2)";

/// Keeps a message in the quarantine: one open item per key (for an identity conflict the
/// key holds the conflicting hash, so each conflicting payload is its own item), counted.
/// `$5` source, `$6` item key, `$7` fingerprint, `$8` reason, `$9` handler version. Returns
/// the item and its count.
pub(crate) const QUARANTINE_MESSAGE: &str = concat!(
    "insert into tower_inbox.inbox_quarantine as q \
         (source, item_key, consumer_name, producer_name, tenant_id, message_id, \
          payload_sha256, payload_ref, reason_code, handler_version) \
     values ($5, ",
    utf8!("$6"),
    ", ",
    utf8!("$1"),
    ", ",
    utf8!("$2"),
    ", ",
    utf8!("$3"),
    ", $4, $7, 'sha256:' || $7, ",
    utf8!("$8"),
    ", ",
    utf8!("$9"),
    ") \
     on conflict (item_key) where decision is null do update \
     set attempts = q.attempts + 1, last_failed_at = pg_catalog.now(), \
         payload_sha256 = excluded.payload_sha256, payload_ref = excluded.payload_ref, \
         handler_version = excluded.handler_version \
     returning q.id, q.attempts"
);

/// Whether a message produced at `$1` is older than a window of `$2` seconds, on the
/// database's clock (the clock that stamps `received_at`, which the purge compares), and
/// that window's oldest accepted time.
pub(crate) const EXPIRED: &str = "\
select $1 < pg_catalog.now() - pg_catalog.make_interval(secs => $2) as expired, \
       pg_catalog.now() - pg_catalog.make_interval(secs => $2) as oldest_accepted";

/// Claims in flight in this database, per first key of their advisory lock (the consumer,
/// see `ClaimLock`): how many, and how long the oldest's transaction has been open. Reads
/// PostgreSQL's in-memory lock and activity tables, not the inbox.
pub(crate) const CLAIMS_IN_FLIGHT: &str = "\
select l.classid::int8, pg_catalog.count(*)::int8, \
       coalesce(extract(epoch from pg_catalog.max( \
           pg_catalog.clock_timestamp() - a.xact_start)), 0)::float8 \
from pg_catalog.pg_locks l \
join pg_catalog.pg_stat_activity a on a.pid = l.pid \
where l.locktype = 'advisory' and l.objsubid = 2 and l.granted \
  and a.datname = pg_catalog.current_database() and l.database = a.datid \
group by l.classid";

/// How the inbox table is laid out: `p` partitioned, `r` plain; no row without the table.
pub(crate) const RELKIND: &str = "\
select c.relkind::text from pg_catalog.pg_class c \
join pg_catalog.pg_namespace n on n.oid = c.relnamespace \
where n.nspname = $1 and c.relname = 'consumer_inbox'";

/// When the key's row was claimed and recorded (`$1` to `$4`, bound by `bind_identity!`).
pub(crate) const TIMES: &str = concat!(
    "select i.received_at, i.processed_at from tower_inbox.consumer_inbox i where ",
    crate::sql::key_is!("i")
);

/// The key's record of attempts that rolled back, if any.
pub(crate) const FAILURE_RECORD: &str = concat!(
    "select f.attempts, f.first_failed_at, f.last_failed_at, f.last_reason, \
            f.payload_sha256, f.handler_version \
     from tower_inbox.consumer_inbox_failure f where ",
    crate::sql::key_is!("f")
);

#[cfg(test)]
mod tests {
    use super::*;

    /// `sql` with every parameter (`$1`, or pgbench's `:name`) written `?` and every run of
    /// whitespace one space: what two spellings of one statement share.
    fn shape(sql: &str) -> String {
        let mut out = String::with_capacity(sql.len());
        let mut chars = sql.chars().peekable();
        let mut last = ' ';
        while let Some(c) = chars.next() {
            let param = match c {
                '$' => chars.peek().is_some_and(char::is_ascii_digit),
                ':' => last != ':' && chars.peek().is_some_and(|n| n.is_ascii_alphabetic()),
                _ => false,
            };
            if param {
                while chars
                    .peek()
                    .is_some_and(|n| n.is_ascii_alphanumeric() || *n == '_')
                {
                    chars.next();
                }
                out.push('?');
            } else if c.is_whitespace() {
                if !out.ends_with(' ') {
                    out.push(' ');
                }
            } else {
                out.push(c);
            }
            last = c;
        }
        out
    }

    /// The pgbench scripts that measure the layer's statements send exactly these.
    #[test]
    fn the_pgbench_scripts_send_the_statements_the_layer_sends() {
        let scripts = [
            (
                include_str!("../../benches/pgbench/layer_first_seen.sql"),
                &[CLAIM, RECORD][..],
            ),
            (
                include_str!("../../benches/pgbench/layer_first_seen_lookup.sql"),
                &[LOOKUP_OR_BUSY, CLAIM, RECORD][..],
            ),
            (
                include_str!("../../benches/pgbench/layer_at_commit.sql"),
                &[CLAIM_AT_COMMIT][..],
            ),
            (
                include_str!("../../benches/pgbench/replay.sql"),
                &[LOOKUP_OR_BUSY][..],
            ),
            (
                include_str!("../../benches/pgbench/claim_duplicate.sql"),
                &[CLAIM, LOOKUP_OR_BUSY][..],
            ),
        ];
        for (script, statements) in scripts {
            let script = shape(script);
            for statement in statements {
                assert!(
                    script.contains(&shape(statement)),
                    "a pgbench script no longer sends:\n{statement}"
                );
            }
        }
        assert_eq!(shape("a = $12 and b::text = :key"), "a = ? and b::text = ?");
    }
}
