#!/usr/bin/env bash
# Where one route's CPU goes, per request: starts the credits example (with its baseline
# route), loads one route with the load generator, samples every CPU with `perf record -a -g`
# meanwhile, and prints the microseconds per request spent by the service, PostgreSQL and the
# load generator, and inside PostgreSQL by what it was doing (PL/pgSQL, parse and plan,
# commit, reading the socket, ...). A frame counts once per sample, and the groups overlap
# where the work nests (PL/pgSQL runs inside the executor), so they do not add up to the total.
# Only functions the server binary exports a symbol for can be told apart.
#
#   benches/profile.sh baseline 10     # the credit without the layer, 10 s of samples
#   benches/profile.sh layered 10      # the same credit through the layer
#   CREDITS_CLAIM_AT_COMMIT=1 benches/profile.sh layered 10
#
# Needs perf (with permission to sample every CPU: root, or kernel.perf_event_paranoid <= -1)
# and python3; PostgreSQL as the example finds it (DATABASE_URL or the local default). Run the
# two routes one after the other and compare: on a shared machine, repeat both.
set -euo pipefail
cd "$(dirname "$0")/.."

route="${1:-}"
seconds="${2:-10}"
if [[ "$route" != baseline && "$route" != layered ]]; then
    sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
for tool in perf python3; do
    command -v "$tool" >/dev/null || { echo "profile.sh: $tool is not on PATH" >&2; exit 1; }
done

cargo build --release --example credits --example loadgen
target_dir="${CARGO_TARGET_DIR:-target}"
work="$(mktemp -d "${TMPDIR:-/tmp}/tower-inbox-profile.XXXXXX")"
server_pid=""
cleanup() {
    if [ -n "$server_pid" ]; then
        kill -INT "$server_pid" 2>/dev/null || true
        wait "$server_pid" 2>/dev/null || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT

CREDITS_BASELINE_ROUTE=1 BIND_ADDR=127.0.0.1:0 NO_COLOR=1 RUST_LOG=warn,credits=info \
    "$target_dir/release/examples/credits" >"$work/server.log" 2>&1 &
server_pid=$!
address=""
for _ in $(seq 1 1200); do
    address="$(sed -n 's/.*credits service listening.*address=\([0-9.]*:[0-9]*\).*/\1/p' \
        "$work/server.log" | head -n 1)"
    [ -n "$address" ] && break
    kill -0 "$server_pid" 2>/dev/null || { cat "$work/server.log" >&2; exit 1; }
    sleep 0.1
done
[ -n "$address" ] || { echo "profile.sh: the service did not start" >&2; exit 1; }

# The load runs 3 s longer than the sampling on each side, so every sample sees steady load.
"$target_dir/release/examples/loadgen" --url "http://$address" --routes "$route" --rounds 1 \
    --warmup 2 --duration "$((seconds + 6))" --json >"$work/load.json" &
load_pid=$!
sleep 5
perf record -a -g -F 999 -o "$work/perf.data" -- sleep "$seconds" >/dev/null 2>&1
wait "$load_pid"
perf script -i "$work/perf.data" -F comm,ip,sym 2>/dev/null >"$work/perf.txt"

python3 - "$work/perf.txt" "$work/load.json" "$route" "$seconds" <<'PY'
import collections, json, sys

perf, load, route, seconds = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
rate = json.load(open(load))["routes"][route]["all"]["per_second"]
requests = rate * seconds
period_us = 1e6 / 999

# PostgreSQL's work, by the function a sample's stack passes through.
groups = [
    ("PL/pgSQL (the inbox functions, their statements included)", ["plpgsql_call_handler"]),
    ("parse, analyze and plan (simple-query text)",
     ["pg_parse_query", "pg_analyze_and_rewrite_fixedparams", "pg_plan_queries"]),
    ("executor start", ["standard_ExecutorStart"]),
    ("executor run", ["standard_ExecutorRun"]),
    ("commit (WAL flush included)", ["CommitTransactionCommand"]),
    ("  WAL flush", ["XLogFlush"]),
    ("foreign-key checks", ["SPI_execute_snapshot"]),
    ("waiting for and reading the next message", ["pq_getbyte"]),
    ("utility statements (BEGIN, COMMIT text, SET)", ["standard_ProcessUtility"]),
]

by_comm = collections.Counter()
by_group = collections.Counter()
comm, stack = None, []

def flush():
    if comm is None:
        return
    by_comm[comm] += 1
    if comm == "postgres":
        names = set(stack)
        for label, frames in groups:
            if names.intersection(frames):
                by_group[label] += 1

for line in open(perf):
    if line and not line[0].isspace():
        flush()
        comm, stack = line.split()[0] if line.strip() else None, []
    elif line.strip():
        parts = line.strip().split(None, 1)
        if len(parts) == 2:
            stack.append(parts[1].split("+")[0].split(" (")[0])
flush()

us = lambda n: n * period_us / requests
print(f"{route}: {rate:.0f} req/s over {seconds:.0f} s of samples; microseconds of CPU per request")
for name, n in by_comm.most_common(6):
    print(f"  {name:<58} {us(n):7.0f}")
print("  inside PostgreSQL:")
for label, _ in groups:
    print(f"    {label:<56} {us(by_group[label]):7.0f}")
PY
