-- tower-inbox: what the retention purge needs on top of purge.sql when the schema has the
-- partitioned layout. Creating and dropping partitions takes the tables' owner, so the purge
-- calls SECURITY DEFINER functions that do only that, on this schema's inbox and outbox
-- alone. The dry run and the purge list the partitions with inbox_partitions and
-- outbox_partitions. The default partitions are purged in batches by name (a partition is a
-- table of its own for privileges: the parent's grants do not reach a statement that names
-- it); their locking scans (FOR UPDATE SKIP LOCKED) need UPDATE.
grant execute on function {schema}.inbox_create_partitions(interval, timestamptz, integer),
                          {schema}.inbox_drop_partition(text, timestamptz),
                          {schema}.inbox_partitions(),
                          {schema}.outbox_create_partitions(interval, timestamptz, integer),
                          {schema}.outbox_drop_partition(text, timestamptz),
                          {schema}.outbox_partitions()
    to {role};
grant select, update, delete on {schema}.consumer_inbox_default, {schema}.message_outbox_default
    to {role};
