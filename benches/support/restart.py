#!/usr/bin/env python3
"""Steady load on the running credits example while PostgreSQL restarts (benches/restart.sh).

CLIENTS threads send credits back to back for SECONDS seconds: new keys, and every fourth
request a key already answered. After WAIT seconds the caller's restart command runs (its
start and end are passed back through the files the shell script writes). Every request is
recorded with its start time and status. Prints the statuses before, during and after the
outage, and exits 1 if any request started after the database accepted connections again got
anything but 201, or if an answered command was applied twice (a replayed key answered
without `idempotent-replayed`).

    restart.py HOST:PORT CLIENTS SECONDS RUN_ID MARKS_FILE

It also writes to MARKS_FILE.answered the keys answered 201 as first seen, one per line, for
the shell script to check against the ledger (none lost, none doubled).
"""
import http.client
import json
import sys
import threading
import time

address, clients, seconds, run_id, marks_file = sys.argv[1:6]
host, port = address.rsplit(":", 1)
clients, seconds = int(clients), float(seconds)
records = []
lock = threading.Lock()
stop_at = time.time() + seconds


def client(n):
    conn = None
    answered = []
    i = 0
    while time.time() < stop_at:
        if conn is None:
            conn = http.client.HTTPConnection(host, int(port), timeout=30)
        replay = i % 4 == 3 and answered
        key = answered[-1] if replay else f"{run_id}-{n}-{i}"
        started = time.time()
        try:
            conn.request(
                "POST",
                f"/accounts/restart-{n}/credits",
                body=json.dumps({"delta": 1}),
                headers={"content-type": "application/json", "idempotency-key": key,
                         "x-producer": "restart"},
            )
            response = conn.getresponse()
            body = response.read()
            status = response.status
            replayed = response.getheader("idempotent-replayed") == "true"
        except OSError as err:
            status, replayed, body = f"transport: {type(err).__name__}", False, b""
            conn = None
        if status == 201 and not replay:
            answered.append(key)
        with lock:
            records.append((started, status, bool(replay), replayed, body[:200]))
        i += 1
        if status != 201:
            time.sleep(0.05)


threads = [threading.Thread(target=client, args=(n,)) for n in range(clients)]
for t in threads:
    t.start()
for t in threads:
    t.join()

marks = dict(line.split() for line in open(marks_file) if line.strip())
restart_at, accepting_at = float(marks["restart"]), float(marks["accepting"])


def summary(rows):
    statuses = {}
    for _, status, _, _, _ in rows:
        statuses[status] = statuses.get(status, 0) + 1
    return ", ".join(f"{k} x{v}" for k, v in sorted(statuses.items(), key=str)) or "none"


before = [r for r in records if r[0] < restart_at]
during = [r for r in records if restart_at <= r[0] < accepting_at]
after = [r for r in records if r[0] >= accepting_at]
print(f"restart began {restart_at - min(r[0] for r in records):.1f} s into the load; "
      f"the database accepted connections again {accepting_at - restart_at:.2f} s later")
print(f"before: {len(before)} requests: {summary(before)}")
print(f"during: {len(during)} requests: {summary(during)}")
print(f"after:  {len(after)} requests: {summary(after)}")
bad_after = [r for r in after if r[1] != 201]
unreplayed = [r for r in records if r[1] == 201 and r[2] and not r[3]]
with open(marks_file + ".answered", "w") as out:
    out.write(str(sum(1 for r in records if r[1] == 201 and not r[2])) + "\n")
for r in bad_after[:5]:
    print(f"  after the restart: {r[1]} {r[4]!r}")
if unreplayed:
    print(f"  {len(unreplayed)} repeated keys were answered without idempotent-replayed")
sys.exit(1 if bad_after or unreplayed else 0)
