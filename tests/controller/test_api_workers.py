"""Several API worker processes per replica (``kernelctl serve --workers N``): a listening socket each, each worker
with its own desired-state snapshot woken by LISTEN/NOTIFY, exactly one leader among them, metrics summed over
them, SIGTERM stopping them all; on SQLite more than one worker is refused before anything starts."""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from pathlib import Path

import httpx
import psycopg
import pytest
from typer.testing import CliRunner

from cli.app import app as cli_app
from controller.leader import _conninfo, lock_key
from tests.controller.serverutil import (
    ControllerProcess,
    TestBundles,
    Zygote,
    register_node,
)

WORKERS = 2


def test_sqlite_refuses_several_workers_before_anything_starts(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    db = tmp_path / "kernelctl.db"
    res = CliRunner().invoke(cli_app, ["serve", "--workers", "2", "--db", f"sqlite:///{db}", "--port", "0"])
    assert res.exit_code == 2, res.output  # a usage error (kernelctl.console.EXIT_USAGE)
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "2 API workers need PostgreSQL" in lines[0], res.output
    assert not db.exists()  # nothing created
    monkeypatch.setenv("KERNELCTL_API_WORKERS", "3")  # the setting, not only the flag
    res = CliRunner().invoke(cli_app, ["serve", "--db", f"sqlite:///{db}", "--port", "0"])
    assert res.exit_code == 2 and "3 API workers need PostgreSQL" in res.output, res.output
    assert not db.exists()


def _pinned_clients(ctl: ControllerProcess, tokens: list[str]) -> list[tuple[int, httpx.Client]]:
    """One keep-alive client per token, each on a connection that a different worker process accepted (its
    ``/readyz`` names the process); connections accepted by a worker already taken are closed and opened again."""
    out: list[tuple[int, httpx.Client]] = []
    for _ in range(300):
        if len(out) == len(tokens):
            return out
        c = ctl.client(token=tokens[len(out)], timeout=60)
        pid = c.get("/readyz").json()["pid"]
        if pid in {p for p, _ in out}:
            c.close()
        else:
            out.append((pid, c))
    raise AssertionError(f"only {len(out)} worker processes accepted 300 connections")


def _heartbeat(c: httpx.Client, name: str, **kw: object) -> dict:
    r = c.post("/v1/agents/heartbeat", json={"node_name": name, **kw})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.postgres
def test_two_workers_one_leader_watches_woken_on_both(pg_url: str, tmp_path: Path, stable_bundle: TestBundles,
                                                      zygote: Zygote) -> None:
    # the poll fallback far away: only LISTEN/NOTIFY can wake the other worker's watch within the test's limit
    env = {"KERNELCTL_API_WORKERS": str(WORKERS), "KERNELCTL_WATCH_POLL_SECONDS": "60",
           "KERNELCTL_KEEPALIVE_TIMEOUT_SECONDS": "120"}
    ctl = ControllerProcess(pg_url, tmp_path, trusted_keys_dir=stable_bundle.keys_dir, extra_env=env, zygote=zygote)
    ctl.start(wait_leader=True)
    with ctl:
        names = [f"w-{i}" for i in range(WORKERS)]
        tokens = []
        for name in names:
            node = register_node(ctl, name)
            tokens.append(node.headers["authorization"].removeprefix("Bearer "))
            node.close()
        pinned = _pinned_clients(ctl, tokens)
        pids = [pid for pid, _ in pinned]
        assert len(set(pids)) == WORKERS
        # each worker listens with a socket of its own (SO_REUSEPORT): the kernel spreads connections evenly,
        # no worker takes a whole burst from a shared queue (controller.server.WorkerSocket)
        port = int(ctl.url.rsplit(":", 1)[1])
        listening = _listening_inodes(port)
        assert len(listening) == WORKERS, listening
        assert sorted(len(_socket_inodes(pid) & listening) for pid in pids) == [1] * WORKERS
        # exactly one leader: one advisory lock granted, while every worker's elector holds a connection
        with psycopg.connect(_conninfo(pg_url), autocommit=True) as pg:
            key = lock_key()
            granted = pg.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 1 "
                "AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
                "AND ((classid::bigint << 32) | objid::bigint) = %s", (key,)).fetchone()[0]
            apps = dict(pg.execute("SELECT application_name, count(*) FROM pg_stat_activity "
                                   "WHERE datname = current_database() GROUP BY 1").fetchall())
        assert granted == 1
        assert apps.get("kernelctl-leader") == WORKERS and apps.get("kernelctl-watch") == WORKERS, apps
        leaders = {pid: c.get("/readyz").json()["leader"] for pid, c in pinned}
        assert sorted(leaders.values()) == [False, True], leaders
        # a watch held on each worker; one promotion, made through whichever worker the operator reaches
        gens = {name: _heartbeat(c, name)["generation"] for (_pid, c), name in zip(pinned, names, strict=True)}
        replies: dict[str, dict] = {}

        def watch(c: httpx.Client, name: str) -> None:
            """Watch as an agent does until the node's desired state names 1.0.0 active: the leader's tick may
            start the rollout (the node a canary, nothing active yet) between the rollout's creation and the
            promotion, and that wakes the watch first."""
            have = gens[name]
            for _ in range(5):
                reply = {**_heartbeat(c, name, generation=have, wait_seconds=30), "at": time.monotonic()}
                replies[name] = reply
                if [(d.get("active") or {}).get("version") for d in reply["desired"]] == ["1.0.0"]:
                    return
                have = reply["generation"]

        threads = [threading.Thread(target=watch, args=(c, name)) for (_pid, c), name in zip(pinned, names,
                                                                                            strict=True)]
        for th in threads:
            th.start()
        time.sleep(1.0)
        assert all(th.is_alive() for th in threads)  # held: nothing changed yet
        with ctl.client("operator") as op:
            assert op.post("/v1/bundles", content=stable_bundle.files["1.0.0"].read_bytes()).status_code == 201
            ro = op.post("/v1/rollouts", json={"bundle": "llm-fused@1.0.0", "reason": "baseline", "plan": {
                "steps": [{"percent": 100, "bake_seconds": 0, "min_samples": 1}]}}).json()
            r = op.post(f"/v1/rollouts/{ro['id']}/promote", json={"full": True, "reason": "baseline"})
            assert r.status_code == 200, r.text
            promoted = time.monotonic()
        for th in threads:
            th.join(40)
            assert not th.is_alive()
        for name in names:
            reply = replies[name]
            assert reply["at"] - promoted < 10.0, f"{name}'s watch was not woken by the promotion"
            assert reply["generation"] > gens[name]
            assert [d["active"]["version"] for d in reply["desired"]] == ["1.0.0"]
        assert [c.get("/readyz").json()["pid"] for _pid, c in pinned] == pids  # each watch stayed on its worker
        # /metrics: the replica's sums whichever worker answers (multiprocess mode)
        text = httpx.get(ctl.url + "/metrics").text
        assert re.search(r"^kernelctl_leader 1\.0$", text, re.M), text[:2000]
        served = sum(float(v) for v in re.findall(
            r'^kernelctl_heartbeat_service_seconds_count\{[^}]*\} (\S+)$', text, re.M))
        assert served >= 2 * WORKERS  # both workers' heartbeats, counted once each
        assert re.search(r'^kernelctl_nodes\{arch="sm_90",state="active"\} 2\.0$', text, re.M)  # the fleet gauges once
        for _pid, c in pinned:
            c.close()
    # SIGTERM stopped every worker (graceful: the log says so) and the parent
    assert all(not _alive(pid) for pid in pids)
    log = ctl.log_text()
    assert log.count("Application shutdown complete") >= WORKERS and "kernelctl controller stopped" in log


def _listening_inodes(port: int) -> set[int]:
    """The inodes of the sockets listening on ``port`` (``/proc/net/tcp``: state 0A)."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                out.add(int(f[9]))
    return out


def _socket_inodes(pid: int) -> set[int]:
    out = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                out.add(int(target[8:-1]))
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
