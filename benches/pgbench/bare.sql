-- bare: the credit without the layer, as POST /baseline/accounts/{id}/credits sends it
-- (examples/credits/app.rs, baseline_credit and apply_credit). Run by run.sh with
-- pgbench -M prepared; values that vary per request are pgbench variables (bound
-- parameters), the others literals.
\set aid random(0, 9999)
\set key :client_id * 100000000000000 + random(0, 99999999999999)
BEGIN;
insert into credit_account (account_id, balance) values (:aid, 1)
on conflict (account_id) do update set balance = credit_account.balance + excluded.balance
returning balance \gset
insert into credit_ledger
    (account_id, delta, balance_after, consumer_name, producer_name, message_id)
values (:aid, 1, :balance, 'credits-baseline', 'bench', :key);
COMMIT;
