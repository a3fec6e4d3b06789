"""The fleet simulator end to end at small scale: a REAL ``kernelctl serve`` on a fresh PostgreSQL database,
50 simulated agents speaking the real protocol. A clean candidate must be promoted with no report lost and no
node stale; a candidate 10% slower must be rolled back everywhere and every canary must be back on the stable
version within 5 s of the rollback decision (pushed through the watch). The agents' own HTTP client
(sim/fleet/http.py: keep-alive per agent, idle connections dropped before the server drops them, one retry on a
connection the server closed) is checked against a real uvicorn on loopback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import dbutil

pytestmark = [pytest.mark.postgres, pytest.mark.slow]
REPO_ROOT = Path(__file__).resolve().parents[2]


def _fleet_cmd() -> list[str]:
    """``kernelctl sim fleet`` (the root CLI mounts sim/fleet/cli.py)."""
    return [sys.executable, "-m", "cli.app", "sim", "fleet"]


@pytest.fixture(scope="module")
def bundle_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from sim.fleet.bundles import prepare_bundles

    cache = tmp_path_factory.mktemp("sim-bundles")
    prepare_bundles(cache)  # build the signed bundles once for the module (kernelpack.build)
    return cache


def run_fleet(scenario: str, bundle_cache: Path, tmp_path: Path) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1", "TMPDIR": str(tmp_path)}
    cmd = [*_fleet_cmd(), "--nodes", "50", "--scenario", scenario, "--json", "--fresh",
           "--db", dbutil.PG_ADMIN_URL, "--heartbeat-seconds", "2", "--tick-seconds", "0.5", "--trial-interval", "0.4",
           "--duration-limit", "100", "--bundle-cache", str(bundle_cache), "--lost-reply-share", "0.2"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=150)
    assert proc.stdout.strip(), f"no output (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    res = json.loads(proc.stdout)
    res["_rc"] = proc.returncode
    return res


def test_healthy_rollout_is_promoted_with_no_report_lost(bundle_cache: Path, tmp_path: Path) -> None:
    res = run_fleet("healthy", bundle_cache, tmp_path)
    assert res["outcome"] == "promoted", res["rollout"]
    assert set(res["rollout"]["strata"].values()) == {"promoted"}
    assert len(res["rollout"]["strata"]) == 3  # heterogeneous fleet: three strata
    assert res["false_rollbacks"] == []
    rep = res["reports"]
    assert rep["sent"] > 0 and rep["lost"] == 0 and rep["stored"] + rep["refused"] == rep["sent"], rep
    assert res["http"]["heartbeat"]["count"] >= 50
    assert res["tick"]["count"] > 0  # scraped from the controller's /metrics
    assert res["http"]["heartbeat"]["server_fast"]["count"] > 0  # heartbeats answered from the snapshot
    assert res["stale"]["nodes_stale"] == 0
    # registration as the real agent does it: replies lost on purpose, retried with the same key, none locked out
    assert res["registration"]["replies_lost_on_purpose"] > 0 and res["registration"]["locked_out"] == 0
    assert res["registered"] == 50
    assert res["downloads"]["per_agent"] and res["downloads"]["completed"] > 2  # each canary downloads itself
    assert res["passed"] and res["_rc"] == 0, res["checks"]


def test_latency_regression_rolls_back_every_stratum(bundle_cache: Path, tmp_path: Path) -> None:
    res = run_fleet("latency-regression", bundle_cache, tmp_path)
    assert res["outcome"] == "rolled_back", res["rollout"]
    assert set(res["rollout"]["strata"].values()) == {"rolled_back"}
    assert res["reports"]["lost"] == 0
    ttr = res["time_to_rollback_s"]
    assert ttr["canaries"] > 0 and ttr["max"] is not None and ttr["max"] > 0
    pushed = res["decision_to_stable_s"]  # the rollback reaches the waiting canaries through their watch
    assert pushed["canaries"] > 0 and pushed["max"] is not None and pushed["max"] < 5.0, pushed
    assert res["checks"]["rolled_back_canaries_back_on_stable"]
    assert res["checks"]["no_node_stale_but_the_stopped"]
    assert res["passed"] and res["_rc"] == 0, res["checks"]


def test_agent_http_client_keeps_alive_drops_idle_and_retries_a_closed_connection() -> None:
    """sim.fleet.http against a real uvicorn (keep-alive 1 s) on loopback: a lane reuses its connection,
    concurrent requests of one lane get their own, an idle connection is dropped before the server's keep-alive
    timeout, a connection the server closed under a reused lane is retried once on a new one, a deadline is a
    ReadTimeout, and Retry-After / bodies come through."""
    import asyncio
    import socket
    import time

    import uvicorn

    from sim.fleet import http

    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        if scope["type"] != "http":
            return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        if scope["path"] == "/sleep":
            await asyncio.sleep(2)
        status = 503 if scope["path"] == "/busy" else 200
        await send({"type": "http.response.start", "status": status, "headers": [(b"retry-after", b"3")]})
        await send({"type": "http.response.body", "body": b"echo:" + body})

    async def main() -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_keep_alive=1, http="h11"))
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.02)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        c = http.Client(url, idle_expiry=0.6)
        for i in range(4):
            r = await c.request("a", "POST", "/x", [(b"content-type", b"application/json")], b"%d" % i)
            assert (r.status_code, r.content) == (200, b"echo:%d" % i)
        assert c.opened == 1  # kept alive
        busy = await c.request("a", "GET", "/busy", [])
        assert busy.status_code == 503 and busy.headers["retry-after"] == "3"
        both = await asyncio.gather(c.request("a", "POST", "/x", [], b"p"), c.request("a", "POST", "/x", [], b"q"))
        assert [r.content for r in both] == [b"echo:p", b"echo:q"] and c.opened == 2
        await asyncio.sleep(1.3)  # past the client's 0.6 s and the server's 1 s: the client dropped them first
        assert not c.idle and not c.connections
        t0 = time.perf_counter()
        with pytest.raises(http.ReadTimeout):
            await c.request("b", "GET", "/sleep", [], timeout=0.3)
        assert time.perf_counter() - t0 < 1.0
        # the server closes every connection while the lane holds an idle one: retried once, on a new one
        await c.request("c", "GET", "/x", [])
        for proto in list(server.server_state.connections):
            proto.transport.close()
        opened = c.opened
        r = await c.request("c", "GET", "/x", [])
        assert r.status_code == 200 and c.opened == opened + 1 and c.retried == 1
        await c.aclose()
        server.should_exit = True
        await serving
        down = http.Client(url)
        with pytest.raises(http.ConnectError):
            await down.request("d", "GET", "/x", [])
        await down.aclose()

    asyncio.run(main())
