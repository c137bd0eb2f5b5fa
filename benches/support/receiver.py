#!/usr/bin/env python3
"""A webhook receiver for benches/outbox_delivery.sh, standard library only.

    receiver.py MODE LOG PORT_FILE

Listens on 127.0.0.1 on a free port, writes that port to PORT_FILE once it listens, and for
every POST appends one line to LOG, "<unix time> <Idempotency-Key>", as soon as the request
has been read (so a delivery counts even when its answer is cut off). Then it answers as
MODE says:

    nul       200 with a body holding NUL bytes
    utf8      200 with a body that is not valid UTF-8
    big       200 with a 4 MiB body (Content-Length)
    endless   200 with a chunked body that never ends: a chunk every 100 ms until the
              client closes the connection
    slow      200 after 4 s, with a small body

It keeps connections alive (HTTP/1.1), never times them out, and runs until SIGINT or
SIGTERM (handled even when started in the background of a script, which ignores SIGINT).
"""

import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODES = ("nul", "utf8", "big", "endless", "slow")


class Receiver(ThreadingHTTPServer):
    daemon_threads = True
    # Two dispatchers send up to 16 requests at once: never refuse one for want of backlog.
    request_queue_size = 128

    def __init__(self, mode, log):
        super().__init__(("127.0.0.1", 0), Handler)
        self.mode = mode
        self.log = log
        self.lock = threading.Lock()

    def record(self, key):
        with self.lock:
            self.log.write(f"{time.time():.3f} {key}\n")
            self.log.flush()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):
        pass  # The key log is the record; stderr stays quiet.

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        self.server.record(self.headers.get("Idempotency-Key") or "-")
        try:
            getattr(self, "answer_" + self.server.mode)()
        except (BrokenPipeError, ConnectionResetError):
            # The client stopped reading (its excerpt was long enough): expected for the
            # big and endless answers.
            self.close_connection = True

    def fixed(self, body, content_type="application/octet-stream"):
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()

    def answer_nul(self):
        self.fixed(b'{"ok":true,"note":"nul\x00inside\x00"}\x00\x00', "application/json")

    def answer_utf8(self):
        self.fixed(b'{"ok":true,"note":"\xff\xfe\xc3\x28 not utf-8 \x80"}', "application/json")

    def answer_big(self):
        self.fixed(b"x" * (4 * 1024 * 1024), "text/plain")

    def answer_endless(self):
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        chunk = b"still going\n"
        while True:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.flush()
            time.sleep(0.1)

    def answer_slow(self):
        time.sleep(4)
        self.fixed(b'{"ok":true}', "application/json")


def stop(signum, frame):
    sys.exit(0)


def main():
    if len(sys.argv) != 4 or sys.argv[1] not in MODES:
        sys.exit(f"usage: receiver.py {{{'|'.join(MODES)}}} LOG PORT_FILE")
    mode, log_path, port_file = sys.argv[1:]
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    with open(log_path, "a", encoding="utf-8", errors="replace") as log:
        server = Receiver(mode, log)
        with open(port_file + ".tmp", "w", encoding="ascii") as f:
            f.write(f"{server.server_address[1]}\n")
        # Renamed into place so the script never reads a half-written port.
        os.replace(port_file + ".tmp", port_file)
        server.serve_forever()


if __name__ == "__main__":
    main()
