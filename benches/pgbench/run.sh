#!/usr/bin/env bash
# The database's ceiling for the credits service: pgbench runs the statements the credits
# handler and the inbox layer send (the *.sql files beside this script), with nothing else
# around them, and prints tps, the ratio to the bare credit, and the latency at one client.
#
#   benches/pgbench/run.sh                      # 32 clients for 20 s per transaction
#   CLIENTS=64 DURATION=60 benches/pgbench/run.sh
#
# Settings (environment):
#   DATABASE_URL     the server to use (its database is only used to create ours); default
#                    postgresql://postgres@127.0.0.1:5432. A server is required: this script
#                    does not start one (the Rust test support's throwaway cluster is gone
#                    once the tests end).
#   CLIENTS          concurrent clients of the throughput runs (default 32)
#   THREADS          pgbench threads (default 2)
#   DURATION         seconds per throughput run (default 20)
#   ROUNDS           throughput runs per script, interleaved: round 1 runs every script, then
#                    round 2 ..., so that the machine's drift hits every script alike; the
#                    table gives each script's mean (default 3)
#   SINGLE_DURATION  seconds per one-client latency run (default 5)
#   REPLAY_ROWS      recorded rows replay.sql and claim_duplicate.sql read from (default 100000)
#   POSTGRES_PID     the pid of the server's postmaster, when it runs on this machine (e.g. the
#                    first line of its postmaster.pid): the table then also gives the server's
#                    CPU time per transaction of the throughput runs, read from /proc (the
#                    postmaster, its live children, and the children it has reaped). Only
#                    meaningful on a server nothing else uses: a private cluster.
#   SCRIPTS          which scripts, in order (default: bare minimal_first_seen
#                    layer_first_seen layer_first_seen_lookup minimal_at_commit layer_at_commit
#                    replay claim_duplicate
#                    bare@simple minimal_first_seen@simple). A script runs with -M prepared,
#                    or with the mode after its @, and its ratio is to bare run in the same
#                    mode. The minimal_* scripts are the database's ceiling for the protocol;
#                    the layer_* scripts send exactly the layer's statements (a unit test in
#                    src/inbox/sql.rs keeps them equal), so layer / minimal is what the
#                    layer's statements cost beyond the protocol itself.
#
# It drops and recreates the database tower_inbox_pgbench, applies the crate's migrations
# and the example's schema (examples/credits/schema.sql) with psql, and before every run
# resets the tables, reopens 10 000 accounts, records the replay rows, and checkpoints, so
# that each run starts from the same state.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
db=tower_inbox_pgbench
clients="${CLIENTS:-32}"
threads="${THREADS:-2}"
duration="${DURATION:-20}"
rounds="${ROUNDS:-3}"
single_duration="${SINGLE_DURATION:-5}"
replay_rows="${REPLAY_ROWS:-100000}"
read -r -a scripts <<<"${SCRIPTS:-bare minimal_first_seen layer_first_seen layer_first_seen_lookup minimal_at_commit layer_at_commit replay claim_duplicate bare@simple minimal_first_seen@simple}"

for tool in psql pgbench; do
    command -v "$tool" >/dev/null || { echo "run.sh: $tool is not on PATH" >&2; exit 1; }
done

# The server: DATABASE_URL without its database and query, else the local default.
url="${DATABASE_URL:-postgresql://postgres@127.0.0.1:5432}"
base="${url%%\?*}"
query="${url:${#base}}"
if [[ "$base" =~ ^(postgres(ql)?://[^/]*)(/.*)?$ ]]; then
    server="${BASH_REMATCH[1]}"
else
    echo "run.sh: DATABASE_URL must be a postgres:// or postgresql:// URL" >&2
    exit 1
fi
maintenance="$server/postgres$query"
scratch="$server/$db$query"

if ! psql "$maintenance" -qAtc 'select 1' >/dev/null; then
    echo "run.sh: no PostgreSQL at ${server#*@}; start one or set DATABASE_URL" >&2
    exit 1
fi

# shellcheck source=benches/pgbench/common.sh
source "$here/common.sh"

echo "preparing $db on ${server#*@} ($(psql "$maintenance" -qAtc 'show server_version'))" >&2
create_database "$maintenance" "$db" "$scratch"

# Every run starts from the same tables: no ledger, 10 000 accounts at 0, REPLAY_ROWS recorded
# responses, a fresh checkpoint.
reset() { reset_tables "$scratch" "$replay_rows"; }

# A number from pgbench's summary, e.g. `field tps` for "tps = 7412.3 (without ...)".
field() { sed -n "s/^$1 = \([0-9.]*\).*/\1/p" | head -n 1; }

# CPU seconds the server has used so far: its postmaster, every live child, and the children
# it has reaped (a backend that exited). Fields 14-17 of /proc/PID/stat: utime, stime, and
# the reaped children's cutime, cstime; for children, utime and stime only.
server_cpu() {
    local pid="$POSTGRES_PID" ticks total=0 child
    ticks="$(getconf CLK_TCK)"
    total="$(awk '{ sub(/^.*\) /, ""); print $12 + $13 + $14 + $15 }' "/proc/$pid/stat")"
    for child in $(pgrep -P "$pid"); do
        total=$((total + $(awk '{ sub(/^.*\) /, ""); print $12 + $13 }' "/proc/$child/stat" 2>/dev/null || echo 0)))
    done
    awk -v t="$total" -v hz="$ticks" 'BEGIN { printf "%.3f", t / hz }'
}

# Runs one script from a reset database; leaves pgbench's report in $report, and the server's
# CPU seconds during the run in $cpu when POSTGRES_PID is set.
report=""
cpu=""
bench() {
    local script="${1%@*}" mode=prepared n="$2" jobs="$3" seconds="$4"
    [[ "$1" == *@* ]] && mode="${1#*@}"
    reset
    local before=""
    [[ -n "${POSTGRES_PID:-}" ]] && before="$(server_cpu)"
    if ! report="$(pgbench -M "$mode" -n -c "$n" -j "$jobs" -T "$seconds" \
        -D rows="$replay_rows" "${values[@]}" -f "$here/$script.sql" "$scratch" 2>&1)"; then
        echo "$report" >&2
        echo "run.sh: pgbench failed on $script.sql" >&2
        exit 1
    fi
    [[ -n "$before" ]] && cpu="$(awk -v a="$(server_cpu)" -v b="$before" 'BEGIN { print a - b }')"
    return 0
}

declare -A tps latency cpu_us
for round in $(seq 1 "$rounds"); do
    for script in "${scripts[@]}"; do
        echo "round $round: ${script%@*}.sql (-M $([[ "$script" == *@* ]] && echo "${script#*@}" || echo prepared)): $clients clients for ${duration}s" >&2
        bench "$script" "$clients" "$threads" "$duration"
        tps[$script]="$(awk -v sum="${tps[$script]:-0}" -v t="$(field tps <<<"$report")" \
            'BEGIN { print sum + t }')"
        if [[ -n "${POSTGRES_PID:-}" ]]; then
            n="$(sed -n 's/^number of transactions actually processed: \([0-9]*\).*/\1/p' <<<"$report")"
            cpu_us[$script]="$(awk -v sum="${cpu_us[$script]:-0}" -v c="$cpu" -v n="$n" \
                'BEGIN { print sum + c * 1e6 / n }')"
        fi
    done
done
for script in "${scripts[@]}"; do
    tps[$script]="$(awk -v sum="${tps[$script]}" -v n="$rounds" 'BEGIN { print sum / n }')"
    [[ -n "${POSTGRES_PID:-}" ]] &&
        cpu_us[$script]="$(awk -v sum="${cpu_us[$script]}" -v n="$rounds" 'BEGIN { print sum / n }')"
    echo "${script%@*}.sql: 1 client for ${single_duration}s" >&2
    bench "$script" 1 1 "$single_duration"
    latency[$script]="$(field 'latency average' <<<"$report")"
done

bare="${tps[bare]:-}"
echo
cpu_head="" cpu_rule=""
if [[ -n "${POSTGRES_PID:-}" ]]; then
    cpu_head=" server CPU per transaction |" cpu_rule="---|"
fi
echo "| transaction | tps ($clients clients, mean of $rounds) | × bare | latency at 1 client |$cpu_head"
echo "|---|---|---|---|$cpu_rule"
for script in "${scripts[@]}"; do
    ratio="–"
    # A script run in another mode is compared with the bare credit run in that mode.
    base="$bare"
    [[ "$script" == *@* ]] && base="${tps[bare@${script#*@}]:-}"
    if [[ -n "$base" ]]; then
        ratio="$(awk -v a="${tps[$script]}" -v b="$base" 'BEGIN { printf "%.2f", a / b }')"
    fi
    cpu_cell=""
    [[ -n "${POSTGRES_PID:-}" ]] && cpu_cell="$(printf ' %.0f µs |' "${cpu_us[$script]}")"
    printf '| %s | %.0f | %s | %s ms |%s\n' "$script" "${tps[$script]}" "$ratio" "${latency[$script]}" "$cpu_cell"
done
