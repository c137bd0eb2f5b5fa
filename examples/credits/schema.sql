-- The credits example's own tables. A real service keeps these in its migrations.
-- app.rs includes this file; benches/pgbench/run.sh applies it with psql.
create table if not exists credit_account (
    account_id text primary key,
    balance    bigint not null
);
create table if not exists credit_ledger (
    id            bigint generated always as identity primary key,
    account_id    text   not null references credit_account,
    delta         bigint not null,
    balance_after bigint not null,
    consumer_name text   not null,
    producer_name text   not null,
    message_id    text   not null,
    created_at    timestamptz not null default now()
);
