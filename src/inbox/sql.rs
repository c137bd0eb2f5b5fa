//! The statements the protocol core sends, next to the migrations they rely on
//! (`migrations/20261202000001_consumer_inbox.sql`).

/// Records the outcome on the claimed row. Touches no indexed column, so it can be a HOT
/// update. `processed_at` is the time of recording (`clock_timestamp()`), not the start of
/// the transaction (`now()`, which `received_at` holds). In the same statement, a quarantine item about earlier failed attempts of this
/// command is marked recovered: it commits exactly when the success does. Returns how many
/// items it recovered.
pub(crate) const RECORD: &str = "\
with recovered as ( \
    update inbox_quarantine \
    set recovered_at = now(), \
        decision = coalesce(decision, 'repair'), \
        decided_by = coalesce(decided_by, 'tower-inbox'), \
        decided_at = coalesce(decided_at, now()), \
        decision_reason = coalesce(decision_reason, 'a later attempt committed') \
    where item_key = $9 and recovered_at is null \
    returning 1 \
) \
update consumer_inbox \
set processed_at = clock_timestamp(), response_status = $5, response_header_names = $6, \
    response_header_values = $7, response_body = $8 \
where consumer_name = $1 and producer_name = $2 and tenant_id = $3 and message_id = $4 \
returning (select count(*) from recovered)";

/// Counts a rolled-back attempt, in its own transaction; from the `$8`th attempt on, the
/// command also has an open quarantine item (key `$9`) carrying the same count. Returns the
/// item and whether this statement opened it (`xmax = 0` marks a row inserted, not updated).
pub(crate) const RECORD_FAILURE: &str = "\
with failure as ( \
    insert into consumer_inbox_failure as f \
        (consumer_name, producer_name, tenant_id, message_id, payload_sha256, handler_version, last_reason) \
    values ($1, $2, $3, $4, $5, $6, $7) \
    on conflict (consumer_name, producer_name, tenant_id, message_id) do update \
    set attempts = f.attempts + 1, last_failed_at = now(), last_reason = excluded.last_reason, \
        payload_sha256 = excluded.payload_sha256, handler_version = excluded.handler_version \
    returning * \
) \
insert into inbox_quarantine as q \
    (source, item_key, consumer_name, producer_name, tenant_id, message_id, payload_sha256, \
     payload_ref, reason_code, attempts, first_failed_at, last_failed_at, handler_version) \
select 'handler-failure', $9, consumer_name, producer_name, tenant_id, message_id, payload_sha256, \
       'sha256:' || payload_sha256, last_reason, attempts, first_failed_at, last_failed_at, handler_version \
from failure where attempts >= $8 \
on conflict (item_key) where decision is null do update \
set attempts = excluded.attempts, last_failed_at = excluded.last_failed_at, \
    reason_code = excluded.reason_code, payload_sha256 = excluded.payload_sha256, \
    payload_ref = excluded.payload_ref, handler_version = excluded.handler_version \
returning q.id, (q.xmax = 0) as opened";

/// Keeps a message in the quarantine: one open item per key (for an identity conflict the
/// key holds the conflicting hash, so each conflicting payload is its own item), counted.
/// Returns the item and its count.
pub(crate) const QUARANTINE_MESSAGE: &str = "\
insert into inbox_quarantine as q \
    (source, item_key, consumer_name, producer_name, tenant_id, message_id, payload_sha256, \
     payload_ref, reason_code, handler_version) \
values ($1, $2, $3, $4, $5, $6, $7, 'sha256:' || $7, $8, $9) \
on conflict (item_key) where decision is null do update \
set attempts = q.attempts + 1, last_failed_at = now(), payload_sha256 = excluded.payload_sha256, \
    payload_ref = excluded.payload_ref, handler_version = excluded.handler_version \
returning q.id, q.attempts";

/// Claims at commit, recording the response in the same insert; on conflict reads the
/// winning row. See `tower_inbox_claim_at_commit` in
/// `migrations/20261203000002_claim_at_commit.sql`.
pub(crate) const CLAIM_AT_COMMIT: &str = "\
select claimed, recovered, payload_sha256, handler_version, \
       processed_at is not null as processed, response_status, response_header_names, \
       response_header_values, response_body \
from tower_inbox_claim_at_commit($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)";

/// What [`LOOKUP`] reads, without its `where`.
macro_rules! lookup_select {
    () => {
        "select payload_sha256, handler_version, processed_at is not null as processed, \
                response_status, response_header_names, response_header_values, response_body \
         from consumer_inbox"
    };
}

/// [`LOOKUP`]'s row as text that reads the same whatever the session's settings, for the
/// simple query that follows the `ROLLBACK` of a claim that found the key taken: a simple
/// query answers in text format, where `bytea` follows `bytea_output` and an array element
/// spelled `NULL` reads as a null. So the body is hex (`response_body_hex`), and the headers
/// are one string of `<name as hex>:<value as hex>` pairs joined by commas
/// (`response_headers_hex`, null for none).
pub(crate) const LOOKUP_TEXT_SELECT: &str = "\
select payload_sha256, handler_version, processed_at is not null as processed, response_status, \
       encode(response_body, 'hex') as response_body_hex, \
       (select string_agg(encode(convert_to(h.name, 'UTF8'), 'hex') || ':' || encode(h.value, 'hex'), \
                          ',' order by h.n) \
        from unnest(response_header_names, response_header_values) with ordinality as h(name, value, n)) \
       as response_headers_hex \
from consumer_inbox";

/// The primary key's columns, in the order of [`LOOKUP`]'s parameters and of
/// `MessageIdentity::key_parts`.
pub(crate) const KEY_COLUMNS: [&str; 4] =
    ["consumer_name", "producer_name", "tenant_id", "message_id"];

/// Reads one inbox row, outside any transaction.
pub(crate) const LOOKUP: &str = concat!(
    lookup_select!(),
    " where consumer_name = $1 and producer_name = $2 and tenant_id = $3 and message_id = $4"
);

/// Opens the transaction and claims, in one message: see `tower_inbox_claim_or_raise` in
/// `migrations/20261203000004_claim_in_begin.sql`.
pub(crate) const CLAIM_OR_RAISE: &str = "tower_inbox_claim_or_raise";

/// The SQLSTATE `tower_inbox_claim_or_raise` raises when the key is already taken.
pub(crate) const TAKEN: &str = "TICL1";
