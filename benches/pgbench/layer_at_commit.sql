-- The messages the layer sends for a first-seen command with ClaimMode::AtCommit, one line
-- per round trip (see layer_first_seen.sql): BEGIN, the handler's two statements, the claim
-- with the recorded response and the COMMIT in one message, and the release's ROLLBACK of
-- the empty transaction. Run with -M simple: compare it with bare@simple.
\set aid random(0, 9999)
\set key :client_id * 100000000000000 + random(0, 99999999999999)
BEGIN ISOLATION LEVEL READ COMMITTED;
insert into credit_account (account_id, balance) values (:aid, 1)
on conflict (account_id) do update set balance = credit_account.balance + excluded.balance
returning balance \gset
insert into credit_ledger
    (account_id, delta, balance_after, consumer_name, producer_name, message_id)
values (:aid, 1, :balance, 'credits', 'bench', :key);
select tower_inbox_claim_at_commit_or_abort(E'credits', E'bench', E'', E'k:key', E'2f0c6a7a3ac4b3b35e0c8c4e1b7d3f4a9a1e5c2d6b8f0e1a2c3d4e5f6a7b8c9d', E'1', 2000::integer, 201::smallint, array[E'content-type']::text[], array[E'\\x6170706c69636174696f6e2f6a736f6e'::bytea]::bytea[], E'\\x7b226163636f756e745f6964223a22616363742d31323334222c2262616c616e6365223a34322c2264656c7461223a317d'::bytea, E'handler-failure\x3acredits\x1fbench\x1f\x1fk:key') \; commit \; begin;
rollback;
