"""kernelctl.opclient against a real HTTP server on loopback: each error status becomes its typed error,
the CLI's exit code follows from the type, a dead port is Unreachable, a slow answer TimedOut, and the async
client retries 409/503 until the answer changes."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from kernelctl import opclient
from kernelctl.console import EXIT_AUTH, EXIT_ERROR, EXIT_NOT_FOUND, EXIT_REFUSED, EXIT_USAGE, exit_code


class _Handler(BaseHTTPRequestHandler):
    """``/status/N`` answers N with a FastAPI-style detail; ``/flaky`` answers 409, 503, then 200;
    ``/slow`` sleeps; ``/fields`` is a validation error list; ``/text`` a plain-text 500."""

    calls: dict[str, int] = {}

    def _send(self, status: int, body: object, ctype: str = "application/json") -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        n = self.calls[self.path] = self.calls.get(self.path, 0) + 1
        if self.path.startswith("/status/"):
            self._send(int(self.path.rsplit("/", 1)[1]), {"detail": f"because {self.path}"})
        elif self.path == "/flaky":
            self._send(*((409, {"detail": "another writer"}) if n == 1 else (503, {"detail": "busy"}) if n == 2
                         else (200, {"ok": True, "auth": self.headers.get("Authorization")})))
        elif self.path == "/slow":
            time.sleep(1.0)
            self._send(200, {})
        elif self.path == "/fields":
            self._send(422, {"detail": [{"loc": ["body", "plan", "steps"], "msg": "too short"}]})
        elif self.path == "/text":
            self._send(500, b"boom", "text/plain")
        elif self.path == "/bytes":
            self._send(200, b"\x00\x01", "application/octet-stream")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.mark.parametrize(("status", "cls", "code"), [
    (400, opclient.BadRequest, EXIT_USAGE), (401, opclient.AuthError, EXIT_AUTH),
    (403, opclient.AuthError, EXIT_AUTH), (404, opclient.NotFound, EXIT_NOT_FOUND),
    (409, opclient.Conflict, EXIT_REFUSED), (413, opclient.Refused, EXIT_REFUSED),
    (422, opclient.Refused, EXIT_REFUSED), (500, opclient.ServerError, EXIT_ERROR),
    (503, opclient.Unavailable, EXIT_ERROR), (418, opclient.ApiError, EXIT_ERROR),
])
def test_error_status_is_typed(server: str, status: int, cls: type[opclient.ApiError], code: int) -> None:
    with opclient.OperatorClient(server, "tok") as api, pytest.raises(cls) as info:
        api.request("GET", f"/status/{status}")
    err = info.value
    assert type(err) is cls and err.status == status and err.detail == f"because /status/{status}"
    assert str(err) == f"GET /status/{status} -> {status}: because /status/{status}"
    assert exit_code(err) == code


def test_error_details_name_fields_and_fall_back_to_text(server: str) -> None:
    with opclient.OperatorClient(server, None) as api:
        with pytest.raises(opclient.Refused, match=r"plan\.steps: too short"):
            api.request("GET", "/fields")
        with pytest.raises(opclient.ServerError, match="boom"):
            api.request("GET", "/text")
        assert api.request("GET", "/bytes") == b"\x00\x01"


def test_unreachable_and_timed_out(server: str) -> None:
    with socket_port_closed() as url, opclient.OperatorClient(url, "tok") as api, \
            pytest.raises(opclient.Unreachable, match="cannot reach the controller"):
        api.request("GET", "/status/200")
    with opclient.OperatorClient(server, "tok", timeout=0.2) as api, pytest.raises(opclient.TimedOut):
        api.request("GET", "/slow")
    assert exit_code(opclient.TimedOut("x")) == EXIT_ERROR


def test_async_client_retries_conflict_and_unavailable(server: str) -> None:
    async def call(retry: bool) -> object:
        async with httpx.AsyncClient() as http:
            return await opclient.AsyncOperatorClient(http, server, "tok").request("GET", "/flaky", retry=retry)

    _Handler.calls.pop("/flaky", None)
    with pytest.raises(opclient.Conflict):
        asyncio.run(call(retry=False))
    _Handler.calls.pop("/flaky", None)
    assert asyncio.run(call(retry=True)) == {"ok": True, "auth": "Bearer tok"}
    assert _Handler.calls["/flaky"] == 3


class socket_port_closed:
    """A loopback URL whose port nothing listens on (bound, then closed)."""

    def __enter__(self) -> str:
        import socket

        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc: object) -> None:
        pass
