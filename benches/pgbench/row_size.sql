-- Bytes per inbox row: 100 000 rows as the layer writes them (the claim inserts, the record
-- updates, one transaction each), then the table and index sizes. docs/scaling.md has the
-- results. Run from the repository root; it drops and creates the database
-- tower_inbox_rowsize:  psql "$SERVER_URL" -f benches/pgbench/row_size.sql
drop database if exists tower_inbox_rowsize;
create database tower_inbox_rowsize;
\c tower_inbox_rowsize
create schema tower_inbox;
set search_path = tower_inbox;
\i migrations/20261204000001_inbox.sql
\i migrations/20261204000002_outbox_quarantine.sql
\i migrations/20261204000003_retention.sql
set search_path = public;
-- one transaction per command, as the layer does: the claim's insert, then the record's update
set synchronous_commit = off;
do $$
declare k text;
begin
  for g in 1..100000 loop
    k := gen_random_uuid()::text;
    insert into tower_inbox.consumer_inbox
      (consumer_name, producer_name, tenant_id, message_id, payload_sha256, handler_version)
    values ('credits', 'mobile-app', '', k, encode(sha256(k::bytea), 'hex'), '1');
    update tower_inbox.consumer_inbox
       set processed_at = clock_timestamp(), response_status = 201,
           response_header_names = '{content-type}',
           response_header_values = array['application/json'::bytea],
           response_body = convert_to(format('{"account_id":"acct-%s","balance":%s,"delta":%s,"ledger_id":%s}',
                                              (random()*100000)::int, (random()*1e6)::int, (random()*1000)::int, (random()*1e9)::bigint), 'UTF8')
     where consumer_name = 'credits' and producer_name = 'mobile-app' and tenant_id = ''
       and message_id = k;
    commit;
  end loop;
end $$;
vacuum analyze tower_inbox.consumer_inbox;
select count(*) as rows,
       pg_relation_size('tower_inbox.consumer_inbox') as heap,
       pg_indexes_size('tower_inbox.consumer_inbox') as indexes,
       pg_total_relation_size('tower_inbox.consumer_inbox') as total,
       round(pg_total_relation_size('tower_inbox.consumer_inbox')::numeric / count(*)) as bytes_per_row,
       round(avg(pg_column_size(i.*))) as avg_tuple,
       round(avg(length(response_body))) as avg_body
from tower_inbox.consumer_inbox i;
select indexrelid::regclass as index, pg_relation_size(indexrelid) as bytes
from pg_index where indrelid = 'tower_inbox.consumer_inbox'::regclass;
select n_tup_upd, n_tup_hot_upd from pg_stat_user_tables where relname = 'consumer_inbox';
