#!/usr/bin/env bash
# The outbox's delivery guarantee against the credits example (release build) and a webhook
# receiver (benches/support/receiver.py), in two scenarios, with a table of what happened:
#
#   1. Answers the outbox cannot store as they are, or that never end: for each receiver
#      mode (nul, utf8, big, endless) one instance, $COMMANDS credits with distinct keys.
#   2. A slow, healthy receiver (4 s per request, then 200) and two instances on one
#      database, timeout 5000 ms: $SLOW_COMMANDS credits spread over both.
#
# Each scenario starts from empty outbox, inbox, quarantine and credits tables, waits (at
# most $WAIT_SECONDS, $SLOW_WAIT_SECONDS for the second) until no effect is pending, keeps
# the service running $SETTLE_SECONDS more to catch redeliveries, then checks: every effect
# delivered, none pending or dead, the receiver got every effect ID exactly once and nothing
# else. "drained after" counts from the last credit's answer. Exit status 1 if a check fails
# (the logs are then kept and named).
#
#   benches/outbox_delivery.sh
#   COMMANDS=50 SETTLE_SECONDS=30 benches/outbox_delivery.sh
#   SCENARIOS="endless two-slow" benches/outbox_delivery.sh   # some of nul utf8 big endless two-slow
#   SCENARIOS=two-slow WEBHOOK_TIMEOUT_MS=3000 benches/outbox_delivery.sh   # must fail: 4 s > 3 s
#
# Needs python3, psql and curl. The database is DATABASE_URL if set, used as it is and
# TRUNCATED; else tower_inbox_outbox_delivery on postgresql://postgres@127.0.0.1:5432,
# created when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
name="$(basename "$0")"

if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
    sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
fi

COMMANDS="${COMMANDS:-20}"
SLOW_COMMANDS="${SLOW_COMMANDS:-80}"
SETTLE_SECONDS="${SETTLE_SECONDS:-15}"
WAIT_SECONDS="${WAIT_SECONDS:-60}"
SLOW_WAIT_SECONDS="${SLOW_WAIT_SECONDS:-180}"
WEBHOOK_TIMEOUT_MS="${WEBHOOK_TIMEOUT_MS:-5000}"
SCENARIOS="${SCENARIOS:-nul utf8 big endless two-slow}"
for scenario in $SCENARIOS; do
    case "$scenario" in
    nul | utf8 | big | endless | two-slow) ;;
    *) echo "$name: unknown scenario $scenario in SCENARIOS (nul utf8 big endless two-slow)" >&2; exit 1 ;;
    esac
done

for tool in python3 psql curl; do
    command -v "$tool" >/dev/null || { echo "$name: $tool is not on PATH" >&2; exit 1; }
done

if [ -z "${DATABASE_URL:-}" ]; then
    server_url="postgresql://postgres@127.0.0.1:5432"
    database=tower_inbox_outbox_delivery
    if ! exists="$(psql "$server_url/postgres" -XAtq -c \
        "select 1 from pg_database where datname = '$database'" 2>&1)"; then
        echo "$name: cannot reach PostgreSQL at $server_url ($exists); set DATABASE_URL" >&2
        exit 1
    fi
    if [ -z "$exists" ]; then
        psql "$server_url/postgres" -XAtq -v ON_ERROR_STOP=1 -c "create database $database" >/dev/null
    fi
    DATABASE_URL="$server_url/$database"
fi
export DATABASE_URL

cargo build --release --example credits --features outbox-http
# shellcheck source=benches/support/credits.sh
source benches/support/credits.sh

work="$(mktemp -d "${TMPDIR:-/tmp}/tower-inbox-outbox.XXXXXX")"
keep_work=""
server_pids=()
receiver_pid=""
cleanup() {
    local pid
    for pid in "${server_pids[@]}"; do
        stop_pid "$pid"
    done
    stop_pid "$receiver_pid"
    if [ -n "$keep_work" ]; then
        echo "$name: logs kept in $work" >&2
    else
        rm -rf "$work"
    fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

sql() {
    psql "$DATABASE_URL" -XAtq -v ON_ERROR_STOP=1 -c "$1"
}

# Empties what a scenario counts. On a fresh database the first instance creates the tables.
reset_tables() {
    if [ "$(sql "select to_regclass('tower_inbox.message_outbox') is not null
                    and to_regclass('public.credit_ledger') is not null")" = t ]; then
        sql "truncate credit_ledger, credit_account, tower_inbox.consumer_inbox,
                      tower_inbox.consumer_inbox_failure, tower_inbox.inbox_quarantine,
                      tower_inbox.message_outbox restart identity"
    fi
}

# receiver_start MODE: sets receiver_pid and receiver_url; the keys go to $work/MODE.keys.
receiver_start() {
    local mode="$1" port_file="$work/$1.port"
    python3 benches/support/receiver.py "$mode" "$work/$mode.keys" "$port_file" \
        2>"$work/$mode.receiver.log" &
    receiver_pid=$!
    for _ in $(seq 1 100); do
        if [ -s "$port_file" ]; then
            receiver_url="http://127.0.0.1:$(cat "$port_file")/hook"
            return 0
        fi
        if ! kill -0 "$receiver_pid" 2>/dev/null; then
            echo "$name: the $mode receiver exited before listening: $(tail -n 1 "$work/$mode.receiver.log")" >&2
            exit 1
        fi
        sleep 0.1
    done
    echo "$name: the $mode receiver did not listen within 10 s" >&2
    exit 1
}

# instance_start LOG: one credits service delivering its webhooks to the receiver; appends
# to server_pids and addresses.
instance_start() {
    CREDITS_WEBHOOK_URL="$receiver_url" CREDITS_WEBHOOK_TIMEOUT_MS="$WEBHOOK_TIMEOUT_MS" \
        RUST_LOG="warn,credits=info,tower_inbox=info" credits_start "$1"
    server_pids+=("$server_pid")
    addresses+=("$address")
}

stop_all() {
    local pid
    for pid in "${server_pids[@]}"; do
        stop_pid "$pid"
    done
    server_pids=()
    stop_pid "$receiver_pid"
    receiver_pid=""
}

# send_credits SCENARIO COUNT: COUNT credits with keys SCENARIO-1.., round robin over the
# instances, each answered 201 or the script stops.
send_credits() {
    local scenario="$1" count="$2" i address code
    for i in $(seq 1 "$count"); do
        address="${addresses[$(((i - 1) % ${#addresses[@]}))]}"
        if ! code="$(curl -sS -m 10 -o "$work/response" -w '%{http_code}' \
            -X POST "http://$address/accounts/acct-$i/credits" \
            -H "Idempotency-Key: $scenario-$i" -H 'X-Producer: outbox-bench' \
            -H 'Content-Type: application/json' -d '{"delta": 1}' 2>&1)"; then
            echo "$name: $scenario: credit $scenario-$i to $address failed: $code" >&2
            keep_work=1
            exit 1
        fi
        if [ "$code" != 201 ]; then
            echo "$name: $scenario: credit $scenario-$i to $address answered $code: $(head -c 300 "$work/response")" >&2
            keep_work=1
            exit 1
        fi
    done
}

# wait_drained LIMIT: until no effect is pending, at most LIMIT seconds; sets drained to the
# seconds it took, or to "-" when effects were still pending at the limit.
wait_drained() {
    local limit="$1" started="$EPOCHREALTIME"
    drain_limit="$limit"
    while :; do
        if [ "$(sql "select count(*) from tower_inbox.message_outbox where status = 'pending'")" = 0 ]; then
            drained="$(awk -v a="$started" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')"
            return 0
        fi
        if awk -v a="$started" -v b="$EPOCHREALTIME" -v l="$limit" 'BEGIN { exit !(b - a >= l) }'; then
            drained="-"
            return 0
        fi
        sleep 0.5
    done
}

# dispatcher_outcomes: before the instances stop, what each one's dispatcher counted
# (outbox_deliveries_total from GET /metrics): sets per_instance to the deliveries of each,
# "41 + 39", and other_outcomes to the other outcomes summed over the instances by name,
# "lost 2", or "none".
dispatcher_outcomes() {
    local address metrics counts=() others=""
    for address in "${addresses[@]}"; do
        if ! metrics="$(curl -sS -m 5 "http://$address/metrics" 2>&1)"; then
            echo "$name: $scenario: cannot read the metrics of the instance on $address: $metrics" >&2
            keep_work=1
            exit 1
        fi
        counts+=("$(awk '/^outbox_deliveries_total\{/ && /outcome="delivered"/ { n += $NF }
                         END { print n + 0 }' <<<"$metrics")")
        others+="$(grep '^outbox_deliveries_total{' <<<"$metrics" | grep -v 'outcome="delivered"' || true)"$'\n'
    done
    per_instance="$(printf '%s + ' "${counts[@]}")"
    per_instance="${per_instance% + }"
    other_outcomes="$(awk 'match($0, /outcome="[a-z]+"/) {
                               n[substr($0, RSTART + 9, RLENGTH - 10)] += $NF }
                           END { for (o in n) printf "%s%s %d", (s++ ? ", " : ""), o, n[o]
                                 if (!s) printf "none" }' <<<"$others")"
}

rows=()
failures=()
declare -A answers=([nul]="200, NUL bytes in the body" [utf8]="200, invalid UTF-8"
    [big]="200, 4 MiB body" [endless]="200, chunked body that never ends"
    [slow]="200 after 4 s")
fail() {
    failures+=("$name: $1")
}

# check SCENARIO RECEIVER INSTANCES COMMANDS: compares the outbox with the receiver's log,
# adds a table row, and a failure line for each broken expectation.
check() {
    local scenario="$1" mode="$2" instances="$3" commands="$4"
    local keys="$work/$mode.keys" outbox total delivered pending dead attempts excerpt
    local received distinct repeated unknown missing retries verdict=ok key times line
    outbox="$(sql "select count(*), count(*) filter (where status = 'delivered'),
                          count(*) filter (where status = 'pending'),
                          count(*) filter (where status = 'dead'), coalesce(max(attempts), 0),
                          coalesce(min(octet_length(remote_result)) || '-' || max(octet_length(remote_result)), '-')
                   from tower_inbox.message_outbox" | tr '|' ' ')"
    read -r total delivered pending dead attempts excerpt <<<"$outbox"
    sql "select effect_id from tower_inbox.message_outbox order by 1" >"$work/$mode.effects"
    awk '{ print $2 }' "$keys" | sort >"$work/$mode.received"
    received="$(wc -l <"$work/$mode.received")"
    distinct="$(sort -u "$work/$mode.received" | wc -l)"
    repeated="$(uniq -d "$work/$mode.received" | wc -l)"
    unknown="$(sort -u "$work/$mode.received" | comm -23 - "$work/$mode.effects" | wc -l)"
    missing="$(sort -u "$work/$mode.received" | comm -13 - "$work/$mode.effects" | wc -l)"
    # Dispatcher lines about attempts that did not simply succeed, in every instance's log.
    retries="$(cat "$work/$scenario".*.log | grep -c -E \
        'delivery failed; retrying|lease expired|could not record|could not begin|moved to dead letters|transport panicked' || true)"

    [ "$total" = "$commands" ] || fail "$scenario: $total outbox rows for $commands credits"
    [ "$pending" = 0 ] || fail "$scenario: $pending effects still pending at the end (a wait of at most ${drain_limit}s, then ${SETTLE_SECONDS}s)"
    [ "$dead" = 0 ] || fail "$scenario: $dead effects dead: $(sql "select reason_code from tower_inbox.inbox_quarantine limit 1")"
    [ "$delivered" = "$commands" ] || fail "$scenario: $delivered of $commands effects delivered"
    [ "$received" = "$commands" ] || fail "$scenario: the receiver got $received deliveries for $commands effects"
    while read -r times key; do
        fail "$scenario: effect $key delivered $times times"
    done < <(uniq -c "$work/$mode.received" | awk '$1 > 1' | head -n 5)
    [ "$unknown" = 0 ] || fail "$scenario: the receiver got $unknown keys that are no effect ID"
    [ "$missing" = 0 ] || fail "$scenario: $missing effects never reached the receiver"
    [ "$attempts" -le 1 ] || fail "$scenario: an effect took $attempts attempts"
    [ "$retries" = 0 ] || fail "$scenario: $retries dispatcher retry/lease/dead lines in the log, e.g. $(cat "$work/$scenario".*.log | grep -m 1 -E 'delivery failed|lease expired|could not|dead letters|panicked' | sed 's/\x1b\[[0-9;]*m//g')"

    for line in "${failures[@]}"; do
        case "$line" in "$name: $scenario: "*) verdict=FAIL ;; esac
    done
    rows+=("| $scenario | ${answers[$mode]} | $instances | $commands | $delivered | $pending | $dead | $received | $distinct | $repeated | $attempts | $retries | $per_instance | $other_outcomes | $excerpt | $drained | $verdict |")
}

# Scenario 1, for one receiver mode: answers that cannot be stored as they are, or never end.
run_one_instance() {
    local mode="$1" scenario="$1"
    echo "$name: $scenario: $COMMANDS credits, one instance" >&2
    reset_tables
    addresses=()
    receiver_start "$mode"
    instance_start "$work/$scenario.1.log"
    send_credits "$scenario" "$COMMANDS"
    wait_drained "$WAIT_SECONDS"
    sleep "$SETTLE_SECONDS"
    dispatcher_outcomes
    stop_all
    check "$scenario" "$mode" 1 "$COMMANDS"
}

# Scenario 2: a slow, healthy receiver and two instances on one database.
run_two_slow() {
    local scenario=two-slow
    echo "$name: $scenario: $SLOW_COMMANDS credits, two instances, 4 s per delivery" >&2
    reset_tables
    addresses=()
    receiver_start slow
    instance_start "$work/$scenario.1.log"
    instance_start "$work/$scenario.2.log"
    send_credits "$scenario" "$SLOW_COMMANDS"
    wait_drained "$SLOW_WAIT_SECONDS"
    sleep "$SETTLE_SECONDS"
    dispatcher_outcomes
    stop_all
    check "$scenario" slow 2 "$SLOW_COMMANDS"
}

echo "$name: database $DATABASE_URL, $COMMANDS credits per receiver mode, $SLOW_COMMANDS on two instances, timeout ${WEBHOOK_TIMEOUT_MS} ms, ${SETTLE_SECONDS}s to settle" >&2
for scenario in $SCENARIOS; do
    case "$scenario" in
    two-slow) run_two_slow ;;
    *) run_one_instance "$scenario" ;;
    esac
done

echo
echo "| scenario | receiver answers | instances | credits | rows delivered | pending | dead | deliveries received | distinct keys | keys delivered twice or more | max attempts | retry lines | delivered per instance | other dispatcher outcomes | answer excerpt (bytes) | drained after (s) | verdict |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
printf '%s\n' "${rows[@]}"
if [ "${#failures[@]}" -gt 0 ]; then
    printf '%s\n' "${failures[@]}" >&2
    keep_work=1
    exit 1
fi
