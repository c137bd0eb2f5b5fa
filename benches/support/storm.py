#!/usr/bin/env python3
"""A duplicate storm against the running credits example (benches/storm.sh starts it).

One command is held in flight (its account's row is locked by the caller for HOLD seconds),
while DUPLICATES threads send that same command again and again, ignoring Retry-After, and
another producer sends new commands one after another. Prints what each side got and exits 1
if the other producer got anything but 201, or any request got a 5xx.

    storm.py HOST:PORT HOLD DUPLICATES RUN_ID
"""
import http.client
import json
import sys
import threading
import time

address, hold, duplicates, run_id = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
host, port = address.rsplit(":", 1)
HOT = "storm-hot"


def post(conn, account, key, producer, delta=1):
    body = json.dumps({"delta": delta})
    started = time.monotonic()
    conn.request(
        "POST",
        f"/accounts/{account}/credits",
        body=body,
        headers={
            "content-type": "application/json",
            "idempotency-key": key,
            "x-producer": producer,
        },
    )
    response = conn.getresponse()
    response.read()
    return response.status, response.getheader("idempotent-replayed"), time.monotonic() - started


def connection():
    return http.client.HTTPConnection(host, int(port), timeout=30)


hot_key = f"{run_id}-hot"
results = {"original": None, "duplicates": {}, "other": []}
lock = threading.Lock()
stop = threading.Event()


def original():
    results["original"] = post(connection(), HOT, hot_key, "storm")


def duplicate():
    conn = connection()
    while not stop.is_set():
        status, replayed, _ = post(conn, HOT, hot_key, "storm")
        label = f"{status}{' replayed' if replayed == 'true' else ''}"
        with lock:
            results["duplicates"][label] = results["duplicates"].get(label, 0) + 1
        if replayed == "true":
            return


def other():
    conn = connection()
    n = 0
    while not stop.is_set():
        status, _, seconds = post(conn, f"storm-other-{n % 100}", f"{run_id}-other-{n}", "other")
        results["other"].append((status, seconds))
        n += 1


threads = [threading.Thread(target=original)]
threads[0].start()
time.sleep(0.5)  # the original is in flight, waiting for the account's row
threads += [threading.Thread(target=duplicate) for _ in range(duplicates)]
threads.append(threading.Thread(target=other))
for t in threads[1:]:
    t.start()
time.sleep(hold + 1)
stop.set()
for t in threads:
    t.join()

other_statuses = {}
for status, _ in results["other"]:
    other_statuses[status] = other_statuses.get(status, 0) + 1
latencies = sorted(seconds for _, seconds in results["other"])
slowest = latencies[-1] if latencies else float("nan")
p99 = latencies[int(len(latencies) * 0.99) - 1] if latencies else float("nan")
print(f"original: {results['original'][0]} after {results['original'][2]:.2f} s")
print(f"duplicates ({duplicates} threads, retrying at once): "
      + ", ".join(f"{k} x{v}" for k, v in sorted(results["duplicates"].items())))
print(f"other producer: {len(latencies)} commands, statuses "
      + ", ".join(f"{k} x{v}" for k, v in sorted(other_statuses.items()))
      + f"; median {latencies[len(latencies) // 2] * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms, "
      f"slowest {slowest * 1000:.1f} ms")
failed = (
    set(other_statuses) != {201}
    or any(k.startswith("5") for k in results["duplicates"])
    or results["original"][0] != 201
)
sys.exit(1 if failed else 0)
