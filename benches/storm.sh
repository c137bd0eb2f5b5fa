#!/usr/bin/env bash
# A duplicate storm against the credits example: one command held in flight for HOLD seconds
# (a psql session locks its account's row, so the command waits inside its handler, claim
# taken), DUPLICATES threads sending that command again and again without honouring
# Retry-After, and another producer sending new commands meanwhile. The other producer must
# get 201 every time and stay fast; no request may get a 5xx (benches/support/storm.py).
#
#   benches/storm.sh                     # HOLD=6 DUPLICATES=60
#   HOLD=10 DUPLICATES=100 benches/storm.sh
#
# Needs psql and python3; the service uses DATABASE_URL, else the local server (its database
# tower_inbox_credits).
set -euo pipefail
cd "$(dirname "$0")/.."

hold="${HOLD:-6}"
duplicates="${DUPLICATES:-60}"
for tool in psql python3; do
    command -v "$tool" >/dev/null || { echo "storm.sh: $tool is not on PATH" >&2; exit 1; }
done
database="${DATABASE_URL:-postgresql://postgres@127.0.0.1:5432/tower_inbox_credits}"

cargo build --release --example credits
# shellcheck source=benches/support/credits.sh
source benches/support/credits.sh
log="$(mktemp "${TMPDIR:-/tmp}/tower-inbox-storm.XXXXXX")"
server_pid=""
holder_pid=""
cleanup() {
    stop_pid "$holder_pid"
    stop_pid "$server_pid"
    rm -f "$log"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

credits_start "$log"
echo "storm.sh: credits service (pid $server_pid) on $address" >&2
run_id="storm-$(date +%s%N)"
# The held account exists before the storm, so that its row can be locked.
psql "$database" -qc "insert into credit_account values ('storm-hot', 0) on conflict do nothing"
psql "$database" -qc "begin; select 1 from credit_account where account_id = 'storm-hot' for update; select pg_sleep($hold); commit" >/dev/null &
holder_pid=$!
sleep 0.5
status=0
python3 benches/support/storm.py "$address" "$hold" "$duplicates" "$run_id" || status=$?
if [ "$status" -ne 0 ]; then
    echo "storm.sh: the storm was not absorbed (see above); the service's log:" >&2
    tail -n 20 "$log" >&2
fi
exit "$status"
