# Shared by run.sh and instructions.sh (sourced): the tables every run starts from, and the
# values the layer binds.
# shellcheck shell=bash

pgbench_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

# Creates the database named $2 (dropping it first) on the server whose maintenance database
# is at URL $1, reached at URL $3: the crate's migrations in the schema tower_inbox, and the
# example's tables.
create_database() {
    local maintenance="$1" name="$2" url="$3" migration
    psql "$maintenance" -q -v ON_ERROR_STOP=1 -c "drop database if exists $name with (force)"
    psql "$maintenance" -q -v ON_ERROR_STOP=1 -c "create database $name"
    psql "$url" -q -v ON_ERROR_STOP=1 -c "create schema tower_inbox"
    # The migrations name no schema: run them with the inbox schema alone on the search_path,
    # as tower_inbox::migrate does.
    for migration in "$pgbench_root"/migrations/*.sql; do
        PGOPTIONS="-c search_path=tower_inbox" \
            psql "$url" -q -v ON_ERROR_STOP=1 --single-transaction -f "$migration"
    done
    psql "$url" -q -v ON_ERROR_STOP=1 -f "$pgbench_root/examples/credits/schema.sql"
}

# Empties the tables of the database at URL $1 and fills them again: 10 000 accounts at 0
# and $2 recorded responses, then VACUUM ANALYZE, and a CHECKPOINT unless $3 is
# "no-checkpoint" (a cluster under valgrind takes long over it).
reset_tables() {
    local url="$1" rows="$2" checkpoint="checkpoint;"
    [[ "${3:-}" == no-checkpoint ]] && checkpoint=""
    psql "$url" -q -v ON_ERROR_STOP=1 >/dev/null <<SQL
truncate credit_ledger, credit_account, tower_inbox.consumer_inbox,
         tower_inbox.consumer_inbox_failure, tower_inbox.inbox_quarantine restart identity;
insert into credit_account (account_id, balance) select g::text, 0 from generate_series(0, 9999) g;
insert into tower_inbox.consumer_inbox
    (consumer_name, producer_name, tenant_id, message_id, payload_sha256, handler_version,
     processed_at, response_status, response_header_names, response_header_values, response_body)
select 'credits', 'bench', 't', g::text,
       '2f0c6a7a3ac4b3b35e0c8c4e1b7d3f4a9a1e5c2d6b8f0e1a2c3d4e5f6a7b8c9d', '1',
       now(), 201, '{content-type}', array['application/json'::bytea],
       convert_to('{"account_id":"acct-' || g % 10000 || '","balance":42,"delta":1}', 'UTF8')
from generate_series(1, $rows) g;
vacuum analyze;
$checkpoint
SQL
}

# The values the layer binds, as the credits example would (with a tenant: pgbench takes no
# empty value), as pgbench's -D options: names as bytea (text input of plain ASCII is its
# bytes), the recorded response, and a quarantine key no item has.
# shellcheck disable=SC2034 # used by the scripts that source this file
values=(
    -D consumer=credits -D producer=bench -D tenant=t -D version=1
    -D sha=2f0c6a7a3ac4b3b35e0c8c4e1b7d3f4a9a1e5c2d6b8f0e1a2c3d4e5f6a7b8c9d
    -D status=201 -D 'header_names={content-type}' -D 'header_values={application/json}'
    -D 'body={"account_id":"acct-1234","balance":42,"delta":1}'
    -D item=handler-failure:credits-bench
)
