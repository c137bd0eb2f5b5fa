-- A replayed duplicate with the default builder: the lookup (LOOKUP_OR_BUSY in
-- src/inbox/sql.rs) finds the recorded row by primary key, outside any transaction; nothing
-- else reaches the database. run.sh first records :rows processed rows under the producer
-- 'bench', with keys 1 to :rows; this picks one at random.
\set key random(1, :rows)
\set lock :key % 2000000000
select pg_catalog.pg_try_advisory_xact_lock(:client_id, :lock) as free, i.payload_sha256, i.handler_version, i.processed_at is not null as processed, i.response_status, i.response_header_names, i.response_header_values, i.response_body from (select) as one left join tower_inbox.consumer_inbox i on i.consumer_name = pg_catalog.convert_from(:consumer, 'UTF8') collate pg_catalog."default" and i.producer_name = pg_catalog.convert_from(:producer, 'UTF8') collate pg_catalog."default" and i.tenant_id = pg_catalog.convert_from(:tenant, 'UTF8') collate pg_catalog."default" and i.message_id = :key;
