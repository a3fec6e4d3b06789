"""The agent's HTTP client against a real loopback HTTP server: retries only connect errors and 5xx (with
backoff), other errors at once with the controller's detail; downloads are size-capped and digest-checked;
the node token is stored 0600."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from agents.client import ControllerClient, ControllerError, DownloadError, TokenStore, Unreachable
from kernelctl.wire import BundleRef, HeartbeatRequest

BLOB = b"kpack-bytes" * 1000
DIGEST = hashlib.sha256(BLOB).hexdigest()


class Script:
    """Per path, a list of (status, body, headers) answers consumed in order (the last one repeats)."""

    def __init__(self) -> None:
        self.answers: dict[str, list[tuple[int, bytes, dict[str, str]]]] = {}
        self.seen: list[tuple[str, str, str]] = []


@pytest.fixture
def server() -> Iterator[tuple[str, Script]]:
    script = Script()

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a: object) -> None:
            pass

        def _go(self) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            if n:
                self.rfile.read(n)
            script.seen.append((self.command, self.path, self.headers.get("Authorization", "")))
            queue = script.answers.get(self.path, [(404, b'{"detail":"no such thing"}', {})])
            status, body, headers = queue.pop(0) if len(queue) > 1 else queue[0]
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _go

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", script
    srv.shutdown()
    srv.server_close()


def hb_reply() -> bytes:
    return json.dumps({"node_name": "n1", "desired": [], "heartbeat_seconds": 2.0,
                       "server_time": dt.datetime.now(dt.timezone.utc).isoformat()}).encode()


def client(url: str, **kw: object) -> ControllerClient:
    return ControllerClient(url, "tok-1", backoff_initial=0.01, backoff_max=0.05, **kw)  # type: ignore[arg-type]


def test_5xx_is_retried_then_succeeds(server: tuple[str, Script]) -> None:
    url, script = server
    script.answers["/v1/agents/heartbeat"] = [(503, b'{"detail":"busy"}', {}), (500, b"oops", {}),
                                              (200, hb_reply(), {})]
    reply = client(url).heartbeat(HeartbeatRequest(node_name="n1"))
    assert reply.heartbeat_seconds == 2.0
    assert [s[1] for s in script.seen] == ["/v1/agents/heartbeat"] * 3
    assert all(s[2] == "Bearer tok-1" for s in script.seen)


def test_4xx_is_not_retried_and_carries_detail(server: tuple[str, Script]) -> None:
    url, script = server
    script.answers["/v1/agents/heartbeat"] = [(403, b'{"detail":"this token belongs to node n2"}', {})]
    with pytest.raises(ControllerError, match="403: this token belongs to node n2") as ei:
        client(url).heartbeat(HeartbeatRequest(node_name="n1"))
    assert ei.value.status == 403 and len(script.seen) == 1


def test_persistent_5xx_gives_up_after_max_attempts(server: tuple[str, Script]) -> None:
    url, script = server
    script.answers["/v1/agents/heartbeat"] = [(502, b'{"detail":"no backend"}', {})]
    with pytest.raises(Unreachable, match="502: no backend"):
        client(url, max_attempts=3).heartbeat(HeartbeatRequest(node_name="n1"))
    assert len(script.seen) == 3


def test_connection_refused_is_unreachable() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    with pytest.raises(Unreachable, match="unreachable"):
        client(f"http://127.0.0.1:{port}", max_attempts=2).heartbeat(HeartbeatRequest(node_name="n1"))


def test_stop_event_cuts_retries_short(server: tuple[str, Script]) -> None:
    url, script = server
    script.answers["/v1/agents/heartbeat"] = [(503, b"{}", {})]
    stop = threading.Event()
    stop.set()
    with pytest.raises(Unreachable):
        client(url, max_attempts=50, stop_event=stop).heartbeat(HeartbeatRequest(node_name="n1"))
    assert len(script.seen) == 1


def ref() -> BundleRef:
    return BundleRef(name="llm-fused", version="1.1.0", digest=DIGEST)


PATH = "/v1/bundles/llm-fused/1.1.0/content"


def test_download_streams_and_checks_digest(server: tuple[str, Script], tmp_path: Path) -> None:
    url, script = server
    script.answers[PATH] = [(200, BLOB, {"X-Kernelctl-Digest": DIGEST})]
    p = client(url).download_bundle(ref(), tmp_path, max_bytes=1 << 20)
    assert p.read_bytes() == BLOB and p.parent == tmp_path


def test_download_with_wrong_bytes_is_deleted(server: tuple[str, Script], tmp_path: Path) -> None:
    url, script = server
    script.answers[PATH] = [(200, BLOB[:-1] + b"X", {"X-Kernelctl-Digest": DIGEST})]
    with pytest.raises(DownloadError, match="expected " + DIGEST):
        client(url).download_bundle(ref(), tmp_path, max_bytes=1 << 20)
    assert list(tmp_path.iterdir()) == []


def test_download_over_cap_is_refused(server: tuple[str, Script], tmp_path: Path) -> None:
    url, script = server
    script.answers[PATH] = [(200, BLOB, {})]
    with pytest.raises(DownloadError, match="larger than the cap of 100 bytes"):
        client(url).download_bundle(ref(), tmp_path, max_bytes=100)
    assert list(tmp_path.iterdir()) == []


def test_download_404_is_not_retried(server: tuple[str, Script], tmp_path: Path) -> None:
    url, script = server
    with pytest.raises(ControllerError, match="404: no such thing"):
        client(url).download_bundle(ref(), tmp_path, max_bytes=1 << 20)
    assert len(script.seen) == 1 and list(tmp_path.iterdir()) == []


def test_token_store_is_private_and_scoped(tmp_path: Path) -> None:
    store = TokenStore(tmp_path)
    assert store.load("http://c", "n1") is None
    store.save("http://c", "n1", "secret")
    assert store.path.stat().st_mode & 0o777 == 0o600
    assert store.load("http://c", "n1") == "secret"
    assert store.load("http://other", "n1") is None and store.load("http://c", "n2") is None
