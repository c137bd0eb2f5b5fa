-- tower-inbox: the claim-at-commit mode. The business statements run first; this function
-- is the transaction's last statement before COMMIT: it inserts the inbox row together with
-- the recorded response, so the claim and the record are one statement.
--
-- As in tower_inbox_claim, the primary key is the concurrency control: a concurrent
-- transaction that holds an uncommitted row for the same key makes the insert wait (bounded
-- by p_wait_ms, then 55P03) until it commits (we then read its row: our transaction must
-- roll back) or rolls back (we then own the claim). Under REPEATABLE READ and SERIALIZABLE
-- a conflicting row committed after our snapshot raises 40001 instead, and the caller
-- re-runs the whole transaction.
--
-- On success it also marks the quarantine item about earlier failed attempts of this
-- command (key p_item_key) recovered, and returns how many it marked.
create function tower_inbox_claim_at_commit(
    p_consumer text,
    p_producer text,
    p_tenant text,
    p_message_id text,
    p_payload_sha256 text,
    p_handler_version text,
    p_wait_ms integer,
    p_response_status smallint,
    p_response_header_names text[],
    p_response_header_values bytea[],
    p_response_body bytea,
    p_item_key text
) returns table (
    claimed boolean,
    recovered bigint,
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
    marked bigint;
begin
    perform set_config('lock_timeout', greatest(p_wait_ms, 1)::text || 'ms', true);
    -- A row that won the race can disappear before we read it (a purge); then try again.
    for attempt in 1..3 loop
        insert into consumer_inbox as i
            (consumer_name, producer_name, tenant_id, message_id, payload_sha256,
             handler_version, processed_at, response_status, response_header_names,
             response_header_values, response_body)
        values
            (p_consumer, p_producer, p_tenant, p_message_id, p_payload_sha256,
             p_handler_version, clock_timestamp(), p_response_status,
             p_response_header_names, p_response_header_values, p_response_body)
        on conflict do nothing;
        if found then
            perform set_config('lock_timeout', previous_lock_timeout, true);
            update inbox_quarantine q
            set recovered_at = now(),
                decision = coalesce(q.decision, 'repair'),
                decided_by = coalesce(q.decided_by, 'tower-inbox'),
                decided_at = coalesce(q.decided_at, now()),
                decision_reason = coalesce(q.decision_reason, 'a later attempt committed')
            where q.item_key = p_item_key and q.recovered_at is null;
            get diagnostics marked = row_count;
            return query select true, marked, p_payload_sha256, p_handler_version,
                null::timestamptz, null::smallint, null::text[], null::bytea[], null::bytea;
            return;
        end if;
        return query
            select false, 0::bigint, i.payload_sha256, i.handler_version, i.processed_at,
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
