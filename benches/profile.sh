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
#   benches/profile.sh minimal 10      # the example's hand-written minimal protocol
#   CREDITS_CLAIM_AT_COMMIT=1 benches/profile.sh layered 10
#
# Needs perf (with permission to sample every CPU: root, CAP_PERFMON, or
# kernel.perf_event_paranoid <= 0) and python3; PostgreSQL as the example finds it
# (DATABASE_URL or the local default). The service and the load generator are counted by
# their process ids; PostgreSQL is every process named `postgres` (its background writers
# included, which the load keeps busy too), so run it with nothing else using the server.
# Run the routes one after the other and compare: on a shared machine, repeat each.
set -euo pipefail
cd "$(dirname "$0")/.."

route="${1:-}"
seconds="${2:-10}"
if [[ "$route" != baseline && "$route" != layered && "$route" != minimal ]]; then
    sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
for tool in perf python3; do
    command -v "$tool" >/dev/null || { echo "profile.sh: $tool is not on PATH" >&2; exit 1; }
done

cargo build --release --example credits
cargo build --release -p tower-inbox-loadgen
target_dir="${CARGO_TARGET_DIR:-target}"
# shellcheck source=benches/support/credits.sh
source benches/support/credits.sh
work="$(mktemp -d "${TMPDIR:-/tmp}/tower-inbox-profile.XXXXXX")"
server_pid=""
load_pid=""
cleanup() {
    stop_pid "$load_pid"
    stop_pid "$server_pid"
    rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

credits_start "$work/server.log"

# The load runs 3 s longer than the sampling on each side, so every sample sees steady load.
"$target_dir/release/loadgen" --url "http://$address" --routes "$route" --rounds 1 \
    --warmup 2 --duration "$((seconds + 6))" --json >"$work/load.json" &
load_pid=$!
sleep 5
if ! perf record -a -g -F 999 -o "$work/perf.data" -- sleep "$seconds" >"$work/perf.log" 2>&1; then
    cat "$work/perf.log" >&2
    echo "profile.sh: perf record failed" >&2
    exit 1
fi
# Exit status 3: the run completed with mismatches or transport errors; the figures stand.
status=0
wait "$load_pid" || status=$?
load_pid=""
if [ "$status" -eq 3 ]; then
    echo "profile.sh: the load generator saw mismatches or transport errors" >&2
elif [ "$status" -ne 0 ]; then
    echo "profile.sh: the load generator failed (exit status $status)" >&2
    exit 1
fi
perf script --no-inline -i "$work/perf.data" -F comm,pid,ip,sym 2>/dev/null >"$work/perf.txt"

python3 - "$work/perf.txt" "$work/load.json" "$route" "$seconds" "$server_pid" <<'PY'
import collections, json, sys

perf, load, route = sys.argv[1], sys.argv[2], sys.argv[3]
seconds, server_pid = float(sys.argv[4]), sys.argv[5]
report = json.load(open(load))
rate = report["routes"][route]["all"]["per_second"]
if rate <= 0:
    sys.exit("profile.sh: no request was answered")
requests = rate * seconds
period_us = 1e6 / 999

# PostgreSQL's work, by the function a sample's stack passes through.
groups = [
    ("PL/pgSQL (the inbox functions, their statements included)", ["plpgsql_call_handler"]),
    ("parse, analyze and plan (simple-query text)",
     ["pg_parse_query", "pg_analyze_and_rewrite_fixedparams", "pg_plan_queries"]),
    ("executor start", ["standard_ExecutorStart"]),
    ("executor run", ["standard_ExecutorRun"]),
    ("  heap and index writes", ["heap_insert", "heap_update", "_bt_doinsert"]),
    ("  foreign-key checks", ["SPI_execute_snapshot"]),
    ("commit (WAL flush included)", ["CommitTransactionCommand"]),
    ("  WAL flush", ["XLogFlush"]),
    ("waiting for and reading the next message", ["pq_getbyte"]),
    ("utility statements (BEGIN, COMMIT text, SET)", ["standard_ProcessUtility"]),
]

by_who = collections.Counter()
by_group = collections.Counter()
who, stack = None, []

def flush():
    if who is None:
        return
    by_who[who] += 1
    if who == "PostgreSQL":
        names = set(stack)
        for label, frames in groups:
            if names.intersection(frames):
                by_group[label] += 1

def process(header):
    # "comm pid": the command name may contain spaces, the pid is the last field.
    fields = header.split()
    if len(fields) < 2:
        return None
    comm, pid = " ".join(fields[:-1]), fields[-1]
    if pid == server_pid:
        return "the service"
    if comm == "loadgen":
        return "the load generator"
    if comm == "postgres":
        return "PostgreSQL"
    return "anything else"

for line in open(perf):
    if line and not line[0].isspace():
        flush()
        who, stack = process(line), []
    elif line.strip():
        parts = line.strip().split(None, 1)
        if len(parts) == 2:
            stack.append(parts[1].split("+")[0].split(" (")[0])
flush()

us = lambda n: n * period_us / requests
print(f"{route}: {rate:.0f} req/s over {seconds:.0f} s of samples; microseconds of CPU per request")
for name in ["the service", "PostgreSQL", "the load generator", "anything else"]:
    print(f"  {name:<58} {us(by_who[name]):7.0f}")
print("  inside PostgreSQL:")
for label, _ in groups:
    print(f"    {label:<56} {us(by_group[label]):7.0f}")
PY
