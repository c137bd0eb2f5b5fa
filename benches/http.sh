#!/usr/bin/env bash
# The HTTP figures in one command: builds the credits service and the load generator in
# release, starts the service with its unprotected baseline route on a free port, waits until
# it listens, runs examples/loadgen.rs against it with the arguments given, and stops the
# service again (also on failure or Ctrl-C).
#
#   benches/http.sh --connections 32 --duration 10 --rounds 3
#   benches/http.sh --connections 32 --duration 10 --rounds 3 --duplicates 0.5 --json
#   benches/http.sh --routes layered --rounds 1 --requests 1000000 --report-every 10
#
# With --report-every, the load generator is also given the service's pid (--server-pid), so
# that each interval shows the service's resident memory next to its throughput.
#
# The service uses DATABASE_URL if it is set, else the PostgreSQL on 127.0.0.1:5432, else a
# throwaway cluster (see README.md). Its log goes to a temporary file, printed if it fails.
# The exit status is the load generator's (see examples/loadgen.rs).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
    sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
fi

cargo build --release --example credits --example loadgen
target_dir="${CARGO_TARGET_DIR:-target}"
server="$target_dir/release/examples/credits"
loadgen="$target_dir/release/examples/loadgen"

log="$(mktemp "${TMPDIR:-/tmp}/tower-inbox-credits.XXXXXX")"
server_pid=""
stop_server() {
    if [ -n "$server_pid" ] && kill -0 "$server_pid" 2>/dev/null; then
        kill -INT "$server_pid" 2>/dev/null || true # graceful shutdown on Ctrl-C's signal
        for _ in $(seq 1 50); do
            kill -0 "$server_pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -KILL "$server_pid" 2>/dev/null || true
        wait "$server_pid" 2>/dev/null || true
    fi
    rm -f "$log"
}
trap stop_server EXIT
trap 'exit 130' INT TERM

# Port 0: the kernel picks a free port, and the service logs the address it got.
CREDITS_BASELINE_ROUTE=1 BIND_ADDR=127.0.0.1:0 NO_COLOR=1 RUST_LOG="${RUST_LOG:-warn,credits=info}" \
    "$server" >"$log" 2>&1 &
server_pid=$!

# The first start may run migrations or start a throwaway PostgreSQL: give it two minutes.
address=""
for _ in $(seq 1 1200); do
    address="$(sed 's/\x1b\[[0-9;]*m//g' "$log" \
        | sed -n 's/.*credits service listening.*address=\([0-9.]*:[0-9]*\).*/\1/p' | head -n 1)"
    [ -n "$address" ] && break
    if ! kill -0 "$server_pid" 2>/dev/null; then
        echo "http.sh: the credits service exited before listening; its log:" >&2
        cat "$log" >&2
        exit 1
    fi
    sleep 0.1
done
if [ -z "$address" ]; then
    echo "http.sh: the credits service did not listen within two minutes; its log:" >&2
    cat "$log" >&2
    exit 1
fi
echo "http.sh: credits service (pid $server_pid) listening on $address" >&2

# The service's pid for the memory figures, only when intervals are asked for (clap refuses
# --server-pid without --report-every).
pid_args=()
for arg in "$@"; do
    case "$arg" in
    --report-every | --report-every=*) pid_args=(--server-pid "$server_pid") ;;
    esac
done

status=0
"$loadgen" --url "http://$address" "${pid_args[@]}" "$@" || status=$?
exit "$status"
