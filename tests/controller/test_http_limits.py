"""The connection limits of ``kernelctl serve`` (controller.http_limits) under both HTTP implementations, on a
REAL server: httptools (the default) and the h11 fallback each answer a slow header block with 408, refuse a
header block over ``max_header_bytes`` while it still arrives, serve keep-alive and pipelined requests, and do
not count a large body that arrives with its headers as header bytes."""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests import dbutil
from tests.controller.serverutil import ControllerProcess, register_node
from tests.controller.test_redteam import _read_until_closed

HEADER_TIMEOUT = 2.0
KEEPALIVE = 1.0


@pytest.fixture(scope="module", params=["httptools", "h11"])
def ctl(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControllerProcess]:
    tmp = tmp_path_factory.mktemp(f"http-{request.param}")
    env = {"KERNELCTL_HTTP_IMPL": request.param, "KERNELCTL_HEADER_TIMEOUT_SECONDS": str(HEADER_TIMEOUT),
           "KERNELCTL_MAX_HEADER_BYTES": "8192", "KERNELCTL_KEEPALIVE_TIMEOUT_SECONDS": str(KEEPALIVE)}
    with dbutil.fresh_database("sqlite", tmp) as url, ControllerProcess(url, tmp, extra_env=env) as proc:
        assert f"http {request.param})" in proc.log_text(), proc.log_tail()
        yield proc


def _raw(ctl: ControllerProcess) -> socket.socket:
    assert ctl.port is not None
    return socket.create_connection(("127.0.0.1", ctl.port), timeout=10)


def _responses(data: bytes) -> list[int]:
    return [int(code) for code in re.findall(rb"HTTP/1\.1 (\d{3}) ", data)]


def test_slow_or_missing_headers_answered_408(ctl: ControllerProcess) -> None:
    with _raw(ctl) as s:  # nothing at all
        data, took = _read_until_closed(s, HEADER_TIMEOUT + 5)
        assert data.startswith(b"HTTP/1.1 408") and HEADER_TIMEOUT - 0.5 < took < HEADER_TIMEOUT + 3, (data, took)
    with _raw(ctl) as s:  # a byte now and then: the deadline counts from the connection, not the last byte
        start = time.monotonic()
        for b in b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
            try:
                s.sendall(bytes([b]))
            except OSError:
                break
            time.sleep(0.1)
            if time.monotonic() - start > HEADER_TIMEOUT + 3:
                break
        data, _ = _read_until_closed(s, 3)
        assert b"408" in data and time.monotonic() - start < HEADER_TIMEOUT + 4, data
    with _raw(ctl) as s:  # after a response, the next request's headers get the deadline again
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        first = b""
        while not first.endswith(b'{"status":"ok"}'):
            chunk = s.recv(65536)
            assert chunk, first
            first += chunk
        assert first.startswith(b"HTTP/1.1 200"), first
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # (this cancels the idle keep-alive timer)
        data, took = _read_until_closed(s, KEEPALIVE + HEADER_TIMEOUT + 5)
        assert data.startswith(b"HTTP/1.1 408") and took < KEEPALIVE + HEADER_TIMEOUT + 3, (data, took)


def test_header_block_over_the_limit_refused(ctl: ControllerProcess) -> None:
    with _raw(ctl) as s:  # arriving in pieces, never complete: refused before it ends
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        for _ in range(10):
            try:
                s.sendall(b"X-Big: " + b"a" * 2000 + b"\r\n")
            except OSError:
                break
            time.sleep(0.05)
        data, took = _read_until_closed(s, 5)
        assert data.startswith((b"HTTP/1.1 400", b"HTTP/1.1 431")) and took < HEADER_TIMEOUT, (data[:100], took)
    with _raw(ctl) as s:  # complete in one piece: the app's 431
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n")
        data, _ = _read_until_closed(s, 5)
        assert data.startswith((b"HTTP/1.1 400", b"HTTP/1.1 431")), data[:100]
    assert httpx.get(ctl.url + "/healthz").status_code == 200


def test_keep_alive_pipelining_and_large_bodies_served(ctl: ControllerProcess) -> None:
    with _raw(ctl) as s:  # two pipelined requests in one write, then a third on the same connection
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\nGET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.5)
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data, _ = _read_until_closed(s, 10)
        assert _responses(data) == [200, 200, 200], data
    # a body many times max_header_bytes arriving with its headers is a body, not a header block
    node = register_node(ctl, "gpu-http-1")
    big = json.dumps({"node_name": "gpu-http-1", "reports": [{"detail": "x" * 8000}] * 40}).encode()
    with node:
        for _ in range(3):  # keep-alive: the same connection, headers and 320 KB body in one write each
            r = node.post("/v1/agents/reports", content=big, headers={"Content-Type": "application/json"})
            assert r.status_code == 422 and r.json()["detail"][0]["loc"][:3] == ["body", "reports", 0], r.text[:300]
        assert node.post("/v1/agents/heartbeat", json={"node_name": "gpu-http-1"}).status_code == 200


def test_http_impl_setting_refuses_unknown(tmp_path: Path) -> None:
    from kernelctl.settings import Settings

    assert Settings(http_impl="h11").http_impl == "h11"
    with pytest.raises(ValueError):
        Settings(http_impl="h2")
