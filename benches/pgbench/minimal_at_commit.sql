-- The minimal protocol for a first-seen command claimed at commit: the credit's two
-- statements, then one INSERT ... ON CONFLICT DO NOTHING RETURNING with the response, one
-- round trip each; no lookup, no in-flight detection. Compare layer_at_commit.sql with it.
\set aid random(0, 9999)
\set key :client_id * 100000000000000 + random(0, 99999999999999)
BEGIN;
insert into credit_account (account_id, balance) values (:aid, 1)
on conflict (account_id) do update set balance = credit_account.balance + excluded.balance
returning balance \gset
insert into credit_ledger
    (account_id, delta, balance_after, consumer_name, producer_name, message_id)
values (:aid, 1, :balance, 'credits', 'bench', :key);
insert into tower_inbox.consumer_inbox
    (consumer_name, producer_name, tenant_id, message_id, payload_sha256, handler_version,
     processed_at, response_status, response_header_names, response_header_values, response_body)
values ('credits', 'bench', '', :key, '2f0c6a7a3ac4b3b35e0c8c4e1b7d3f4a9a1e5c2d6b8f0e1a2c3d4e5f6a7b8c9d', '1',
        clock_timestamp(), 201, '{content-type}', '{application/json}',
        '{"account_id":"acct-1234","balance":42,"delta":1}')
on conflict do nothing returning 1;
COMMIT;
