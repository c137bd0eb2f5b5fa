#!/usr/bin/env bash
# PostgreSQL restarts under a steady load of the credits example: CLIENTS threads send credits
# (new keys, and every fourth request a key already answered) for SECONDS seconds, and after
# WAIT seconds PostgreSQL is restarted with `-m fast` (every backend ends). No request that
# starts after the database accepts connections again may get anything but 201, and no
# command may be applied twice (benches/support/restart.py). Requests during the outage may
# fail once the layer's reruns run out; the script counts them.
#
#   benches/restart.sh                 # CLIENTS=16 SECONDS=20 WAIT=6
#   RESTART="pg_ctl -D /path/to/data restart -m fast" benches/restart.sh
#
# RESTART is the command that restarts the server the example uses; by default the local
# Debian cluster's (`pg_ctlcluster <version> main restart -m fast`). Needs python3 and
# pg_isready and psql. It restarts a real server: run it where nothing else depends on that server.
set -euo pipefail
cd "$(dirname "$0")/.."

clients="${CLIENTS:-16}"
seconds="${SECONDS_OF_LOAD:-20}"
wait_before="${WAIT:-6}"
for tool in python3 pg_isready psql; do
    command -v "$tool" >/dev/null || { echo "restart.sh: $tool is not on PATH" >&2; exit 1; }
done
if [ -z "${RESTART:-}" ]; then
    version="$(ls /etc/postgresql 2>/dev/null | head -n 1)"
    [ -n "$version" ] || { echo "restart.sh: no Debian cluster in /etc/postgresql; set RESTART" >&2; exit 1; }
    RESTART="pg_ctlcluster --skip-systemctl-redirect $version main restart -m fast"
fi

cargo build --release --example credits
# shellcheck source=benches/support/credits.sh
source benches/support/credits.sh
work="$(mktemp -d "${TMPDIR:-/tmp}/tower-inbox-restart.XXXXXX")"
server_pid=""
cleanup() {
    stop_pid "$server_pid"
    rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

credits_start "$work/service.log"
echo "restart.sh: credits service (pid $server_pid) on $address" >&2
marks="$work/marks"
: >"$marks"
run_id="restart-$(date +%s%N)"
python3 benches/support/restart.py "$address" "$clients" "$seconds" "$run_id" "$marks" &
load_pid=$!
sleep "$wait_before"
echo "restart $(date +%s.%N)" >>"$marks"
echo "restart.sh: $RESTART" >&2
$RESTART
for _ in $(seq 1 600); do
    pg_isready -q -h 127.0.0.1 -p 5432 && break
    sleep 0.05
done
echo "accepting $(date +%s.%N)" >>"$marks"
status=0
wait "$load_pid" || status=$?
# Every command answered 201 as first seen is in the ledger exactly once: none lost, none
# doubled (the ledger has no unique key on the message; the inbox is what keeps it single).
database="${DATABASE_URL:-postgresql://postgres@127.0.0.1:5432/tower_inbox_credits}"
answered="$(cat "$marks.answered")"
ledger="$(psql "$database" -qAtc "select count(*), count(distinct message_id) from credit_ledger where message_id like '$run_id-%'")"
echo "answered as first seen: $answered; ledger rows, distinct commands: ${ledger/|/, }"
if [ "$ledger" != "$answered|$answered" ]; then
    echo "restart.sh: the ledger does not hold each answered command exactly once" >&2
    status=1
fi
if [ "$status" -ne 0 ]; then
    echo "restart.sh: requests failed after the restart (see above); the service's log:" >&2
    tail -n 20 "$work/service.log" >&2
fi
exit "$status"
