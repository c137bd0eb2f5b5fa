# Sourced by benches/http.sh, benches/profile.sh and benches/outbox_delivery.sh: starts the
# credits example (release build) with its baseline route on a free port, and stops
# processes. Bash, with `set -euo pipefail`.
#
#   credits_start LOG   sets server_pid and address, or exits 1 with the log (the service's
#                       CREDITS_* settings come from the environment)
#   stop_pid PID        Ctrl-C's signal, up to 5 s, then KILL; no-op if gone

credits_start() {
    local log="$1" name
    name="$(basename "$0")"
    CREDITS_BASELINE_ROUTE=1 BIND_ADDR=127.0.0.1:0 NO_COLOR=1 \
        RUST_LOG="${RUST_LOG:-warn,credits=info}" \
        "${CARGO_TARGET_DIR:-target}/release/examples/credits" >"$log" 2>&1 &
    server_pid=$!
    # The first start may run migrations or start a throwaway PostgreSQL: give it two minutes.
    address=""
    for _ in $(seq 1 1200); do
        address="$(sed 's/\x1b\[[0-9;]*m//g' "$log" \
            | sed -n 's/.*credits service listening.*address=\([0-9.]*:[0-9]*\).*/\1/p' \
            | head -n 1)"
        [ -n "$address" ] && return 0
        if ! kill -0 "$server_pid" 2>/dev/null; then
            echo "$name: the credits service exited before listening; its log:" >&2
            cat "$log" >&2
            exit 1
        fi
        sleep 0.1
    done
    echo "$name: the credits service did not listen within two minutes; its log:" >&2
    cat "$log" >&2
    exit 1
}

stop_pid() {
    local pid="$1"
    if [ -z "$pid" ] || ! kill -0 "$pid" 2>/dev/null; then
        return 0
    fi
    # Graceful shutdown on Ctrl-C's signal (the service handles it once it listens).
    kill -INT "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
}
