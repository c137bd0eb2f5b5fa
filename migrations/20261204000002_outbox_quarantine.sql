-- tower-inbox: the transactional outbox and the quarantine of poison messages.

-- Effects written in the handler's transaction and delivered later by a dispatcher.
create table message_outbox (
    -- Stable: derived from the message identity and the effect name, so one command can
    -- never produce two effects; also the idempotency key sent to the receiver.
    effect_id       text        primary key,
    effect_name     text        not null,
    consumer_name   text,
    producer_name   text,
    tenant_id       text,
    message_id      text,
    destination     text        not null,
    payload         bytea       not null,
    header_names    text[]      not null default '{}',
    header_values   text[]      not null default '{}',
    status          text        not null default 'pending'
                                check (status in ('pending', 'delivered', 'dead')),
    attempts        integer     not null default 0,
    -- While leased this is the lease deadline, so an expired lease is simply due again.
    next_attempt_at timestamptz not null default now(),
    lease_owner     text,
    lease_until     timestamptz,
    last_error      text,
    remote_status   integer,
    remote_result   text,
    created_at      timestamptz not null default now(),
    delivered_at    timestamptz
);

-- The dispatcher's "due and not leased" scan touches only pending rows.
create index message_outbox_due on message_outbox (next_attempt_at) where status = 'pending';

-- Wakes dispatchers when effects commit (NOTIFY is delivered at commit, never for a
-- rollback). Its search_path is pinned: nothing on the caller's path can stand in for
-- pg_notify.
create function tower_inbox_outbox_notify() returns trigger
language plpgsql
set search_path = pg_catalog
as $$
begin
    perform pg_catalog.pg_notify('tower_inbox_outbox', '');
    return null;
end
$$;

create trigger message_outbox_notify_insert
    after insert on message_outbox
    for each statement execute function tower_inbox_outbox_notify();

-- A repaired effect is due again at once. Leases and retries do not notify: leasing would
-- wake every dispatcher for nothing, and retries are due later (dispatchers sleep until the
-- next due time).
create trigger message_outbox_notify_requeue
    after update of status on message_outbox
    for each row when (old.status <> 'pending' and new.status = 'pending')
    execute function tower_inbox_outbox_notify();

-- Poison messages and conflicts: kept, visible, and decided on by a person.
create table inbox_quarantine (
    id               bigint      generated always as identity primary key,
    source           text        not null
                                 check (source in ('identity-conflict', 'handler-failure',
                                                   'dead-effect', 'expired-message')),
    -- What the item is about, one per source: the identity (and conflicting hash), or the effect.
    item_key         text        not null,
    consumer_name    text,
    producer_name    text,
    tenant_id        text,
    message_id       text,
    effect_id        text,
    payload_sha256   text        not null,
    -- Where the payload can be found by someone allowed to read it; the payload itself is
    -- not copied here.
    payload_ref      text        not null,
    reason_code      text        not null,
    attempts         integer     not null default 1,
    first_failed_at  timestamptz not null default now(),
    last_failed_at   timestamptz not null default now(),
    handler_version  text,
    decision         text        check (decision in ('repair', 'discard')),
    decided_by       text,
    decided_at       timestamptz,
    decision_reason  text,
    recovered_at     timestamptz
);

-- One open item per thing: a recurrence updates it; after a decision a new one opens.
create unique index inbox_quarantine_open on inbox_quarantine (item_key) where decision is null;
create index inbox_quarantine_undecided on inbox_quarantine (first_failed_at) where decision is null;
-- A later success marks the item recovered; the commit path looks it up by key.
create index inbox_quarantine_unrecovered on inbox_quarantine (item_key) where recovered_at is null;
