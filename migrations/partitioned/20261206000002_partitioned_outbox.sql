-- tower-inbox: the partitioned layout's outbox (after 20261206000001, the inbox's).
--
-- message_outbox becomes partitioned by created_at, so the purge drops a partition whose
-- whole range is past the window instead of deleting its rows in batches. A unique key of a
-- partitioned table must include the partition column, so the primary key no longer makes a
-- second row of one effect_id impossible: outbox_enqueue does, with an advisory lock on the
-- effect ID taken in a statement before the insert, and the insert's check for a row of the
-- effect ID in any partition (with the inbox's claim, the same design).
--
-- The partition maintenance of both tables is one set of functions here (create ahead,
-- list, drop keeping rows); the inbox's two functions become wrappers of them.
--
-- Like the others, these statements name no schema: search_path is the inbox schema alone.

-- A layout for a new outbox: converting a populated one would copy every row while holding
-- the table. Refused with a message, not by losing rows. The table is locked first: an
-- enqueue in flight during the check would otherwise commit its row into the table the
-- drop below then takes with it.
lock table message_outbox in access exclusive mode;
do $$
begin
    if exists (select from message_outbox) then
        raise exception 'tower-inbox: the partitioned layout is for an empty outbox'
            using hint = 'deliver or purge the effects first, or migrate into a new schema; see docs/scaling.md';
    end if;
end
$$;

-- The same columns, defaults and checks; the primary key now with the partition column
-- (unique per partition only, see above). It leads with effect_id, so every statement by
-- effect ID (the dispatcher's, the quarantine's, the operator's) probes each partition's
-- primary key.
create table message_outbox_partitioned (
    like message_outbox including defaults including constraints,
    primary key (effect_id, created_at)
) partition by range (created_at);
-- Its indexes and triggers go with it; the trigger function stays.
drop table message_outbox;
alter table message_outbox_partitioned rename to message_outbox;
alter index message_outbox_partitioned_pkey rename to message_outbox_pkey;

comment on table message_outbox is
    'tower-inbox (partitioned by created_at): effects to deliver; outbox_enqueue''s lock on the effect ID keeps one row per effect';

-- Rows no range partition takes: effects enqueued while no partition covers now() (the
-- purger creates them ahead), and rows a partition drop had to keep (pending, dead, or
-- delivered within the window). Purged in batches like the plain outbox.
create table message_outbox_default partition of message_outbox default;

-- The plain table's indexes: the dispatcher's due scan, the purge's walk of delivered rows.
create index message_outbox_due on message_outbox (next_attempt_at) where status = 'pending';
create index message_outbox_delivered_at
    on message_outbox (delivered_at) where status = 'delivered';

-- The plain table's wake-ups. On a partitioned table a statement trigger fires for a
-- statement on the table (every insert names it), and a row trigger is cloned onto each
-- partition, those attached later included (tests/partitioned_outbox.rs checks both wake a
-- dispatcher).
create trigger message_outbox_notify_insert
    after insert on message_outbox
    for each statement execute function tower_inbox_outbox_notify();
create trigger message_outbox_notify_requeue
    after update of status on message_outbox
    for each row when (old.status <> 'pending' and new.status = 'pending')
    execute function tower_inbox_outbox_notify();

-- Writes an effect unless a row of its ID is there, in any partition; whether it wrote it.
--
-- The key's advisory lock (the one-bigint form: a key space apart from the two-int4 one of
-- the inbox's claim locks and of the crate's own) is taken in a statement before the
-- insert, so the insert's snapshot, taken after the lock was granted, sees the row of any
-- enqueue that held the lock before: a VOLATILE function takes a new snapshot for each
-- statement. That holds under READ COMMITTED only (the other levels read the transaction's
-- first snapshot), so the others are refused. A caller may run this in a transaction of its
-- own, so the check is here, not in the crate's settings.
--
-- SECURITY INVOKER, EXECUTE left to PUBLIC: it does only what its caller may do already.
create function outbox_enqueue(
    p_effect_id text, p_effect_name text, p_consumer_name text, p_producer_name text,
    p_tenant_id text, p_message_id text, p_destination text, p_payload bytea,
    p_header_names text[], p_header_values text[])
returns boolean
language plpgsql volatile
set search_path from current
as $$
begin
    if pg_catalog.current_setting('transaction_isolation') <> 'read committed' then
        raise exception 'tower-inbox: the partitioned outbox enqueues at READ COMMITTED only, not %',
                        pg_catalog.upper(pg_catalog.current_setting('transaction_isolation'))
            using errcode = '0A000',
                  hint = 'an enqueue checks for the effect ID with a snapshot taken after its lock, which only READ COMMITTED gives';
    end if;
    -- Schema names hold no '/': the text names one effect of one schema.
    perform pg_catalog.pg_advisory_xact_lock(pg_catalog.hashtextextended(
        pg_catalog.current_schema() || '/' || p_effect_id, 1953066594));
    insert into message_outbox
        (effect_id, effect_name, consumer_name, producer_name, tenant_id, message_id,
         destination, payload, header_names, header_values)
    select p_effect_id, p_effect_name, p_consumer_name, p_producer_name, p_tenant_id,
           p_message_id, p_destination, p_payload, p_header_names, p_header_values
    where not exists (select from message_outbox o where o.effect_id = p_effect_id);
    return found;
end
$$;

-- Partition maintenance runs as the owner of the tables: the SECURITY DEFINER wrappers at
-- the end call these, which EXECUTE is revoked on (callers get no owner's rights through
-- them: they run as their caller). Each finds its own schema, the one it was created in,
-- and names every object with it.

-- The range partitions of `parent` and their bounds, read from their definitions (the
-- default partition has none). The bounds are printed and read back in one DateStyle.
create function partitions_of(parent regclass)
returns table (name text, lower_bound timestamptz, upper_bound timestamptz)
language sql stable
set datestyle to 'ISO, YMD'
begin atomic
    select c.relname::text,
           pg_catalog.substring(pg_catalog.pg_get_expr(c.relpartbound, c.oid),
                                'FROM \(''([^'']*)''\)')::timestamptz,
           pg_catalog.substring(pg_catalog.pg_get_expr(c.relpartbound, c.oid),
                                'TO \(''([^'']*)''\)')::timestamptz
    from pg_catalog.pg_inherits h
    join pg_catalog.pg_class c on c.oid = h.inhrelid
    join pg_catalog.pg_partitioned_table t on t.partrelid = h.inhparent
    where h.inhparent = parent and c.oid <> t.partdefid;
end;

-- Creates the missing partitions of `parent` (partitioned by `part_column`, with its
-- default partition named <parent>_default) of `step` from the one holding `since` (or
-- now(), if later) to `ahead` steps past the one holding now(); ranges are aligned to
-- multiples of `step` since the Unix epoch (UTC), and named <parent>_pYYYYMMDD_HH24MI after
-- their start, with `fill` as their fillfactor. Rows the default partition holds in a new
-- range are moved into it first. Returns how many it created (none if another session is
-- creating or dropping partitions right now).
create function create_partitions(parent text, part_column text, fill integer,
                                  step interval, since timestamptz, ahead integer)
returns integer
language plpgsql
set search_path from current
set datestyle to 'ISO, YMD'
as $$
declare
    schema_name text := pg_catalog.current_schema();
    parent_table regclass := pg_catalog.format('%I.%I', schema_name, parent)::regclass;
    secs double precision := pg_catalog.date_part('epoch', step);
    first_start double precision;
    last_start double precision;
    range_start timestamptz;
    range_end timestamptz;
    part text;
    has_rows boolean;
    created integer := 0;
begin
    first_start := pg_catalog.floor(
        pg_catalog.date_part('epoch', least(since, pg_catalog.now())) / secs) * secs;
    last_start := (pg_catalog.floor(pg_catalog.date_part('epoch', pg_catalog.now()) / secs)
                   + ahead) * secs;
    if secs < 60 or ahead < 0 or (last_start - first_start) / secs >= 10000 then
        raise exception 'tower-inbox: partitions of at least a minute, at most 10000 at once'
            using errcode = '22023';
    end if;
    -- One maintainer at a time (another purger is at it: it does the same).
    if not pg_catalog.pg_try_advisory_xact_lock(1953066594, 2) then
        return 0;
    end if;
    for n in 0 .. ((last_start - first_start) / secs)::integer loop
        range_start := pg_catalog.to_timestamp(first_start + n * secs);
        range_end := pg_catalog.to_timestamp(first_start + (n + 1) * secs);
        part := parent || '_p'
            || pg_catalog.to_char(range_start at time zone 'UTC', 'YYYYMMDD"_"HH24MI');
        -- Skip a range any existing partition overlaps (a step changed between runs).
        continue when exists (
            select from partitions_of(parent_table) p
            where p.lower_bound < range_end and p.upper_bound > range_start);
        execute pg_catalog.format(
            'create table %I.%I (like %I.%I including defaults including constraints) with (fillfactor = %s)',
            schema_name, part, schema_name, parent, fill);
        -- Rows that fell into the default partition for want of this one move into it, so the
        -- attach's check of the default partition finds none. The whole table is locked
        -- first: a claim or enqueue planned before the attach commits would check the
        -- partitions it knew of, the default among them, but not this one, and miss a moved
        -- row of its key. With the lock, it waits and is planned against the new partitions.
        -- A range created ahead is empty and takes no such lock; a row that lands in the
        -- default partition meanwhile makes the attach fail, moving nothing.
        execute pg_catalog.format(
            'select exists (select from %I.%I where %I >= $1 and %I < $2)',
            schema_name, parent || '_default', part_column, part_column)
            into has_rows using range_start, range_end;
        if has_rows then
            execute pg_catalog.format('lock table %I.%I in access exclusive mode',
                                      schema_name, parent);
            execute pg_catalog.format(
                'with moved as (delete from %I.%I where %I >= $1 and %I < $2 returning *) insert into %I.%I select * from moved',
                schema_name, parent || '_default', part_column, part_column, schema_name, part)
                using range_start, range_end;
        end if;
        execute pg_catalog.format(
            'alter table %I.%I attach partition %I.%I for values from (%L) to (%L)',
            schema_name, parent, schema_name, part, range_start, range_end);
        created := created + 1;
    end loop;
    return created;
end
$$;

-- Drops the range partition `part` of `parent` if its whole range ends at or before
-- `cutoff`, keeping the rows (aliased `r`) for which `keep` holds, with the cutoff as `$1`:
-- they are inserted again after the detach, into the default partition. Run it in a
-- transaction whose lock_timeout bounds the wait for the table (detaching waits for the
-- claims or enqueues in flight). Returns the rows dropped and kept; no row when the
-- partition is not one it may drop.
create function drop_partition(parent text, part text, cutoff timestamptz, keep text)
returns table (dropped bigint, kept bigint)
language plpgsql
set search_path from current
set datestyle to 'ISO, YMD'
as $$
declare
    schema_name text := pg_catalog.current_schema();
    range_end timestamptz;
    total bigint;
begin
    -- One maintainer at a time (another purger is at it: it does the same). The partition is
    -- looked up after the lock, so one another purger dropped meanwhile is not found.
    if not pg_catalog.pg_try_advisory_xact_lock(1953066594, 2) then
        return;
    end if;
    select p.upper_bound into range_end
    from partitions_of(pg_catalog.format('%I.%I', schema_name, parent)::regclass) p
    where p.name = part;
    if range_end is null or range_end > cutoff then
        return;
    end if;
    execute pg_catalog.format('alter table %I.%I detach partition %I.%I',
                              schema_name, parent, schema_name, part);
    -- Detached, the partition is the purge's alone: nothing reads or writes it any more.
    -- One scan counts it and what must be kept; a second, only if anything must be, moves
    -- that back into the table, where it lands in the default partition.
    execute pg_catalog.format(
        'select pg_catalog.count(*), pg_catalog.count(*) filter (where %s) from %I.%I r',
        keep, schema_name, part) into total, kept using cutoff;
    if kept > 0 then
        execute pg_catalog.format('insert into %I.%I select * from %I.%I r where %s',
                                  schema_name, parent, schema_name, part, keep) using cutoff;
    end if;
    execute pg_catalog.format('drop table %I.%I', schema_name, part);
    dropped := total - kept;
    return next;
end
$$;

revoke execute on function create_partitions(text, text, integer, interval, timestamptz, integer)
    from public;
revoke execute on function drop_partition(text, text, timestamptz, text) from public;

-- The inbox's maintenance, now through the functions above (the same names, arguments,
-- results and grants as 20261206000001's). What its drop keeps is what the batched purge
-- keeps (src/retention/sql.rs, inbox_expired), negated.
create or replace function inbox_create_partitions(step interval, since timestamptz, ahead integer)
returns integer
language sql security definer
set search_path from current
begin atomic
    select create_partitions('consumer_inbox', 'received_at', 80, step, since, ahead);
end;

create or replace function inbox_drop_partition(part text, cutoff timestamptz)
returns table (dropped bigint, kept bigint)
language plpgsql security definer
set search_path from current
as $$
begin
    return query select * from drop_partition('consumer_inbox', part, cutoff, pg_catalog.format(
        'r.processed_at is null or r.processed_at >= $1 or r.producer_name like ''migration:%%''
         or (r.consumer_name, r.producer_name, r.tenant_id, r.message_id) in (
                select q.consumer_name, q.producer_name, q.tenant_id, q.message_id
                from %I.inbox_quarantine q where q.decision is null)',
        pg_catalog.current_schema()));
end
$$;

-- The outbox's, the same way. A dropped partition keeps every row the batched purge would
-- keep (src/retention/sql.rs, delivered_expired and discarded_expired): pending effects,
-- dead ones not discarded before the cutoff or with an open item, and effects delivered at
-- or after the cutoff. Anything the purge's conditions cannot show purgeable is kept.
create function outbox_partitions()
returns table (name text, lower_bound timestamptz, upper_bound timestamptz)
language sql stable
begin atomic
    select * from partitions_of('message_outbox'::regclass);
end;

create function outbox_create_partitions(step interval, since timestamptz, ahead integer)
returns integer
language sql security definer
set search_path from current
begin atomic
    select create_partitions('message_outbox', 'created_at', 100, step, since, ahead);
end;

create function outbox_drop_partition(part text, cutoff timestamptz)
returns table (dropped bigint, kept bigint)
language plpgsql security definer
set search_path from current
as $$
begin
    return query select * from drop_partition('message_outbox', part, cutoff, pg_catalog.format(
        'not coalesce((r.status = ''delivered'' and r.delivered_at < $1)
             or (r.status = ''dead''
                 and exists (select 1 from %1$I.inbox_quarantine q
                             where q.effect_id = r.effect_id and q.source = ''dead-effect''
                               and q.decision = ''discard'' and q.decided_at < $1)
                 and not exists (select 1 from %1$I.inbox_quarantine q
                                 where q.effect_id = r.effect_id and q.decision is null)),
             false)',
        pg_catalog.current_schema()));
end
$$;

revoke execute on function outbox_partitions() from public;
revoke execute on function outbox_create_partitions(interval, timestamptz, integer) from public;
revoke execute on function outbox_drop_partition(text, timestamptz) from public;
