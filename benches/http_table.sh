#!/usr/bin/env bash
# One machine run of the HTTP figures, as a table: for each way of using the layer, the credits
# example is started afresh and loaded by the load generator (benches/loadgen) with the
# unprotected baseline route interleaved (R rounds of baseline then layered, each D seconds;
# baseline, minimal, layered for the first-seen rows), and one row gives the layered route's
# throughput and p99 as ratios to the baseline measured in the same run, and the CPU time per
# request of the service and of PostgreSQL on each route.
#
#   benches/http_table.sh                 # 3 rounds x 10 s per route, 32 connections
#   ROUNDS=5 DURATION=20 benches/http_table.sh
#   FRESH=1 benches/http_table.sh         # each mode starts from empty tables (below)
#
# Rows: claim first (new keys, the default builder), claim at commit (CREDITS_CLAIM_AT_COMMIT=1),
# replay (every request repeats an answered key, the default builder), replay with the cache
# (CREDITS_REPLAY_CACHE). The first two also load the example's hand-written minimal protocol
# (`/minimal`, examples/credits/ceiling.rs) in the same rounds (`--routes ceiling`): the
# ceiling over HTTP, and the layer's throughput against it. PostgreSQL's CPU is that of every
# process named postgres on this machine: run it with nothing else using the server. Needs
# python3. The service uses the database benches/http.sh uses (DATABASE_URL, else the local
# server).
set -euo pipefail
cd "$(dirname "$0")/.."

rounds="${ROUNDS:-3}"
duration="${DURATION:-10}"
connections="${CONNECTIONS:-32}"
command -v python3 >/dev/null || { echo "http_table.sh: python3 is not on PATH" >&2; exit 1; }
# FRESH=1 empties the tables every request writes (the inbox's consumer_inbox, the example's
# credit_account and credit_ledger; not the failures, the quarantine or the outbox) before
# each mode, and asks for a checkpoint (skipped when the role may not), so that every run
# writes into tables of the same size: the inbox's primary key grows with every run
# otherwise, and with it what a claim costs. It needs psql, and the database the service uses:
# DATABASE_URL, else the local server's tower_inbox_credits (the example's default).
fresh="${FRESH:-0}"
database="${DATABASE_URL:-postgresql://postgres@127.0.0.1:5432/tower_inbox_credits}"
if [ "$fresh" = 1 ]; then
    command -v psql >/dev/null || { echo "http_table.sh: FRESH=1 needs psql on PATH" >&2; exit 1; }
fi

work="$(mktemp -d "${TMPDIR:-/tmp}/tower-inbox-http-table.XXXXXX")"
trap 'rm -rf "$work"' EXIT

# name | environment of the service | load generator arguments
modes=(
    "claim first||--duplicates 0 --routes ceiling"
    "claim at commit|CREDITS_CLAIM_AT_COMMIT=1|--duplicates 0 --routes ceiling"
    "replay (defaults)||--duplicates 1"
    "replay (cache)|CREDITS_REPLAY_CACHE=200000|--duplicates 1"
)

for mode in "${modes[@]}"; do
    IFS='|' read -r name environment arguments <<<"$mode"
    echo "http_table.sh: $name" >&2
    read -r -a env_args <<<"$environment"
    read -r -a load_args <<<"$arguments"
    out="$work/$(echo "$name" | tr -c 'a-z0-9\n' '_').json"
    if [ "$fresh" = 1 ]; then
        # Neither the URL nor psql's message is printed: either may hold a password. On a
        # machine that never ran the example the database does not exist yet: the service
        # creates it empty, so there is nothing to empty.
        if ! psql -q -X -v ON_ERROR_STOP=1 "$database" \
            -c "truncate tower_inbox.consumer_inbox, credit_ledger, credit_account" \
            >/dev/null 2>"$work/psql.err" \
            && ! grep -q 'database ".*" does not exist' "$work/psql.err"; then
            echo "http_table.sh: FRESH=1 could not empty the tables (DATABASE_URL, else the local tower_inbox_credits); run the TRUNCATE above with psql to see why" >&2
            exit 1
        fi
        # A checkpoint needs superuser or pg_checkpoint; without one the run just starts later
        # in the checkpoint cycle.
        psql -q -X "$database" -c "checkpoint" >/dev/null 2>&1 || true
    fi
    if ! env "${env_args[@]}" benches/http.sh --connections "$connections" --rounds "$rounds" \
        --duration "$duration" "${load_args[@]}" --json >"$out" 2>"$work/stderr"; then
        cat "$work/stderr" >&2
        echo "http_table.sh: the run of \"$name\" failed" >&2
        exit 1
    fi
    printf '%s\t%s\n' "$name" "$out" >>"$work/runs"
done

python3 - "$work/runs" <<'PY'
import json, sys

def route(report, name):
    return report["routes"].get(name)

# Three decimals: the targets sit close to what this machine gives (0.7 is not 0.695).
print("| mode | baseline req/s | minimal req/s (× baseline) | layered req/s | × baseline "
      "| × minimal | p99 × baseline (minimal's) | service µs/req (baseline → minimal → layered) "
      "| PostgreSQL µs/req (baseline → minimal → layered) |")
print("|---|---|---|---|---|---|---|---|---|")
for line in open(sys.argv[1]):
    name, path = line.rstrip("\n").split("\t")
    report = json.load(open(path))
    base, minimal, layered = (route(report, r) for r in ("baseline", "minimal", "layered"))
    ratios = report["layered_over_baseline"]
    # A ratio over a route that answered nothing is NaN, which the report writes as null.
    fmt = lambda v, spec: "–" if v is None else format(v, spec)
    cpu = lambda r, k: "–" if r is None else fmt(r.get(k), ".0f")
    cpus = lambda k: " → ".join(cpu(r, k) for r in (base, minimal, layered))
    p99 = fmt(ratios['p99'], '.3f')
    if minimal is None:
        ceiling, over_minimal = "–", "–"
    else:
        # The hand-written protocol's tail beside the layer's: what this machine gives any
        # protocol with these round trips.
        p99 += f" ({fmt(report['minimal_over_baseline']['p99'], '.3f')})"
        ceiling = (f"{minimal['all']['per_second']:.0f} "
                   f"({fmt(report['minimal_over_baseline']['throughput'], '.3f')})")
        over_minimal = fmt(report['layered_over_minimal']['throughput'], '.3f')
    print(f"| {name} | {base['all']['per_second']:.0f} | {ceiling} "
          f"| {layered['all']['per_second']:.0f} | {fmt(ratios['throughput'], '.3f')} "
          f"| {over_minimal} | {p99} "
          f"| {cpus('server_cpu_us_per_request')} | {cpus('postgres_cpu_us_per_request')} |")
PY
