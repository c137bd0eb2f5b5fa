#!/usr/bin/env bash
# The HTTP figures in one command: builds the credits service and the load generator in
# release, starts the service with its unprotected baseline route on a free port, waits until
# it listens, runs the load generator (benches/loadgen) against it with the arguments given,
# and stops the service again (also on failure or Ctrl-C).
#
#   benches/http.sh --connections 32 --duration 10 --rounds 3
#   benches/http.sh --connections 32 --duration 10 --rounds 3 --duplicates 0.5 --json
#   benches/http.sh --routes layered --rounds 1 --requests 1000000 --report-every 10
#   benches/http.sh --rate 500 --duration 10 --rounds 3    # open loop, 500 req/s per route
#
# The load generator is given the service's pid (--server-pid) and asked for PostgreSQL's CPU
# (--postgres-cpu, every process named postgres on this machine), so that each route's CPU
# time per request is reported for the client, the service and the database; with
# --report-every each interval also shows the service's resident memory.
#
# The service uses DATABASE_URL if it is set, else the PostgreSQL on 127.0.0.1:5432, else a
# throwaway cluster (see README.md). Its log goes to a temporary file, printed if it fails.
# The exit status is the load generator's (see benches/loadgen/src/main.rs).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
    sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
fi

cargo build --release --example credits
cargo build --release -p tower-inbox-loadgen
loadgen="${CARGO_TARGET_DIR:-target}/release/loadgen"
# shellcheck source=benches/support/credits.sh
source benches/support/credits.sh

log="$(mktemp "${TMPDIR:-/tmp}/tower-inbox-credits.XXXXXX")"
server_pid=""
stop_server() {
    stop_pid "$server_pid"
    rm -f "$log"
}
trap stop_server EXIT
trap 'exit 130' INT TERM

# Port 0: the kernel picks a free port, and the service logs the address it got.
credits_start "$log"
echo "http.sh: credits service (pid $server_pid) listening on $address" >&2

# The service's pid, for its CPU time per request (and its memory with --report-every), and
# the CPU time of every local PostgreSQL process.
pid_args=(--server-pid "$server_pid" --postgres-cpu)

status=0
"$loadgen" --url "http://$address" "${pid_args[@]}" "$@" || status=$?
exit "$status"
