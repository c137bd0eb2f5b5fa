-- tower-inbox: the inbox of claimed commands and their recorded responses.
--
-- The tables live in whatever schema comes first on the connection's search_path; to keep
-- them apart from the application's, give the pool `options=-csearch_path=inbox,public`.

create table consumer_inbox (
    consumer_name   text        not null,
    producer_name   text        not null,
    -- '' when the producer has no tenant: a primary key column cannot be null.
    tenant_id       text        not null default '',
    message_id      text        not null,
    payload_sha256  text        not null check (length(payload_sha256) = 64),
    handler_version text        not null,
    received_at     timestamptz not null default now(),
    -- Null only inside the claiming transaction: claim and record commit together, so a
    -- committed row always has it. A later consumer that records separately may leave it null.
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
-- a quarantine item (next migration).
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

-- Claims a message inside the caller's transaction.
--
-- One round trip does three things the caller would otherwise send separately: bound the
-- wait for an in-flight original (lock_timeout, restored afterwards so the handler's own
-- statements keep the session's setting), try the insert, and on conflict read the row that
-- won. The insert, not a prior select, is the concurrency control: a concurrent claim of the
-- same key blocks on the primary key until the original commits (we then read its row) or
-- rolls back (we then own the claim). Waiting longer than p_wait_ms raises 55P03.
create function tower_inbox_claim(
    p_consumer text,
    p_producer text,
    p_tenant text,
    p_message_id text,
    p_payload_sha256 text,
    p_handler_version text,
    p_wait_ms integer
) returns table (
    claimed boolean,
    payload_sha256 text,
    handler_version text,
    processed_at timestamptz,
    response_status smallint,
    response_header_names text[],
    response_header_values bytea[],
    response_body bytea
)
language plpgsql
as $$
#variable_conflict use_column
declare
    previous_lock_timeout text := current_setting('lock_timeout');
begin
    -- lock_timeout = 0 would mean "wait forever"; a zero wait means "do not wait".
    perform set_config('lock_timeout', greatest(p_wait_ms, 1)::text || 'ms', true);
    -- A row that won the race can disappear before we read it (a purge); then try again.
    for attempt in 1..3 loop
        insert into consumer_inbox as i
            (consumer_name, producer_name, tenant_id, message_id, payload_sha256, handler_version)
        values
            (p_consumer, p_producer, p_tenant, p_message_id, p_payload_sha256, p_handler_version)
        on conflict do nothing;
        if found then
            perform set_config('lock_timeout', previous_lock_timeout, true);
            return query select true, p_payload_sha256, p_handler_version,
                null::timestamptz, null::smallint, null::text[], null::bytea[], null::bytea;
            return;
        end if;
        return query
            select false, i.payload_sha256, i.handler_version, i.processed_at,
                   i.response_status, i.response_header_names, i.response_header_values,
                   i.response_body
            from consumer_inbox i
            where i.consumer_name = p_consumer
              and i.producer_name = p_producer
              and i.tenant_id = p_tenant
              and i.message_id = p_message_id;
        if found then
            perform set_config('lock_timeout', previous_lock_timeout, true);
            return;
        end if;
    end loop;
    raise exception 'tower-inbox: claim of % kept conflicting with a vanishing row', p_message_id
        using errcode = '40001';
end
$$;
