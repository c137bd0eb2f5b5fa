-- tower-inbox: the partitioned layout (opt in with Layout::Partitioned; applied after the
-- three plain migrations, which it extends: the plain migrator refuses a schema that has it).
--
-- consumer_inbox becomes partitioned by received_at, so the purge drops a partition whose
-- whole range is past the window instead of deleting its rows in batches. A unique key of a
-- partitioned table must include the partition column, so the primary key no longer makes a
-- second row of one identity impossible: the claim's advisory lock on the key, taken in a
-- statement before the claim, and the claim's check for a committed row of the key in any
-- partition do (src/inbox/sql.rs, CLAIM_PARTITIONED).
--
-- Like the others, these statements name no schema: search_path is the inbox schema alone.

-- A layout for a new inbox: converting a populated one would copy every row while holding
-- the table. Refused with a message, not by losing rows. The table is locked first: a claim
-- in flight during the check would otherwise commit its row into the table the drop below
-- then takes with it.
lock table consumer_inbox in access exclusive mode;
do $$
begin
    if exists (select from consumer_inbox) then
        raise exception 'tower-inbox: the partitioned layout is for an empty inbox'
            using hint = 'migrate it into a new schema and move the rows; see docs/scaling.md';
    end if;
end
$$;

-- The same columns, defaults and checks; the primary key now with the partition column
-- (unique per partition only, see above). processed_at stays out of every index, as in the
-- plain table, so recording stays a HOT update.
create table consumer_inbox_partitioned (
    like consumer_inbox including defaults including constraints,
    primary key (consumer_name, producer_name, tenant_id, message_id, received_at)
) partition by range (received_at);
drop table consumer_inbox;
alter table consumer_inbox_partitioned rename to consumer_inbox;
alter index consumer_inbox_partitioned_pkey rename to consumer_inbox_pkey;

comment on table consumer_inbox is
    'tower-inbox (partitioned by received_at): one row per claimed command; the claim lock, taken before the claim, serialises concurrent claims';

-- Rows no range partition takes: claims made while no partition covers now() (the purger
-- creates them ahead), and rows a partition drop had to keep (an open quarantine item, a
-- migration step, a row processed within the window). Purged in batches like the plain
-- inbox. Its rows must not overlap a partition created later, which
-- inbox_create_partitions moves out first. The fillfactor is the plain table's, for the
-- same HOT update.
create table consumer_inbox_default partition of consumer_inbox default
    with (fillfactor = 80);

-- The purge of the default partition walks it by received_at (as the plain purge does).
create index consumer_inbox_received_at on consumer_inbox (received_at);

-- Partition maintenance runs as the owner of the tables (SECURITY DEFINER): only an owner may
-- attach, detach or drop partitions, and the service's role owns nothing. Each function finds
-- its own schema (the one it was created in), names every object with it, and works on that
-- schema's inbox alone; EXECUTE is granted to the purge's role only
-- (migrations/grants/partitioned.sql).

-- The inbox's range partitions and their bounds, read from their definitions (the default
-- partition has none). The bounds are printed and read back in one DateStyle.
create function inbox_partitions()
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
    where h.inhparent = 'consumer_inbox'::regclass and c.relname <> 'consumer_inbox_default';
end;

revoke execute on function inbox_partitions() from public;

-- Creates the missing partitions of `step` from the one holding `since` (or now(), if later)
-- to `ahead` steps past the one holding now(); ranges are aligned to multiples of `step`
-- since the Unix epoch (UTC), and named consumer_inbox_pYYYYMMDD_HH24MI after their start.
-- Rows the default partition holds in a new range are moved into it first. Returns how
-- many it created (none if another session is creating or dropping partitions right now).
create function inbox_create_partitions(step interval, since timestamptz, ahead integer)
returns integer
language plpgsql security definer
set search_path from current
set datestyle to 'ISO, YMD'
as $$
declare
    schema_name text := pg_catalog.current_schema();
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
        part := 'consumer_inbox_p'
            || pg_catalog.to_char(range_start at time zone 'UTC', 'YYYYMMDD"_"HH24MI');
        -- Skip a range any existing partition overlaps (a step changed between runs).
        continue when exists (
            select from inbox_partitions() p
            where p.lower_bound < range_end and p.upper_bound > range_start);
        execute pg_catalog.format(
            'create table %I.%I (like %I.consumer_inbox including defaults including constraints) with (fillfactor = 80)',
            schema_name, part, schema_name);
        -- Rows that fell into the default partition for want of this one move into it, so the
        -- attach's check of the default partition finds none. The whole inbox is locked
        -- first: a claim planned before the attach commits would check the partitions it
        -- knew of, the default among them, but not this one, and miss a moved row of its
        -- key. With the lock, a claim waits and is planned against the new partitions. A
        -- range created ahead is empty and takes no such lock; a row that lands in the
        -- default partition meanwhile makes the attach fail, moving nothing.
        execute pg_catalog.format(
            'select exists (select from %I.consumer_inbox_default where received_at >= $1 and received_at < $2)',
            schema_name) into has_rows using range_start, range_end;
        if has_rows then
            execute pg_catalog.format('lock table %I.consumer_inbox in access exclusive mode',
                                      schema_name);
            execute pg_catalog.format(
                'with moved as (delete from %I.consumer_inbox_default where received_at >= $1 and received_at < $2 returning *) insert into %I.%I select * from moved',
                schema_name, schema_name, part) using range_start, range_end;
        end if;
        execute pg_catalog.format(
            'alter table %I.consumer_inbox attach partition %I.%I for values from (%L) to (%L)',
            schema_name, schema_name, part, range_start, range_end);
        created := created + 1;
    end loop;
    return created;
end
$$;

-- Drops the range partition `part` of this schema's inbox if its whole range ends at or
-- before `cutoff`, keeping the rows the batched purge would keep (processed at or after the
-- cutoff, a migration step, or referred to by an open quarantine item): they are inserted
-- again after the detach, into the default partition. Run it in a transaction whose
-- lock_timeout bounds the wait for the table (detaching waits for the claims in flight).
-- Returns the rows dropped and kept; no row when the partition is not one it may drop.
create function inbox_drop_partition(part text, cutoff timestamptz)
returns table (dropped bigint, kept bigint)
language plpgsql security definer
set search_path from current
set datestyle to 'ISO, YMD'
as $$
declare
    schema_name text := pg_catalog.current_schema();
    range_end timestamptz;
    total bigint;
    -- What the batched purge keeps (src/retention/sql.rs, inbox_expired), negated.
    keep text := pg_catalog.format(
        'i.processed_at is null or i.processed_at >= $1 or i.producer_name like ''migration:%%''
         or (i.consumer_name, i.producer_name, i.tenant_id, i.message_id) in (
                select q.consumer_name, q.producer_name, q.tenant_id, q.message_id
                from %I.inbox_quarantine q where q.decision is null)', schema_name);
begin
    -- One maintainer at a time (another purger is at it: it does the same). The partition is
    -- looked up after the lock, so one another purger dropped meanwhile is not found.
    if not pg_catalog.pg_try_advisory_xact_lock(1953066594, 2) then
        return;
    end if;
    select p.upper_bound into range_end from inbox_partitions() p where p.name = part;
    if range_end is null or range_end > cutoff then
        return;
    end if;
    execute pg_catalog.format('alter table %I.consumer_inbox detach partition %I.%I',
                              schema_name, schema_name, part);
    -- Detached, the partition is the purge's alone: no claim reads or writes it any more.
    -- One scan counts it and what must be kept; a second, only if anything must be, moves
    -- that back into the inbox, where it lands in the default partition.
    execute pg_catalog.format(
        'select pg_catalog.count(*), pg_catalog.count(*) filter (where %s) from %I.%I i',
        keep, schema_name, part) into total, kept using cutoff;
    if kept > 0 then
        execute pg_catalog.format('insert into %I.consumer_inbox select * from %I.%I i where %s',
                                  schema_name, schema_name, part, keep) using cutoff;
    end if;
    execute pg_catalog.format('drop table %I.%I', schema_name, part);
    dropped := total - kept;
    return next;
end
$$;

revoke execute on function inbox_create_partitions(interval, timestamptz, integer) from public;
revoke execute on function inbox_drop_partition(text, timestamptz) from public;
