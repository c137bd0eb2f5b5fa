-- layer_first_seen.sql with the read of the key first (LOOKUP_OR_BUSY in src/inbox/sql.rs):
-- what a first-seen command costs while many requests are duplicates, or with
-- lookup_before_claim(true). One round trip more than layer_first_seen.sql.
\set aid random(0, 9999)
\set key :client_id * 100000000000000 + random(0, 99999999999999)
\set lock :key % 2000000000
select pg_catalog.pg_try_advisory_xact_lock(:client_id, :lock) as free, i.payload_sha256, i.handler_version, i.processed_at is not null as processed, i.response_status, i.response_header_names, i.response_header_values, i.response_body from (select) as one left join tower_inbox.consumer_inbox i on i.consumer_name = pg_catalog.convert_from(:consumer, 'UTF8') collate pg_catalog."default" and i.producer_name = pg_catalog.convert_from(:producer, 'UTF8') collate pg_catalog."default" and i.tenant_id = pg_catalog.convert_from(:tenant, 'UTF8') collate pg_catalog."default" and i.message_id = :key;
BEGIN;
insert into tower_inbox.consumer_inbox (consumer_name, producer_name, tenant_id, message_id, payload_sha256, handler_version, received_at, processed_at, response_status, response_header_names, response_header_values, response_body) select pg_catalog.convert_from(:consumer, 'UTF8') collate pg_catalog."default", pg_catalog.convert_from(:producer, 'UTF8') collate pg_catalog."default", pg_catalog.convert_from(:tenant, 'UTF8') collate pg_catalog."default", :key, :sha, pg_catalog.convert_from(:version, 'UTF8') collate pg_catalog."default", pg_catalog.now(), null, null, null, null, null where pg_catalog.pg_try_advisory_xact_lock(:client_id, :lock) on conflict do nothing returning exists (select 1 from tower_inbox.consumer_inbox_failure f where f.consumer_name = pg_catalog.convert_from(:consumer, 'UTF8') collate pg_catalog."default" and f.producer_name = pg_catalog.convert_from(:producer, 'UTF8') collate pg_catalog."default" and f.tenant_id = pg_catalog.convert_from(:tenant, 'UTF8') collate pg_catalog."default" and f.message_id = :key) as failed, ctid::text as claimed_row \gset
insert into credit_account (account_id, balance) values (:aid, 1)
on conflict (account_id) do update set balance = credit_account.balance + excluded.balance
returning balance \gset
insert into credit_ledger
    (account_id, delta, balance_after, consumer_name, producer_name, message_id)
values (:aid, 1, :balance, 'credits', 'bench', :key);
update tower_inbox.consumer_inbox i set processed_at = pg_catalog.clock_timestamp(), response_status = :status, response_header_names = :header_names, response_header_values = :header_values, response_body = :body where i.ctid = :claimed_row::tid and i.message_id = :key returning 1;
COMMIT;
