-- tower-inbox: indexes for the retention purge's scans.
--
-- On a large live table, create these indexes beforehand with CREATE INDEX CONCURRENTLY
-- under the same names: this migration then leaves them as they are (IF NOT EXISTS) instead
-- of blocking writes while it builds them.

-- The inbox purge walks old rows by received_at, which is written once by the claim and
-- never updated, so the record step's update stays HOT. processed_at must stay out of every
-- index, predicates included: the purge filters it without an index.
create index if not exists consumer_inbox_received_at on consumer_inbox (received_at);

-- Failure rows age by their last failure. The failure upsert updates this column, so it is
-- no longer a HOT update; it runs only for attempts that rolled back.
create index if not exists consumer_inbox_failure_last_failed_at
    on consumer_inbox_failure (last_failed_at);

-- Delivered effects age by their delivery. Delivery changes status and so was never HOT.
create index if not exists message_outbox_delivered_at
    on message_outbox (delivered_at) where status = 'delivered';

-- Decided quarantine items age by their decision.
create index if not exists inbox_quarantine_decided_at
    on inbox_quarantine (decided_at) where decision is not null;

-- "Does an open item refer to this inbox or failure row?", asked once per purge candidate.
create index if not exists inbox_quarantine_open_identity
    on inbox_quarantine (consumer_name, producer_name, tenant_id, message_id)
    where decision is null;

-- "Was this dead effect discarded, and is it still open?", asked per dead outbox row.
create index if not exists inbox_quarantine_effect
    on inbox_quarantine (effect_id) where effect_id is not null;
