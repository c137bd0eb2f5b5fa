-- claim first, one statement per round trip: the protocol's statements (the claim, the
-- handler's two statements, the record, as issue 5's reference table lists them) around the
-- credits handler, each its own prepared statement. The layer itself now joins the BEGIN with
-- the claim and the record with the COMMIT (layer_first_seen.sql). The key is new every time.
-- The recorded response is the handler's: 201, content-type application/json and its small
-- JSON body, written in hex so that pgbench does not read the colons in it as variables (the
-- colon of the quarantine item key is \x3a for the same reason).
\set aid random(0, 9999)
\set key :client_id * 100000000000000 + random(0, 99999999999999)
BEGIN ISOLATION LEVEL READ COMMITTED;
select claimed, payload_sha256, handler_version, processed_at is not null as processed,
       response_status, response_header_names, response_header_values, response_body
from tower_inbox_claim('credits', 'bench', '', :key,
    '2f0c6a7a3ac4b3b35e0c8c4e1b7d3f4a9a1e5c2d6b8f0e1a2c3d4e5f6a7b8c9d', '1', 2000);
insert into credit_account (account_id, balance) values (:aid, 1)
on conflict (account_id) do update set balance = credit_account.balance + excluded.balance
returning balance \gset
insert into credit_ledger
    (account_id, delta, balance_after, consumer_name, producer_name, message_id)
values (:aid, 1, :balance, 'credits', 'bench', :key);
with recovered as (
    update inbox_quarantine
    set recovered_at = now(),
        decision = coalesce(decision, 'repair'),
        decided_by = coalesce(decided_by, 'tower-inbox'),
        decided_at = coalesce(decided_at, now()),
        decision_reason = coalesce(decision_reason, 'a later attempt committed')
    where item_key = E'handler-failure\x3acredits\x1fbench\x1f\x1f' || :key::text and recovered_at is null
    returning 1
)
update consumer_inbox
set processed_at = now(), response_status = 201,
    response_header_names = '{content-type}',
    response_header_values = array['application/json'::bytea],
    response_body = '\x7b226163636f756e745f6964223a22616363742d31323334222c2262616c616e6365223a34322c2264656c7461223a317d'::bytea
where consumer_name = 'credits' and producer_name = 'bench' and tenant_id = '' and message_id = :key
returning (select count(*) from recovered);
COMMIT;
