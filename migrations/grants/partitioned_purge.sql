-- tower-inbox: what the retention purge needs on top of purge.sql when the schema has the
-- partitioned layout. Creating and dropping partitions takes the tables' owner, so the purge
-- calls two SECURITY DEFINER functions that do only that, on this schema's inbox alone. The
-- dry run and the purge list the partitions with inbox_partitions. The default partition
-- is purged in batches by name (a partition is a table of its own for
-- privileges: the parent's grants do not reach a statement that names it); its locking
-- scan (FOR UPDATE SKIP LOCKED) needs UPDATE.
grant execute on function {schema}.inbox_create_partitions(interval, timestamptz, integer),
                          {schema}.inbox_drop_partition(text, timestamptz),
                          {schema}.inbox_partitions()
    to {role};
grant select, update, delete on {schema}.consumer_inbox_default to {role};
