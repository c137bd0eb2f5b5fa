-- tower-inbox: the record step as functions, so that recording and COMMIT travel in one
-- message (a simple query "select tower_inbox_...(...); commit; begin") instead of two
-- round trips. The arguments arrive as hex literals decoded on the server, never as SQL text
-- built from request data.

-- Claim first: records the response on the row the transaction claimed, and marks the
-- quarantine item about earlier failed attempts (key p_item_key) recovered. A claimed row
-- that is not there means the claim is not this transaction's: raise, so the COMMIT that
-- follows in the same message is never reached and nothing commits.
create function tower_inbox_record(
    p_consumer text,
    p_producer text,
    p_tenant text,
    p_message_id text,
    p_response_status smallint,
    p_response_header_names text[],
    p_response_header_values bytea[],
    p_response_body bytea,
    p_item_key text
) returns bigint
language plpgsql
as $$
declare
    marked bigint;
begin
    update consumer_inbox
    set processed_at = clock_timestamp(), response_status = p_response_status,
        response_header_names = p_response_header_names,
        response_header_values = p_response_header_values, response_body = p_response_body
    where consumer_name = p_consumer and producer_name = p_producer and tenant_id = p_tenant
      and message_id = p_message_id;
    if not found then
        raise exception 'tower-inbox: the claimed row of % is missing', p_message_id
            using errcode = 'XX000';
    end if;
    update inbox_quarantine q
    set recovered_at = now(),
        decision = coalesce(q.decision, 'repair'),
        decided_by = coalesce(q.decided_by, 'tower-inbox'),
        decided_at = coalesce(q.decided_at, now()),
        decision_reason = coalesce(q.decision_reason, 'a later attempt committed')
    where q.item_key = p_item_key and q.recovered_at is null;
    get diagnostics marked = row_count;
    return marked;
end
$$;

-- Claim at commit: tower_inbox_claim_at_commit, but a key claimed by another transaction
-- raises (SQLSTATE TIAC1) instead of answering, so that the COMMIT that follows in the same
-- message is never reached: the business writes roll back with the failed claim. The caller
-- then reads the winning row outside the transaction.
create function tower_inbox_claim_at_commit_or_abort(
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
) returns bigint
language plpgsql
as $$
declare
    previous_lock_timeout text := current_setting('lock_timeout');
    marked bigint;
begin
    perform set_config('lock_timeout', greatest(p_wait_ms, 1)::text || 'ms', true);
    insert into consumer_inbox
        (consumer_name, producer_name, tenant_id, message_id, payload_sha256,
         handler_version, processed_at, response_status, response_header_names,
         response_header_values, response_body)
    values
        (p_consumer, p_producer, p_tenant, p_message_id, p_payload_sha256,
         p_handler_version, clock_timestamp(), p_response_status,
         p_response_header_names, p_response_header_values, p_response_body)
    on conflict do nothing;
    if not found then
        raise exception 'tower-inbox: % was claimed by another transaction', p_message_id
            using errcode = 'TIAC1';
    end if;
    perform set_config('lock_timeout', previous_lock_timeout, true);
    update inbox_quarantine q
    set recovered_at = now(),
        decision = coalesce(q.decision, 'repair'),
        decided_by = coalesce(q.decided_by, 'tower-inbox'),
        decided_at = coalesce(q.decided_at, now()),
        decision_reason = coalesce(q.decision_reason, 'a later attempt committed')
    where q.item_key = p_item_key and q.recovered_at is null;
    get diagnostics marked = row_count;
    return marked;
end
$$;
