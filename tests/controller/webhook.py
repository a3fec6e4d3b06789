"""A real local webhook receiver for the notification tests: an HTTP server on 127.0.0.1 in a thread.

    with WebhookReceiver() as hook:              # hook.url = "http://127.0.0.1:PORT/hook"
        hook.statuses = [500, 500, 200]          # answers in turn (the last one repeats); default 200
        hook.delay = 2.0                         # seconds before answering (a slow webhook)
        ...
        hook.bodies                              # the JSON documents received, in order
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class WebhookReceiver:
    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.statuses: list[int] = [200]
        self.delay = 0.0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with receiver._lock:
                    status = receiver.statuses[min(len(receiver.requests), len(receiver.statuses) - 1)]
                    receiver.requests.append({"path": self.path, "headers": dict(self.headers),
                                              "body": json.loads(body or b"null"), "status": status})
                if receiver.delay:
                    time.sleep(receiver.delay)
                self.send_response(status)
                self.send_header("Content-Type", "text/plain")
                self.end_headers()
                with contextlib.suppress(OSError):  # the client gave up (timeout)
                    self.wfile.write(b"ok" if status < 400 else b"nope")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    @property
    def bodies(self) -> list[Any]:
        with self._lock:
            return [r["body"] for r in self.requests]

    def wait_for(self, predicate: Any, timeout: float = 30.0) -> list[Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate(self.bodies):
                return self.bodies
            time.sleep(0.05)
        raise AssertionError(f"the webhook did not receive what was expected in {timeout}s: {self.bodies}")

    def __enter__(self) -> WebhookReceiver:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
