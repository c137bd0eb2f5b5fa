#!/usr/bin/env bash
# One machine run of the HTTP figures, as a table: for each way of using the layer, the credits
# example is started afresh and loaded by the load generator (benches/loadgen) with the
# unprotected baseline route interleaved (R rounds of baseline then layered, each D seconds),
# and one row gives the layered route's throughput and p99 as ratios to the baseline measured
# in the same run, and the CPU time per request of the service and of PostgreSQL on both
# routes.
#
#   benches/http_table.sh                 # 3 rounds x 10 s per route, 32 connections
#   ROUNDS=5 DURATION=20 benches/http_table.sh
#
# Rows: claim first (new keys, the default builder), claim at commit (CREDITS_CLAIM_AT_COMMIT=1),
# replay (every request repeats an answered key, the default builder), replay with the cache
# (CREDITS_REPLAY_CACHE). PostgreSQL's CPU is that of every process named postgres on this
# machine: run it with nothing else using the server. Needs python3. The service uses the
# database benches/http.sh uses (DATABASE_URL, else the local server).
set -euo pipefail
cd "$(dirname "$0")/.."

rounds="${ROUNDS:-3}"
duration="${DURATION:-10}"
connections="${CONNECTIONS:-32}"
command -v python3 >/dev/null || { echo "http_table.sh: python3 is not on PATH" >&2; exit 1; }

work="$(mktemp -d "${TMPDIR:-/tmp}/tower-inbox-http-table.XXXXXX")"
trap 'rm -rf "$work"' EXIT

# name | environment of the service | load generator arguments
modes=(
    "claim first||--duplicates 0"
    "claim at commit|CREDITS_CLAIM_AT_COMMIT=1|--duplicates 0"
    "replay (defaults)||--duplicates 1"
    "replay (cache)|CREDITS_REPLAY_CACHE=200000|--duplicates 1"
)

for mode in "${modes[@]}"; do
    IFS='|' read -r name environment arguments <<<"$mode"
    echo "http_table.sh: $name" >&2
    read -r -a env_args <<<"$environment"
    read -r -a load_args <<<"$arguments"
    out="$work/$(echo "$name" | tr -c 'a-z0-9\n' '_').json"
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
    return report["routes"][name]

print("| mode | baseline req/s | layered req/s | × baseline | p99 × baseline "
      "| service µs/req (baseline → layered) | PostgreSQL µs/req (baseline → layered) |")
print("|---|---|---|---|---|---|---|")
for line in open(sys.argv[1]):
    name, path = line.rstrip("\n").split("\t")
    report = json.load(open(path))
    base, layered = route(report, "baseline"), route(report, "layered")
    ratios = report["layered_over_baseline"]
    # Three decimals: the targets sit close to what this machine gives (0.7 is not 0.695).
    cpu = lambda r, k: "–" if r.get(k) is None else f"{r[k]:.0f}"
    print(f"| {name} | {base['all']['per_second']:.0f} | {layered['all']['per_second']:.0f} "
          f"| {ratios['throughput']:.3f} | {ratios['p99']:.3f} "
          f"| {cpu(base, 'server_cpu_us_per_request')} → {cpu(layered, 'server_cpu_us_per_request')} "
          f"| {cpu(base, 'postgres_cpu_us_per_request')} → {cpu(layered, 'postgres_cpu_us_per_request')} |")
PY
