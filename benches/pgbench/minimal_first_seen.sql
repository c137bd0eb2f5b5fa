-- The minimal protocol for a first-seen command, the database's ceiling for what the layer
-- must do: claim with INSERT ... ON CONFLICT DO NOTHING RETURNING, the credit's two
-- statements, record the response with an UPDATE, one round trip each. Nothing that makes it
-- safe under concurrency beyond the primary key (no in-flight detection, no check that the
-- record found its row, no quarantine recovery), no lookup first. run.sh runs it prepared
-- and simple (@simple); compare the layer's statements (layer_first_seen.sql) with it.
\set aid random(0, 9999)
\set key :client_id * 100000000000000 + random(0, 99999999999999)
BEGIN;
insert into tower_inbox.consumer_inbox
    (consumer_name, producer_name, tenant_id, message_id, payload_sha256, handler_version)
values ('credits', 'bench', '', :key, '2f0c6a7a3ac4b3b35e0c8c4e1b7d3f4a9a1e5c2d6b8f0e1a2c3d4e5f6a7b8c9d', '1')
on conflict do nothing returning 1;
insert into credit_account (account_id, balance) values (:aid, 1)
on conflict (account_id) do update set balance = credit_account.balance + excluded.balance
returning balance \gset
insert into credit_ledger
    (account_id, delta, balance_after, consumer_name, producer_name, message_id)
values (:aid, 1, :balance, 'credits', 'bench', :key);
update tower_inbox.consumer_inbox
set processed_at = clock_timestamp(), response_status = 201,
    response_header_names = '{content-type}', response_header_values = '{application/json}',
    response_body = '{"account_id":"acct-1234","balance":42,"delta":1}'
where consumer_name = 'credits' and producer_name = 'bench' and tenant_id = '' and message_id = :key::text;
COMMIT;
