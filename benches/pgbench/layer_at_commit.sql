-- The statements the layer sends for a first-seen command with ClaimMode::AtCommit while
-- duplicates are rare, one round trip each, as src/inbox/sql.rs writes them (a unit test
-- there checks this file against the constants): BEGIN, the credit's two statements, the
-- claim with the recorded response (CLAIM_AT_COMMIT), COMMIT. Compare with
-- minimal_at_commit.sql.
\set aid random(0, 9999)
\set key :client_id * 100000000000000 + random(0, 99999999999999)
\set lock :key % 2000000000
BEGIN;
insert into credit_account (account_id, balance) values (:aid, 1)
on conflict (account_id) do update set balance = credit_account.balance + excluded.balance
returning balance \gset
insert into credit_ledger
    (account_id, delta, balance_after, consumer_name, producer_name, message_id)
values (:aid, 1, :balance, 'credits', 'bench', :key);
insert into tower_inbox.consumer_inbox (consumer_name, producer_name, tenant_id, message_id, payload_sha256, handler_version, received_at, processed_at, response_status, response_header_names, response_header_values, response_body) select pg_catalog.convert_from(:consumer, 'UTF8') collate pg_catalog."default", pg_catalog.convert_from(:producer, 'UTF8') collate pg_catalog."default", pg_catalog.convert_from(:tenant, 'UTF8') collate pg_catalog."default", :key, :sha, pg_catalog.convert_from(:version, 'UTF8') collate pg_catalog."default", pg_catalog.now(), pg_catalog.clock_timestamp(), :status, :header_names, :header_values, :body where pg_catalog.pg_try_advisory_xact_lock(:client_id, :lock) on conflict do nothing returning exists (select 1 from tower_inbox.consumer_inbox_failure f where f.consumer_name = pg_catalog.convert_from(:consumer, 'UTF8') collate pg_catalog."default" and f.producer_name = pg_catalog.convert_from(:producer, 'UTF8') collate pg_catalog."default" and f.tenant_id = pg_catalog.convert_from(:tenant, 'UTF8') collate pg_catalog."default" and f.message_id = :key) as failed;
COMMIT;
