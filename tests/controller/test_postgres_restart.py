"""PostgreSQL restarted mid-rollout: the controller recovers with no operator action.

A REAL ``kernelctl serve`` runs a rollout on a PostgreSQL cluster of this test's own (initdb + pg_ctl on a free
port and a temporary data directory, tests/provision.py); that server is restarted with ``pg_ctl restart`` while
agents keep calling. Requests that need the database fail during the outage (503,
never a crash or a hang; heartbeats that change nothing may be answered from the replica's snapshot),
then succeed again on fresh pooled connections; the leader re-takes its advisory lock, the tick resumes and
the rollout is promoted; no acknowledged report is lost.

The server every other test shares (127.0.0.1:5432, or ``KERNELCTL_TEST_PG_URL``) is never touched: this test
connects only to its own cluster, so it runs side by side with the rest of the suite.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg
import pytest
from sqlalchemy import func, select
from sqlalchemy.engine import make_url

from tests import dbutil
from tests.controller.serverutil import ControllerProcess, build_test_bundles, inventory
from tests.provision import PgCluster

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


@pytest.fixture
def own_cluster() -> Iterator[PgCluster]:
    """A PostgreSQL server started for this test alone (stopped and removed afterwards)."""
    with PgCluster("restart-test") as cluster:
        yield cluster


def _database(cluster: PgCluster) -> str:
    """A database migrated to head on ``cluster``: its URL."""
    from controller.db import migrate
    from controller.db.engine import make_engine

    url = make_url(cluster.url).set(database="kctl_restart").render_as_string(hide_password=False)
    with psycopg.connect(f"host=127.0.0.1 port={cluster.port} user=postgres dbname=postgres", autocommit=True) as c:
        c.execute("CREATE DATABASE kctl_restart")
    engine = make_engine(url)
    migrate.upgrade(engine)
    engine.dispose()
    return url


def _started_at(url: str) -> object:
    """When the server behind ``url`` started (changes when it restarts)."""
    conninfo = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(conninfo, connect_timeout=10) as conn:
        return conn.execute("SELECT pg_postmaster_start_time()").fetchone()


def _report(trial: dict, node: str) -> dict:
    return {
        "idempotency_key": f"pgr-{node}-{uuid.uuid4().hex[:12]}", "rollout_id": trial["rollout_id"],
        "stratum": trial["stratum"], "candidate": trial["candidate"], "stable": trial["stable"], "outcome": "ok",
        "measured_at": dt.datetime.now(dt.timezone.utc).isoformat(), "duration_s": 0.5,
        "latency": [{"op": "bias_gelu", "tokens": 8, "stable_s": 1e-4, "candidate_s": 1e-4}],
        "numerics": [{"op": "bias_gelu", "dtype": "fp16", "shape": {"M": 8, "N": 64}, "max_abs_err": 1e-4,
                      "max_rel_err": 1e-3, "within_tolerance": True}],
    }


class Agent:
    """A minimal agent: heartbeat, and report when the reply asks for a trial."""

    def __init__(self, ctl: ControllerProcess, name: str) -> None:
        self.ctl, self.name = ctl, name
        with ctl.client("enroll") as c:
            r = c.post("/v1/agents/register", json={"node_name": name, "inventory": inventory()})
            r.raise_for_status()
        self.client = ctl.client(token=r.json()["node_token"], timeout=20)
        self.acked: list[str] = []

    def heartbeat(self) -> httpx.Response:
        return self.client.post("/v1/agents/heartbeat", json={"node_name": self.name})

    def round(self) -> int:
        """One heartbeat + reports round; returns the heartbeat status."""
        r = self.heartbeat()
        if r.status_code != 200:
            return r.status_code
        for d in r.json()["desired"]:
            if d.get("trial"):
                batch = [_report(d["trial"], self.name) for _ in range(2)]
                rr = self.client.post("/v1/agents/reports", json={"node_name": self.name, "reports": batch})
                if rr.status_code == 200:  # acknowledged: every key the reply does not refuse (a report that
                    refused = rr.json().get("refused") or {}  # arrives after its rollout moved on is refused)
                    self.acked += [b["idempotency_key"] for b in batch if b["idempotency_key"] not in refused]
        return 200


def _wait(pred, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_controller_recovers_from_postgres_restart_mid_rollout(tmp_path: Path, own_cluster: PgCluster) -> None:
    shared = make_url(dbutil.PG_ADMIN_URL)
    assert (shared.host, shared.port or 5432) != ("127.0.0.1", own_cluster.port)
    bundles = build_test_bundles(tmp_path / "bundles", versions=("1.0.0",))
    url = _database(own_cluster)
    with ControllerProcess(url, tmp_path, trusted_keys_dir=bundles.keys_dir, tick_seconds=0.5) as ctl:
        ctl.wait_ready(leader=True)
        op = ctl.client("operator")
        r = op.post("/v1/bundles", content=bundles.files["1.0.0"].read_bytes())
        assert r.status_code in (200, 201), r.text
        agents = [Agent(ctl, f"pgr-{i}") for i in range(2)]
        for a in agents:
            assert a.round() == 200
        plan = {"steps": [{"nodes": 1, "bake_seconds": 0, "min_samples": 2},
                          {"percent": 100, "bake_seconds": 0, "min_samples": 4}],
                "max_fleet_share": 1.0, "max_label_share": 1.0, "trial_interval_seconds": 0}
        r = op.post("/v1/rollouts", json={"bundle": "llm-fused@1.0.0", "plan": plan, "reason": "pg restart test"})
        assert r.status_code == 201, r.text
        rid = r.json()["id"]

        def status() -> dict:
            return op.get(f"/v1/rollouts/{rid}").json()

        # step 0: one canary reports; the judge widens to step 1 (100%)
        def at_step_1() -> bool:
            for a in agents:
                a.round()
            return status()["strata"][0]["step_index"] >= 1

        _wait(at_step_1, 30, "the rollout to reach step 1")
        assert status()["state"] == "progressing"

        # restart PostgreSQL while an agent keeps heartbeating and the operator keeps reading the rollout
        outcomes: list[int | str] = []  # the rollout status: needs the database
        beats: list[int | str] = []  # heartbeats: answered from the replica's snapshot when nothing changes
        stop = threading.Event()

        def hammer() -> None:
            while not stop.is_set():
                for calls, call in ((beats, agents[0].heartbeat), (outcomes, lambda: op.get(f"/v1/rollouts/{rid}"))):
                    try:
                        calls.append(call().status_code)
                    except httpx.HTTPError as exc:
                        calls.append(type(exc).__name__)
                time.sleep(0.02)

        t = threading.Thread(target=hammer, daemon=True)
        t.start()
        time.sleep(0.3)
        shared_started, own_started = _started_at(dbutil.PG_ADMIN_URL), _started_at(url)
        own_cluster.restart("fast")  # this test's server only
        assert _started_at(dbutil.PG_ADMIN_URL) == shared_started, "the shared PostgreSQL server was restarted"
        _wait(lambda: outcomes and outcomes[-1] == 200, 30, "heartbeats to succeed again after the restart")
        stop.set()
        t.join(10)
        failed = [o for o in outcomes if o != 200]
        assert failed, "no request failed: the restart was not observed"
        assert set(failed) <= {503}, f"requests during the outage must fail with 503, got {sorted(set(map(str, failed)))}"
        assert set(beats) <= {200, 503} and beats[-1] == 200, sorted(set(map(str, beats)))
        assert ctl.running, ctl.log_tail()

        # no operator action: the leader is back, the tick resumes and the rollout finishes
        ctl.wait_ready(timeout=30, leader=True)

        def promoted() -> bool:
            for a in agents:
                a.round()
            return status()["state"] == "promoted"

        _wait(promoted, 60, "the rollout to be promoted after the restart")
        assert _started_at(url) != own_started, "the test's own server was not restarted"
        assert "database error" in ctl.log_text()  # the outage was seen and logged, not hidden

        # nothing acknowledged was lost
        from controller.db.engine import make_engine
        from controller.db.models import Report

        acked = [k for a in agents for k in a.acked]
        engine = make_engine(url)
        try:
            with engine.connect() as conn:
                stored = conn.execute(select(func.count()).select_from(Report)
                                      .where(Report.idempotency_key.in_(acked))).scalar_one()
        finally:
            engine.dispose()
        assert stored == len(acked) > 0
