-- A bound, not a protocol: layer_first_seen.sql's messages with the two PL/pgSQL calls
-- replaced by the bare statements inside them, an INSERT ... ON CONFLICT DO NOTHING for the
-- claim and the UPDATE that records the response. What is left out is what makes the claim
-- and the record correct and safe: raising when the key is taken (a simple query sent as the
-- BEGIN returns no rows, so an error is the only answer the layer can read), the bounded wait
-- for an in-flight original (lock_timeout, set and restored), the check that the claimed row
-- is there before COMMIT; and, with the record, the quarantine recovery. The difference
-- between the two scripts is what those cost. Run with -M simple (the `@simple` in SCRIPTS), like the layer_* scripts.
\set aid random(0, 9999)
\set key :client_id * 100000000000000 + random(0, 99999999999999)
BEGIN ISOLATION LEVEL READ COMMITTED \; insert into consumer_inbox (consumer_name, producer_name, tenant_id, message_id, payload_sha256, handler_version) values (E'credits', E'bench', E'', E'k:key', E'2f0c6a7a3ac4b3b35e0c8c4e1b7d3f4a9a1e5c2d6b8f0e1a2c3d4e5f6a7b8c9d', E'1') on conflict do nothing;
insert into credit_account (account_id, balance) values (:aid, 1)
on conflict (account_id) do update set balance = credit_account.balance + excluded.balance
returning balance \gset
insert into credit_ledger
    (account_id, delta, balance_after, consumer_name, producer_name, message_id)
values (:aid, 1, :balance, 'credits', 'bench', :key);
update consumer_inbox set processed_at = clock_timestamp(), response_status = 201::smallint, response_header_names = array[E'content-type']::text[], response_header_values = array[E'\\x6170706c69636174696f6e2f6a736f6e'::bytea]::bytea[], response_body = E'\\x7b226163636f756e745f6964223a22616363742d31323334222c2262616c616e6365223a34322c2264656c7461223a317d'::bytea where consumer_name = E'credits' and producer_name = E'bench' and tenant_id = E'' and message_id = E'k:key' \; commit \; begin;
rollback;
