#!/usr/bin/env bash
# PostgreSQL's own work per transaction of the pgbench scripts beside this one, as a count of
# instructions, which the machine's noise does not change (run.sh's tps and CPU time move by
# several percent between runs; these counts by about 1%). A private cluster runs under
# valgrind's callgrind; each script runs twice with one client, N1 and then N2 transactions
# (defaults 50 and 350), each on a fresh connection from the same reset tables, and the
# count is the difference of the two backends' totals over N2 - N1: the connection's start,
# the statements' first plans and the tables' first reads cancel out. Only the backend is
# counted: neither pgbench, nor the kernel (sockets, WAL writes), nor other backends.
#
#   benches/pgbench/instructions.sh                   # the minimal and the layer's scripts
#   N1=50 N2=350 benches/pgbench/instructions.sh layer_first_seen minimal_first_seen
#
# Prints one line per script: its name and the instructions per transaction. Needs valgrind,
# pgbench, psql and PostgreSQL's server binaries (on PATH or in `pg_config --bindir`); run as
# root, the cluster runs as the postgres user. About a minute per script. The cluster and
# its callgrind files are left in a temporary directory, named in the output, for
# callgrind_annotate (`--inclusive=yes` shows where the instructions go).
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
n1="${N1:-50}"
n2="${N2:-350}"
port="${PORT:-5499}"
scripts=("$@")
[ "${#scripts[@]}" -gt 0 ] || scripts=(minimal_first_seen layer_first_seen minimal_at_commit layer_at_commit)
for script in "${scripts[@]}"; do
    [ -f "$here/$script.sql" ] || { echo "instructions.sh: no script $here/$script.sql" >&2; exit 2; }
done
[ "$n2" -gt "$n1" ] || { echo "instructions.sh: N2 ($n2) must be greater than N1 ($n1)" >&2; exit 2; }
for tool in valgrind pgbench psql; do
    command -v "$tool" >/dev/null || { echo "instructions.sh: $tool is not on PATH" >&2; exit 1; }
done
bindir="$(dirname "$(command -v initdb 2>/dev/null || echo "$(pg_config --bindir 2>/dev/null)/initdb")")"
[ -x "$bindir/initdb" ] && [ -x "$bindir/postgres" ] ||
    { echo "instructions.sh: no initdb and postgres on PATH or in pg_config --bindir" >&2; exit 1; }

work="$(mktemp -d "${TMPDIR:-/tmp}/tower-inbox-pg-instructions.XXXXXX")"
as_owner=()
if [ "$(id -u)" = 0 ]; then
    # PostgreSQL refuses to run as root.
    chown postgres "$work"
    as_owner=(runuser -u postgres --)
fi
"${as_owner[@]}" "$bindir/initdb" -D "$work/data" -A trust -U postgres >"$work/initdb.log"
server_pid=""
stop() {
    [ -n "$server_pid" ] || return 0
    "${as_owner[@]}" "$bindir/pg_ctl" -D "$work/data" stop -m fast >/dev/null 2>&1 || true
}
trap stop EXIT
trap 'exit 130' INT TERM
# Every backend is a fork of the postmaster under valgrind and writes its own callgrind file
# when it exits; the log names the pid of pgbench's backend.
"${as_owner[@]}" valgrind --tool=callgrind --callgrind-out-file="$work/callgrind.%p" \
    "$bindir/postgres" -D "$work/data" -p "$port" -k "$work" -c listen_addresses=127.0.0.1 \
    -c autovacuum=off -c log_connections=on -c "log_line_prefix=%p " \
    >"$work/server.log" 2>&1 &
server_pid=$!
server="postgresql://postgres@127.0.0.1:$port"
for _ in $(seq 1 120); do
    psql "$server/postgres" -qAtc 'select 1' >/dev/null 2>&1 && break
    sleep 1
done
psql "$server/postgres" -qAtc 'select 1' >/dev/null ||
    { echo "instructions.sh: the cluster under valgrind did not start (see $work/server.log)" >&2; exit 1; }

db="$server/tower_inbox_pgbench"
# shellcheck source=benches/pgbench/common.sh
source "$here/common.sh"
create_database "$server/postgres" tower_inbox_pgbench "$db"
rows=10000
# As run.sh resets them, with fewer recorded rows and no checkpoint (valgrind is slow).
reset() { reset_tables "$db" "$rows" no-checkpoint; }

# Instructions of the backend that ran `script` for `n` transactions.
count() {
    local script="$1" n="$2" before pid file total
    reset
    before="$(wc -l <"$work/server.log")"
    pgbench -M prepared -n -c 1 -t "$n" -D rows="$rows" "${values[@]}" -f "$here/$script.sql" "$db" \
        >"$work/pgbench.log" 2>&1 ||
        { cat "$work/pgbench.log" >&2; echo "instructions.sh: pgbench failed on $script.sql" >&2; exit 1; }
    pid="$(tail -n "+$((before + 1))" "$work/server.log" |
        sed -nE 's/^([0-9]+) LOG: +connection authorized: .*application_name=pgbench.*/\1/p' | tail -n 1)"
    [ -n "$pid" ] || { echo "instructions.sh: pgbench's backend is not in $work/server.log" >&2; exit 1; }
    file="$work/callgrind.$pid"
    for _ in $(seq 1 60); do
        total="$(sed -nE 's/^summary: ([0-9]+).*/\1/p' "$file" 2>/dev/null || true)"
        [ -n "$total" ] && break
        sleep 1
    done
    [ -n "$total" ] || { echo "instructions.sh: no callgrind summary in $file" >&2; exit 1; }
    echo "$total"
}

echo "instructions.sh: cluster and callgrind files in $work" >&2
for script in "${scripts[@]}"; do
    a="$(count "$script" "$n1")"
    b="$(count "$script" "$n2")"
    echo "$script $(( (b - a) / (n2 - n1) ))"
done
