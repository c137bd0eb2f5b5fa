#!/usr/bin/env bash
# The service's own CPU work per request as a count of instructions, which the machine's noise
# does not change: each route of the credits example is run under valgrind's callgrind, warmed
# up with 300 requests, then counted over `COUNT` requests (default 1000) sent one after the
# other on one keep-alive connection, each with a new key. PostgreSQL's work and the kernel's
# (the sockets) are not counted; benches/profile.sh and benches/http.sh measure those.
#
#   benches/instructions.sh                          # baseline, minimal, layered; claim first
#   CREDITS_CLAIM_AT_COMMIT=1 benches/instructions.sh
#   COUNT=5000 benches/instructions.sh layered       # one route
#
# Prints, per route, instructions and calls to malloc per request (realloc apart). Under
# valgrind the CPU's SHA extensions are not offered, so sha2 takes its portable code: hashing
# costs several times the instructions it costs natively (the report names it apart). Needs
# valgrind (callgrind_control, callgrind_annotate) and python3; PostgreSQL as the example
# finds it. The callgrind files are left in a temporary directory, named in the output, for
# callgrind_annotate.
set -euo pipefail
cd "$(dirname "$0")/.."

count="${COUNT:-1000}"
routes=("$@")
[ "${#routes[@]}" -gt 0 ] || routes=(baseline minimal layered)
for tool in valgrind callgrind_control callgrind_annotate python3; do
    command -v "$tool" >/dev/null || { echo "instructions.sh: $tool is not on PATH" >&2; exit 1; }
done
for route in "${routes[@]}"; do
    case "$route" in
        baseline | minimal | layered) ;;
        *) echo "instructions.sh: unknown route \"$route\" (baseline, minimal or layered)" >&2; exit 2 ;;
    esac
done

cargo build --release --example credits
target_dir="${CARGO_TARGET_DIR:-target}"
# shellcheck source=benches/support/credits.sh
source benches/support/credits.sh
work="$(mktemp -d "${TMPDIR:-/tmp}/tower-inbox-instructions.XXXXXX")"
server_pid=""
trap 'stop_pid "$server_pid"' EXIT
trap 'exit 130' INT TERM

# One keep-alive connection, COUNT credits with new keys; fails on any answer but 201.
send() {
    python3 - "$@" <<'PY'
import http.client, sys, uuid
address, prefix, count, tag = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
host, port = address.rsplit(":", 1)
connection = http.client.HTTPConnection(host, int(port), timeout=60)
for i in range(count):
    connection.request("POST", f"{prefix}lg-{i % 1000}/credits", body=b'{"delta":1}', headers={
        "content-type": "application/json",
        "idempotency-key": f"ins-{tag}-{uuid.uuid4().hex}",
        "x-producer": "instructions",
    })
    response = connection.getresponse()
    body = response.read()
    if response.status != 201:
        sys.exit(f"instructions.sh: {prefix}: answered {response.status}: {body[:200]!r}")
PY
}

for route in "${routes[@]}"; do
    case "$route" in
        baseline) prefix=/baseline/accounts/ ;;
        minimal) prefix=/minimal/accounts/ ;;
        layered) prefix=/accounts/ ;;
    esac
    log="$work/$route.log"
    out="$work/callgrind.$route"
    CREDITS_BASELINE_ROUTE=1 BIND_ADDR=127.0.0.1:0 NO_COLOR=1 RUST_LOG="${RUST_LOG:-warn,credits=info}" \
        valgrind --tool=callgrind --callgrind-out-file="$out" \
        "$target_dir/release/examples/credits" >"$log" 2>&1 &
    server_pid=$!
    address=""
    for _ in $(seq 1 1200); do
        address="$(sed -n 's/.*credits service listening.*address=\([0-9.]*:[0-9]*\).*/\1/p' "$log" | head -n 1)"
        [ -n "$address" ] && break
        kill -0 "$server_pid" 2>/dev/null || { cat "$log" >&2; echo "instructions.sh: the service exited" >&2; exit 1; }
        sleep 0.2
    done
    [ -n "$address" ] || { cat "$log" >&2; echo "instructions.sh: the service did not listen" >&2; exit 1; }
    send "$address" "$prefix" 300 "warm-$route-$$"
    callgrind_control --zero "$server_pid" >/dev/null 2>&1 \
        || { echo "instructions.sh: callgrind_control --zero $server_pid failed" >&2; exit 1; }
    send "$address" "$prefix" "$count" "$route-$$"
    # The dump after the zero holds the counted requests only: "$out.1".
    callgrind_control --dump "$server_pid" >/dev/null 2>&1 \
        || { echo "instructions.sh: callgrind_control --dump $server_pid failed" >&2; exit 1; }
    stop_pid "$server_pid"
    server_pid=""
    python3 - "$route" "$out.1" "$count" <<'PY'
import re, subprocess, sys
route, path, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
flat = subprocess.run(["callgrind_annotate", "--threshold=100", path],
                      capture_output=True, text=True, check=True).stdout
tree = subprocess.run(["callgrind_annotate", "--tree=caller", "--threshold=100", path],
                      capture_output=True, text=True, check=True).stdout
total = sha = 0
for line in flat.splitlines():
    m = re.match(r"\s*([\d,]+) \([^)]*\)\s+(.*)", line)
    if not m:
        continue
    n = int(m.group(1).replace(",", ""))
    if "PROGRAM TOTALS" in m.group(2):
        total = n
    elif "sha2::sha256::compress256" in m.group(2):
        sha += n
# Calls into malloc, from the caller lines above its entry in the call tree. Without the C
# library's debug information the entry is "???:malloc" rather than "<file>:malloc".
mallocs, lines = 0, tree.splitlines()
for i, line in enumerate(lines):
    if re.search(r"\*\s+\S*:malloc \[", line):
        j = i - 1
        while j >= 0 and "<" in lines[j]:
            c = re.search(r"\((\d[\d,]*)x\)", lines[j])
            mallocs += int(c.group(1).replace(",", "")) if c else 0
            j -= 1
if total == 0 or mallocs == 0:
    sys.exit(f"instructions.sh: {path}: no instruction total or no call to malloc found; "
             "is callgrind_annotate's output in the form this script reads?")
print(f"{route}: {total / count:,.0f} instructions per request "
      f"({sha / count:,.0f} of them SHA-256 in portable code), "
      f"{mallocs / count:.0f} calls to malloc per request")
PY
done
echo "instructions.sh: callgrind files in $work" >&2
