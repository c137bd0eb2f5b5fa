-- A duplicate met by the claim (while duplicates are rare, or with
-- lookup_before_claim(false)): BEGIN, the claim (CLAIM in src/inbox/sql.rs) that inserts
-- nothing, the read in the same transaction (LOOKUP_OR_BUSY) that finds the recorded row, and
-- the ROLLBACK of the empty transaction (which the layer leaves to the pool's release ping).
-- Uses the rows run.sh recorded for replay.sql.
\set key random(1, :rows)
\set lock :key % 2000000000
BEGIN;
insert into tower_inbox.consumer_inbox (consumer_name, producer_name, tenant_id, message_id, payload_sha256, handler_version, received_at, processed_at, response_status, response_header_names, response_header_values, response_body) select pg_catalog.convert_from(:consumer, 'UTF8') collate pg_catalog."default", pg_catalog.convert_from(:producer, 'UTF8') collate pg_catalog."default", pg_catalog.convert_from(:tenant, 'UTF8') collate pg_catalog."default", :key, :sha, pg_catalog.convert_from(:version, 'UTF8') collate pg_catalog."default", pg_catalog.now(), null, null, null, null, null where pg_catalog.pg_try_advisory_xact_lock(:client_id, :lock) on conflict do nothing returning exists (select 1 from tower_inbox.consumer_inbox_failure f where f.consumer_name = pg_catalog.convert_from(:consumer, 'UTF8') collate pg_catalog."default" and f.producer_name = pg_catalog.convert_from(:producer, 'UTF8') collate pg_catalog."default" and f.tenant_id = pg_catalog.convert_from(:tenant, 'UTF8') collate pg_catalog."default" and f.message_id = :key) as failed, ctid::text as claimed_row;
select pg_catalog.pg_try_advisory_xact_lock(:client_id, :lock) as free, i.payload_sha256, i.handler_version, i.processed_at is not null as processed, i.response_status, i.response_header_names, i.response_header_values, i.response_body from (select) as one left join tower_inbox.consumer_inbox i on i.consumer_name = pg_catalog.convert_from(:consumer, 'UTF8') collate pg_catalog."default" and i.producer_name = pg_catalog.convert_from(:producer, 'UTF8') collate pg_catalog."default" and i.tenant_id = pg_catalog.convert_from(:tenant, 'UTF8') collate pg_catalog."default" and i.message_id = :key;
ROLLBACK;
