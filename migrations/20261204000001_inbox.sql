-- tower-inbox: the inbox of claimed commands and their recorded responses.
--
-- These statements name no schema: they run with search_path set to the inbox schema alone
-- (tower_inbox::migrate does that, and creates the schema). Every statement the crate sends
-- at run time names the schema itself.

create table consumer_inbox (
    consumer_name   text        not null,
    producer_name   text        not null,
    -- '' when the producer has no tenant: a primary key column cannot be null.
    tenant_id       text        not null default '',
    message_id      text        not null,
    payload_sha256  text        not null check (length(payload_sha256) = 64),
    handler_version text        not null,
    received_at     timestamptz not null default now(),
    -- Null only inside the claiming transaction: the claim and the record commit together,
    -- so a committed row always has it.
    processed_at    timestamptz,
    response_status        smallint,
    response_header_names  text[],
    response_header_values bytea[],
    response_body          bytea,
    primary key (consumer_name, producer_name, tenant_id, message_id)
)
-- Every claimed row is updated exactly once, when its response is recorded. Free space on
-- the page lets that update be HOT (no new index entry). Keep processed_at and the response
-- columns out of every index, or the update stops being HOT.
with (fillfactor = 80);

comment on table consumer_inbox is
    'tower-inbox: one row per claimed command; the primary key serialises concurrent claims';

-- Attempts that rolled back (handler 5xx, panic, client gone). Written in a transaction of
-- its own, so it survives the rollback it describes. Repeated failures of one key also open
-- a quarantine item.
create table consumer_inbox_failure (
    consumer_name   text        not null,
    producer_name   text        not null,
    tenant_id       text        not null default '',
    message_id      text        not null,
    payload_sha256  text        not null,
    handler_version text        not null,
    attempts        integer     not null default 1,
    first_failed_at timestamptz not null default now(),
    last_failed_at  timestamptz not null default now(),
    last_reason     text        not null,
    primary key (consumer_name, producer_name, tenant_id, message_id)
);
