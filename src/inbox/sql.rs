//! The statements the protocol core sends, next to the migrations they rely on
//! (`migrations/20261202000001_consumer_inbox.sql`).

/// One round trip: bounded wait, insert-or-read. See `tower_inbox_claim` in the migration.
pub(crate) const CLAIM: &str = "\
select claimed, payload_sha256, handler_version, processed_at is not null as processed, \
       response_status, response_header_names, response_header_values, response_body \
from tower_inbox_claim($1, $2, $3, $4, $5, $6, $7)";

/// Records the outcome on the claimed row. Touches no indexed column, so it can be a HOT
/// update.
pub(crate) const RECORD: &str = "\
update consumer_inbox \
set processed_at = now(), response_status = $5, response_header_names = $6, \
    response_header_values = $7, response_body = $8 \
where consumer_name = $1 and producer_name = $2 and tenant_id = $3 and message_id = $4";

/// Counts a rolled-back attempt, in its own transaction.
pub(crate) const RECORD_FAILURE: &str = "\
insert into consumer_inbox_failure as f \
    (consumer_name, producer_name, tenant_id, message_id, payload_sha256, handler_version, last_reason) \
values ($1, $2, $3, $4, $5, $6, $7) \
on conflict (consumer_name, producer_name, tenant_id, message_id) do update \
set attempts = f.attempts + 1, last_failed_at = now(), last_reason = excluded.last_reason, \
    payload_sha256 = excluded.payload_sha256, handler_version = excluded.handler_version";

/// Reads one inbox row, outside any transaction.
pub(crate) const LOOKUP: &str = "\
select payload_sha256, handler_version, processed_at is not null as processed, \
       response_status, response_header_names, response_header_values, response_body \
from consumer_inbox \
where consumer_name = $1 and producer_name = $2 and tenant_id = $3 and message_id = $4";
