"""A tiny loopback HTTP proxy in front of the real controller: a fixed address for agents while the
controller restarts on new ports (502 while it is down, like a load balancer), and optional tampering with
bundle downloads (a man in the middle flipping a byte), a slow link (``throttle``), or replies lost on the way
back; ``timeline`` records when each request came and when its reply was written."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "content-encoding"}


class Proxy:
    def __init__(self, upstream: str | None = None) -> None:
        self.upstream = upstream
        self.tamper: Callable[[str], bool] = lambda path: False
        self.lose: Callable[[str], bool] = lambda path: False  # forward, then drop the reply (a lost answer)
        # answer in the controller's stead (status, JSON body), without forwarding; None: forward
        self.answer: Callable[[str], tuple[int, bytes] | None] = lambda path: None
        self.cut: Callable[[str], bool] = lambda path: False  # send half the body, then drop the connection
        self.ranges: list[str | None] = []  # the Range header of every request
        self.throttle: Callable[[str], float] = lambda path: 0.0  # spread the reply's body over this many seconds
        # (monotonic time, "in" as the request arrives / "out" once its reply is written, path, status, body)
        self.timeline: list[tuple[float, str, str, int, bytes]] = []
        self.requests: list[tuple[str, str, int]] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _handle(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else b""
                proxy.timeline.append((time.monotonic(), "in", self.path, 0, body))
                up = proxy.upstream
                status, headers, content = 502, {}, b'{"detail":"upstream down"}'
                canned = proxy.answer(self.path)
                if canned is not None:
                    status, content = canned
                    headers = {"Content-Type": "application/json"}
                    up = None
                if up is not None:
                    try:
                        fwd = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
                        r = httpx.request(self.command, up + self.path, headers=fwd, content=body, timeout=30)
                        status, content = r.status_code, r.content
                        headers = {k: v for k, v in r.headers.items() if k.lower() not in HOP}
                    except httpx.HTTPError:
                        pass
                if status == 200 and proxy.tamper(self.path) and content:
                    b = bytearray(content)
                    b[len(b) // 2] ^= 0x01
                    content = bytes(b)
                proxy.requests.append((self.command, self.path, status))
                proxy.ranges.append(self.headers.get("Range"))
                if proxy.lose(self.path):
                    self.close_connection = True  # the upstream committed; the client never hears it
                    return
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(content)))
                self.end_headers()
                if proxy.cut(self.path):
                    self.wfile.write(content[: len(content) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                spread = proxy.throttle(self.path) if status < 300 else 0.0
                step = max(1, len(content) // 20) if spread > 0 else len(content) or 1
                for i in range(0, len(content), step):  # a slow link: 20 slices, evenly over ``spread``
                    if i:
                        time.sleep(spread / 20)
                    self.wfile.write(content[i:i + step])
                    self.wfile.flush()
                proxy.timeline.append((time.monotonic(), "out", self.path, status, body))

            do_GET = do_POST = do_PUT = do_DELETE = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> Proxy:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
