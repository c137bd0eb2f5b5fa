-- The statements the layer sends for a first-seen command with ClaimMode::AtCommit, one
-- round trip each, as src/inbox/sql.rs writes them (a unit test there checks this file
-- against the constants): the lookup (LOOKUP_OR_BUSY), BEGIN, the credit's two statements,
-- the claim with the recorded response (CLAIM_AT_COMMIT), COMMIT. Compare with
-- minimal_at_commit.sql.
\set aid random(0, 9999)
\set key :client_id * 100000000000000 + random(0, 99999999999999)
\set lock :key % 2000000000
select pg_catalog.pg_try_advisory_xact_lock(:client_id, :lock) as free, i.payload_sha256, i.handler_version, i.processed_at is not null as processed, i.response_status, i.response_header_names, i.response_header_values, i.response_body from (select) as one left join tower_inbox.consumer_inbox i on i.consumer_name = pg_catalog.convert_from(:consumer, 'UTF8') collate pg_catalog."default" and i.producer_name = pg_catalog.convert_from(:producer, 'UTF8') collate pg_catalog."default" and i.tenant_id = pg_catalog.convert_from(:tenant, 'UTF8') collate pg_catalog."default" and i.message_id = :key;
BEGIN ISOLATION LEVEL READ COMMITTED;
insert into credit_account (account_id, balance) values (:aid, 1)
on conflict (account_id) do update set balance = credit_account.balance + excluded.balance
returning balance \gset
insert into credit_ledger
    (account_id, delta, balance_after, consumer_name, producer_name, message_id)
values (:aid, 1, :balance, 'credits', 'bench', :key);
with lock as ( select pg_catalog.pg_try_advisory_xact_lock(:client_id, :lock) as free ), claimed as ( insert into tower_inbox.consumer_inbox (consumer_name, producer_name, tenant_id, message_id, payload_sha256, handler_version, processed_at, response_status, response_header_names, response_header_values, response_body) select pg_catalog.convert_from(:consumer, 'UTF8') collate pg_catalog."default", pg_catalog.convert_from(:producer, 'UTF8') collate pg_catalog."default", pg_catalog.convert_from(:tenant, 'UTF8') collate pg_catalog."default", :key, :sha, pg_catalog.convert_from(:version, 'UTF8') collate pg_catalog."default", pg_catalog.clock_timestamp(), :status, :header_names, :header_values, :body from lock where lock.free on conflict do nothing returning 1 ), recovered as ( update tower_inbox.inbox_quarantine q set recovered_at = pg_catalog.now(), decision = coalesce(q.decision, 'repair'), decided_by = coalesce(q.decided_by, 'tower-inbox'), decided_at = coalesce(q.decided_at, pg_catalog.now()), decision_reason = coalesce(q.decision_reason, 'a later attempt committed') from claimed where q.item_key = pg_catalog.convert_from(:item, 'UTF8') collate pg_catalog."default" and q.recovered_at is null returning 1) select l.free, exists (select 1 from claimed) as claimed, (select pg_catalog.count(*) from recovered) as recovered, i.payload_sha256, i.handler_version, i.processed_at is not null as processed, i.response_status, i.response_header_names, i.response_header_values, i.response_body from lock l left join lateral ( select * from tower_inbox.consumer_inbox i where not exists (select 1 from claimed) and i.consumer_name = pg_catalog.convert_from(:consumer, 'UTF8') collate pg_catalog."default" and i.producer_name = pg_catalog.convert_from(:producer, 'UTF8') collate pg_catalog."default" and i.tenant_id = pg_catalog.convert_from(:tenant, 'UTF8') collate pg_catalog."default" and i.message_id = :key) i on true;
COMMIT;
