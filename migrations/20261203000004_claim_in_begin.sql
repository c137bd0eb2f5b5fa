-- tower-inbox: the claim as the second statement of the BEGIN message
-- ("BEGIN ISOLATION LEVEL ...; select tower_inbox_claim_or_raise(...)", a simple query whose
-- values are escape-string literals, see src/inbox/literal.rs; the record message of
-- 20261203000003 is written the same way now), so that opening the transaction and claiming
-- cost one round trip, not two.
-- A simple query sent as the transaction's BEGIN returns no rows to the caller, so the outcome
-- travels as success or error: claimed, or SQLSTATE TICL1 when the key is already held by a
-- committed row (the caller then rolls back and reads that row), or 55P03 when another
-- transaction still holds it after the wait. An error is the only answer a BEGIN's message
-- can give, so the server logs each such duplicate as an ERROR (with the statement, under the
-- default log_min_error_statement); the README says how to keep that quiet.
create function tower_inbox_claim_or_raise(
    p_consumer text,
    p_producer text,
    p_tenant text,
    p_message_id text,
    p_payload_sha256 text,
    p_handler_version text,
    p_wait_ms integer
) returns void
language plpgsql
as $$
declare
    previous_lock_timeout text := current_setting('lock_timeout');
begin
    -- lock_timeout = 0 would mean "wait forever"; a zero wait means "do not wait".
    perform set_config('lock_timeout', greatest(p_wait_ms, 1)::text || 'ms', true);
    insert into consumer_inbox
        (consumer_name, producer_name, tenant_id, message_id, payload_sha256, handler_version)
    values
        (p_consumer, p_producer, p_tenant, p_message_id, p_payload_sha256, p_handler_version)
    on conflict do nothing;
    if not found then
        raise exception 'tower-inbox: the message is already claimed' using errcode = 'TICL1';
    end if;
    perform set_config('lock_timeout', previous_lock_timeout, true);
end
$$;
