-- tower-inbox: what the service's role needs at run time, and nothing else.
--
-- Not a migration (sqlx skips this directory): tower_inbox::schema::grant_statements reads
-- it, puts the schema and the role in place of {schema} and {role}, both quoted, and splits
-- it into statements. Run them as the tables' owner, after every migration that adds a
-- table. Keep the table list equal to the migrations' tables (a test compares them), minus
-- _sqlx_migrations, which only the owner reads and writes.
--
-- The layer's claim and record, the outbox's enqueue and dispatcher, quarantine decisions,
-- the stats task and the operator's reads insert, read and update these rows; none of them
-- deletes. SELECT ... FOR UPDATE (the dispatcher's lease) needs UPDATE, ON CONFLICT DO
-- UPDATE (the failure record) needs INSERT and UPDATE.
--
-- Not needed, so not granted: the quarantine's identity sequence (an identity column draws
-- from it without a privilege check); EXECUTE on the outbox's trigger function (a trigger
-- runs its function whoever fires it); EXECUTE on the partitioned layout's outbox_enqueue
-- (SECURITY INVOKER, left to PUBLIC: it does only what its caller may); LISTEN and
-- pg_notify (no privilege exists); the advisory lock functions, pg_locks, pg_stat_activity
-- and pg_stats (PUBLIC has them; see the README for pg_read_all_stats).
grant usage on schema {schema} to {role};
grant select, insert, update
    on {schema}.consumer_inbox, {schema}.consumer_inbox_failure,
       {schema}.message_outbox, {schema}.inbox_quarantine
    to {role};
