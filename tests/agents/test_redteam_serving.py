"""Red team, serving side (issue 26 items 1 and 3): REAL agents, a REAL controller on SQLite and PostgreSQL, and
a REAL serving process that runs ``torch.ops.kernelctl`` through ``kernelpack.runtime``.

Item 1, every withdrawal reaches serving:

* a bundle's first version that served and is rolled back: the agent unpublishes it (``active.json`` no longer
  names it) and the serving process falls back to the PyTorch reference;
* a stable version withdrawn: a node whose driver upgrade moved it to a stratum without a stable version is
  staged for that stratum's first version (the controller names no active and no stable version for it): it
  stops serving its old stable version, and once the candidate serves, its entry names no stable fallback;
* a bundle removed: a node re-homed to a controller that names nothing for it serves nothing of it.

Item 3, deterministic node-local gates before serving: with the judge's tick out of the way (tick once an hour,
so the controller names the candidate active after accepting the node's ok report and nothing rolls it back),
the memory and launch fault fixtures are verified by the controller and yet never published on the node: its
own trial refused them, and the report says which gate and the figures. A plan with a wide memory margin sends
that margin to the node, which then serves the memory fixture.

What is tested here happens on the node (what its runtime directory names, what its serving process runs); the
controller's side of each step (rollback, promotion, a re-registered node's stratum, report acceptance) is
tested on both databases in tests/controller. So each test here runs on one database, half of them on
PostgreSQL (the production database) and half on SQLite, rather than every test on both (issue 28: the suite's
CPU time; each of these runs real agents, trials and a serving process).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session

from agents.serve_gate import judge_trial
from controller.db.models import Node, Report
from kernelctl.wire import BundleRef, CellResources, TrialReport, TrialSpec
from kernelpack.runtime import read_active
from tests import dbutil
from tests.agents.agentutil import FAST_PROFILE, REPO_ROOT, AgentProcess, push_bundle, start_rollout, wait_for
from tests.agents.bundles import BuiltBundles, build_test_bundles
from tests.controller.serverutil import ControllerProcess, Zygote

NODE = "rt-1"
# the one database each test runs its controller on (the ``db_backend`` fixture, tests/conftest.py)
SQLITE, POSTGRES = "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)




def on(backend: Any) -> pytest.MarkDecorator:
    """Run the test on ``backend`` only (see the module docstring)."""
    return pytest.mark.parametrize("db_backend", [backend], indirect=True)


# a canary step that never gathers enough samples: nothing but the test (or a hard gate) ends it
OPEN = {"steps": [{"nodes": 1, "bake_seconds": 0, "min_samples": 100000, "deadline_seconds": 3600}],
        "trial_rounds": 1, "trial_interval_seconds": 0, "max_fleet_share": 1.0, "max_label_share": 1.0}

SERVER = r"""
import json, sys, time
from pathlib import Path
import torch
from kernelpack import torch_ops
from kernelpack.runtime import Runtime

runtime_dir, keys, cache, out = map(Path, sys.argv[1:5])
torch_ops.configure(Runtime(runtime_dir, keys, cache, arch="sm_90"), "llm-fused")
x, r, w = torch.randn(2, 64), torch.randn(2, 64), torch.ones(64)
last = None
while True:  # a decode loop: every step asks the runtime for the active version's op
    torch.ops.kernelctl.add_rmsnorm(x, r, w)
    served = torch_ops.last_served("add_rmsnorm")
    if served != last:
        with out.open("a") as f:
            f.write(json.dumps({"t": time.time(), "served": served}) + "\n")
        last = served
    time.sleep(0.02)
"""


class ServingProcess:
    """A serving process of the node: it runs ``torch.ops.kernelctl.add_rmsnorm`` in a loop from the agent's
    runtime directory and logs which version served each time that changes."""

    def __init__(self, agent: AgentProcess, trusted: Path, workdir: Path) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.out = workdir / "served.jsonl"
        self.log = workdir / "serving.log"
        args = [str(agent.runtime_dir), str(trusted), str(workdir / "cache"), str(self.out)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KERNELCTL_")}
        env.update({"PYTHONPATH": str(REPO_ROOT), "TRITON_INTERPRET": "1"})
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-c", SERVER, *args], cwd=REPO_ROOT, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                         start_new_session=True)

    def history(self) -> list[str]:
        if not self.out.exists():
            return []
        return [json.loads(line)["served"] for line in self.out.read_text().splitlines() if line.strip()]

    def serving(self) -> str | None:
        h = self.history()
        assert self.proc.poll() is None, self.log.read_text()[-3000:]
        return h[-1] if h else None

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def _published(agent: AgentProcess) -> str | None:
    entry = read_active(agent.runtime_dir).get("llm-fused")
    return entry.version if entry is not None else None


def _why(*agents: AgentProcess, ctl: ControllerProcess | None = None) -> str:
    return "\n".join(a.log_text()[-3000:] for a in agents) + (ctl.log_tail() if ctl is not None else "")


def _agent(tmp_path: Path, ctl: ControllerProcess, trusted: Path, overrides: Path,
           profile: dict[str, Any] | None = None) -> AgentProcess:
    return AgentProcess(tmp_path, controller_url=ctl.url, token=ctl.tokens["enroll"], trusted_keys=trusted,
                        node_name=NODE, overrides=overrides, profile=profile or FAST_PROFILE)


def _registered(op: httpx.Client, agent: AgentProcess) -> None:
    wait_for(lambda: any(n["name"] == NODE for n in op.get("/v1/nodes").json()), 90, "the agent to register",
             on_timeout=lambda: _why(agent))


def _promote_everywhere(op: httpx.Client, ref: str) -> None:
    rid = start_rollout(op, ref, OPEN)["id"]
    r = op.post(f"/v1/rollouts/{rid}/promote", json={"full": True, "reason": "test: stable version"})
    assert r.status_code == 200, r.text


def _serving_wait(serving: ServingProcess, want: str, what: str, agent: AgentProcess, timeout: float = 90) -> None:
    wait_for(lambda: serving.serving() == want, timeout, what,
             on_timeout=lambda: f"serving history {serving.history()}\n" + _why(agent))


@pytest.fixture
def serving_fleet(db_backend: str, bundles: BuiltBundles, sm90_overrides: Path, tmp_path: Path,
                  zygote: Zygote) -> Iterator[tuple[ControllerProcess, httpx.Client, AgentProcess, ServingProcess]]:
    """A controller with 1.0.0 and 1.1.0 pushed, one agent, and a serving process on the agent's runtime dir."""
    with dbutil.fresh_database(db_backend, tmp_path) as url, \
            ControllerProcess(url, tmp_path, trusted_keys_dir=bundles.trusted_dir, zygote=zygote) as ctl:
        op = ctl.client("operator")
        for v in ("1.0.0", "1.1.0"):
            push_bundle(op, bundles.paths[v])
        agent = _agent(tmp_path, ctl, bundles.trusted_dir, sm90_overrides).start()
        serving = ServingProcess(agent, bundles.trusted_dir, tmp_path / "serving")
        try:
            _registered(op, agent)
            _serving_wait(serving, "reference", "the serving process to start (nothing published yet)", agent)
            yield ctl, op, agent, serving
        finally:
            serving.stop()
            agent.stop()


# ------------------------------------------------------------------------------------------------ item 1
@on(POSTGRES)
def test_first_version_rolled_back_after_serving_stops_serving(serving_fleet) -> None:
    ctl, op, agent, serving = serving_fleet
    rid = start_rollout(op, "llm-fused@1.0.0", OPEN)["id"]
    _serving_wait(serving, "llm-fused@1.0.0", "the first version to serve after its trial", agent)
    r = op.post(f"/v1/rollouts/{rid}/rollback", json={"reason": "test: withdraw the first version"})
    assert r.status_code == 200, r.text
    wait_for(lambda: _published(agent) is None, 30, "active.json to stop naming the rolled-back first version",
             on_timeout=lambda: f"active.json: {read_active(agent.runtime_dir)}\n" + _why(agent, ctl=ctl))
    _serving_wait(serving, "reference", "the serving process to fall back to the PyTorch reference", agent, 30)
    assert serving.history()[-2:] == ["llm-fused@1.0.0", "reference"], serving.history()
    # the controller learns it: the node reports no active version of the bundle
    wait_for(lambda: next(n for n in op.get("/v1/nodes").json() if n["name"] == NODE)["active"] == {}, 30,
             "the node to report no active llm-fused")
    assert "withdrawn (was 1.0.0)" in agent.log_text()
    time.sleep(2.5)  # a couple more heartbeats: nothing publishes it again
    assert _published(agent) is None and serving.serving() == "reference"


@on(SQLITE)
def test_withdrawn_stable_version_is_no_longer_served_nor_a_fallback(serving_fleet, tmp_path: Path) -> None:
    ctl, op, agent, serving = serving_fleet
    _promote_everywhere(op, "llm-fused@1.0.0")
    _serving_wait(serving, "llm-fused@1.0.0", "the promoted stable version to serve", agent)
    # the node's driver is upgraded: it re-registers in a stratum (drv560) where llm-fused has no stable version
    assert agent.stop() == 0, agent.log_text()[-3000:]
    assert agent.overrides is not None
    agent.overrides.write_text('{"arch": "sm_90", "driver_version": "560.35.03", "cuda_version": "12.4"}')
    agent.start()
    wait_for(lambda: next(n for n in op.get("/v1/nodes").json() if n["name"] == NODE)["driver_version"]
             == "560.35.03", 60, "the node to re-register with its new driver", on_timeout=lambda: _why(agent))
    # that stratum's first version is staged on the node: the controller names no active and no stable version
    rid = start_rollout(op, "llm-fused@1.1.0", OPEN)["id"]
    detail = op.get(f"/v1/rollouts/{rid}").json()
    assert [s["stratum"] for s in detail["strata"]] == ["sm_90/drv560/triton3.6.0"], detail
    wait_for(lambda: _published(agent) != "1.0.0", 60, "the withdrawn stable 1.0.0 to stop serving",
             on_timeout=lambda: f"active.json: {read_active(agent.runtime_dir)}\n" + _why(agent, ctl=ctl))
    _serving_wait(serving, "llm-fused@1.1.0", "the stratum's first version to serve after its trial", agent)
    hist = serving.history()  # staged: 1.0.0 gave way to the PyTorch reference, then the verified 1.1.0
    assert hist[hist.index("llm-fused@1.0.0"):][:3] == ["llm-fused@1.0.0", "reference", "llm-fused@1.1.0"], hist
    entry = read_active(agent.runtime_dir)["llm-fused"]
    assert (entry.version, entry.stable) == ("1.1.0", None), entry  # the withdrawn 1.0.0 is no fallback
    # and when that first version is rolled back, nothing of llm-fused serves (not the old stable either)
    assert op.post(f"/v1/rollouts/{rid}/rollback", json={"reason": "test"}).status_code == 200
    _serving_wait(serving, "reference", "the PyTorch reference after the rollback", agent, 30)
    assert _published(agent) is None and "falling back to its stable" not in agent.log_text()


@on(POSTGRES)
def test_bundle_removed_from_the_controller_is_no_longer_served(serving_fleet, db_backend: str,
                                                                 bundles: BuiltBundles, tmp_path: Path,
                                                                 zygote: Zygote) -> None:
    ctl, op, agent, serving = serving_fleet
    _promote_everywhere(op, "llm-fused@1.0.0")
    _serving_wait(serving, "llm-fused@1.0.0", "the promoted stable version to serve", agent)
    # the node is re-homed to a controller that has no llm-fused at all (a new cluster, a database restored from
    # before the bundle was pushed): it names nothing for the node
    assert agent.stop() == 0, agent.log_text()[-3000:]
    (tmp_path / "other").mkdir()
    with dbutil.fresh_database(db_backend, tmp_path / "other") as url2, \
            ControllerProcess(url2, tmp_path / "other", tokens=ctl.tokens, trusted_keys_dir=bundles.trusted_dir,
                              name="other", zygote=zygote) as other:
        agent.set_controller(other.url)
        agent.start()
        op2 = other.client("operator")
        _registered(op2, agent)
        wait_for(lambda: _published(agent) is None, 30, "active.json to stop naming the removed bundle",
                 on_timeout=lambda: f"active.json: {read_active(agent.runtime_dir)}\n" + _why(agent, ctl=other))
        _serving_wait(serving, "reference", "the serving process to fall back to the PyTorch reference", agent, 30)
        time.sleep(2.5)
        assert _published(agent) is None and serving.serving() == "reference"
        assert agent.stop() == 0, agent.log_text()[-3000:]


# ------------------------------------------------------------------------------------------------ item 3
@pytest.fixture(scope="module")
def swiglu(tmp_path_factory: pytest.TempPathFactory) -> BuiltBundles:
    return build_test_bundles(tmp_path_factory.mktemp("swiglu"),
                              ("1.1.0", "1.2.0-fault.memory", "1.2.0-fault.launches"), ops=("swiglu",))


class Published:
    """Every version the agent's runtime directory names, polled every few milliseconds."""

    def __init__(self, agent: AgentProcess) -> None:
        self.agent = agent
        self.seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                v = _published(self.agent)
            except (OSError, ValueError):
                v = None
            if v is not None:
                self.seen.add(v)
            self._stop.wait(0.005)

    def __enter__(self) -> Published:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def _phase(op: httpx.Client) -> str | None:
    return next(n for n in op.get("/v1/nodes").json() if n["name"] == NODE).get("phases", {}).get("llm-fused")


def _reports(url: str, rid: int) -> list[tuple[str, dict[str, Any]]]:
    engine = create_engine(url)
    try:
        with Session(engine) as s:
            return [(o, d) for o, d in s.execute(select(Report.outcome, Report.detail).join(Node, Node.id == Report.node_id)
                                                 .where(Report.rollout_id == rid).order_by(Report.id)).all()]
    finally:
        engine.dispose()


@pytest.mark.parametrize(("fault", "gate", "db_backend"), [("1.2.0-fault.memory", "memory", "sqlite"),
                                                          pytest.param("1.2.0-fault.launches", "launches", "postgres",
                                                                       marks=pytest.mark.postgres)],
                         indirect=["db_backend"])
def test_node_never_serves_a_candidate_its_own_trial_refused(db_backend: str, swiglu: BuiltBundles,
                                                             sm90_overrides: Path, tmp_path: Path, fault: str,
                                                             gate: str, zygote: Zygote) -> None:
    with dbutil.fresh_database(db_backend, tmp_path) as url, \
            ControllerProcess(url, tmp_path, trusted_keys_dir=swiglu.trusted_dir, tick_seconds=3600,
                              zygote=zygote) as ctl:
        op = ctl.client("operator")
        for v in swiglu.paths:
            push_bundle(op, swiglu.paths[v])
        agent = _agent(tmp_path, ctl, swiglu.trusted_dir, sm90_overrides).start()
        try:
            _registered(op, agent)
            _promote_everywhere(op, "llm-fused@1.1.0")
            wait_for(lambda: _published(agent) == "1.1.0", 60, "stable 1.1.0 to serve", on_timeout=lambda: _why(agent))
            with Published(agent) as seen:
                rid = start_rollout(op, f"llm-fused@{fault}", OPEN)["id"]
                # no judge tick: the operator starts the step; the controller verifies on the node's ok report
                assert op.post(f"/v1/rollouts/{rid}/promote", json={"from_step": -1, "reason": "test: first step"}).status_code == 200
                wait_for(lambda: _phase(op) in ("verified", "serving") and len(_reports(url, rid)) >= 2, 240,
                         "the controller to verify the candidate, and a second trial report after it",
                         on_timeout=lambda: _why(agent, ctl=ctl))
            assert seen.seen == {"1.1.0"}, seen.seen  # never published, though the controller names it active
            assert _phase(op) == "verified"  # the node never reported it serving
            outcome, detail = _reports(url, rid)[0]
            assert outcome == "ok", detail  # a measured trial, reported as such: the judge keeps the fleet view
            first = detail["text"].splitlines()[0]
            print(first)
            assert first.startswith(f"node-local gate failed: {gate} swiglu@"), first
            assert first.endswith(f"this node does not serve llm-fused@{fault}"), first
            if gate == "memory":
                assert "x stable's" in first and "(margin 10%)" in first, first
            else:
                assert "swiglu@1: 2 per call vs stable's 1" in first, first
            assert first in agent.log_text()
            assert op.post(f"/v1/rollouts/{rid}/rollback", json={"reason": "test"}).status_code == 200
        finally:
            agent.stop()


@on(SQLITE)
def test_the_plans_memory_margin_reaches_the_node(db_backend: str, swiglu: BuiltBundles, sm90_overrides: Path,
                                                  tmp_path: Path, zygote: Zygote) -> None:
    """Sent with the trial: a plan that allows 20x the stable's peak memory is served by the node."""
    with dbutil.fresh_database(db_backend, tmp_path) as url, \
            ControllerProcess(url, tmp_path, trusted_keys_dir=swiglu.trusted_dir, tick_seconds=3600,
                              zygote=zygote) as ctl:
        op = ctl.client("operator")
        for v in swiglu.paths:
            push_bundle(op, swiglu.paths[v])
        agent = _agent(tmp_path, ctl, swiglu.trusted_dir, sm90_overrides).start()
        try:
            _registered(op, agent)
            _promote_everywhere(op, "llm-fused@1.1.0")
            wait_for(lambda: _published(agent) == "1.1.0", 60, "stable 1.1.0 to serve", on_timeout=lambda: _why(agent))
            rid = start_rollout(op, "llm-fused@1.2.0-fault.memory", {**OPEN, "memory_margin": 19.0})["id"]
            assert op.post(f"/v1/rollouts/{rid}/promote", json={"from_step": -1, "reason": "test: first step"}).status_code == 200
            wait_for(lambda: _published(agent) == "1.2.0-fault.memory", 240, "the candidate to serve",
                     on_timeout=lambda: _why(agent, ctl=ctl))
            first = _reports(url, rid)[0][1]["text"].splitlines()[0]
            assert first == "node-local gates passed for llm-fused@1.2.0-fault.memory", first
        finally:
            agent.stop()


@on(POSTGRES)
def test_serve_before_trial_switches_back_when_the_nodes_trial_refuses(db_backend: str, swiglu: BuiltBundles,
                                                                      sm90_overrides: Path, tmp_path: Path,
                                                                      zygote: Zygote) -> None:
    """The opt-out serves the candidate before its trial; the node's own refusal puts it back on stable."""
    with dbutil.fresh_database(db_backend, tmp_path) as url, \
            ControllerProcess(url, tmp_path, trusted_keys_dir=swiglu.trusted_dir, tick_seconds=3600,
                              zygote=zygote) as ctl:
        op = ctl.client("operator")
        for v in swiglu.paths:
            push_bundle(op, swiglu.paths[v])
        agent = _agent(tmp_path, ctl, swiglu.trusted_dir, sm90_overrides).start()
        try:
            _registered(op, agent)
            _promote_everywhere(op, "llm-fused@1.1.0")
            wait_for(lambda: _published(agent) == "1.1.0", 60, "stable 1.1.0 to serve", on_timeout=lambda: _why(agent))
            rid = start_rollout(op, "llm-fused@1.2.0-fault.memory", {**OPEN, "serve_before_trial": True})["id"]
            assert op.post(f"/v1/rollouts/{rid}/promote", json={"from_step": -1, "reason": "test"}).status_code == 200
            wait_for(lambda: _published(agent) == "1.2.0-fault.memory", 60, "the candidate to serve before its trial",
                     on_timeout=lambda: _why(agent, ctl=ctl))
            wait_for(lambda: _reports(url, rid), 240, "its trial report", on_timeout=lambda: _why(agent, ctl=ctl))
            wait_for(lambda: _published(agent) == "1.1.0", 30, "the node to switch back to stable",
                     on_timeout=lambda: _why(agent, ctl=ctl))
            wait_for(lambda: _phase(op) == "verified", 30, "the controller to see it no longer served")
            time.sleep(2.5)  # more heartbeats: the controller still names it active, the node keeps refusing
            assert _published(agent) == "1.1.0"
        finally:
            agent.stop()


# ------------------------------------------------------------------------------ the verdict, gate by gate
def _report(*cells: CellResources, free: int | None = None, outcome: str = "ok") -> TrialReport:
    return TrialReport(idempotency_key="rt-1:0123456789", rollout_id=1, stratum="s", candidate=CAND, stable=STABLE,
                       outcome=outcome, measured_at=dt.datetime.now(dt.timezone.utc), resources=list(cells),
                       free_memory_bytes=free)


CAND = BundleRef(name="llm-fused", version="1.2.0", digest="c" * 64)
STABLE = BundleRef(name="llm-fused", version="1.1.0", digest="5" * 64)
SPEC = TrialSpec(rollout_id=1, stratum="s", candidate=CAND, stable=STABLE)


def test_verdict_names_the_gate_and_figures_of_the_worst_cell() -> None:
    cell = CellResources(op="swiglu", tokens=64, stable_peak_bytes=1 << 20, candidate_peak_bytes=7 << 20,
                         stable_launches=1, candidate_launches=1)
    small = CellResources(op="swiglu", tokens=1, stable_peak_bytes=1000, candidate_peak_bytes=7000,
                          stable_launches=1, candidate_launches=2)
    v = judge_trial(_report(small, cell, free=80 << 30), SPEC)
    assert (v.ok, v.gate) == (False, "memory")
    assert v.line() == ("node-local gate failed: memory swiglu@64: candidate peak 7 MiB = 7.00x stable's 1 MiB "
                        "(margin 10%) (+2 more); this node does not serve llm-fused@1.2.0")
    assert v.failures[2] == "launches swiglu@1: 2 per call vs stable's 1"
    # past the node's free memory comes first: it takes a serving process down
    v = judge_trial(_report(cell, free=6 << 20), SPEC)
    assert v.gate == "headroom" and v.failures[0] == ("headroom swiglu@64: candidate peak 7 MiB past the node's free "
                                                      "memory 6 MiB")
    # the plan's margin and launch gate, as sent with the trial
    wide = SPEC.model_copy(update={"memory_margin": 9.0, "launch_gate": "warn"})
    v = judge_trial(_report(small, cell), wide)
    assert v.ok and v.warnings == ("launches swiglu@1: 2 per call vs stable's 1",), v
    assert v.line() == ("node-local gates passed for llm-fused@1.2.0 (warnings: launches swiglu@1: 2 per call vs "
                        "stable's 1)")
    # within the margin, same launches: served; a hard failure never is
    same = CellResources(op="swiglu", tokens=64, stable_peak_bytes=1000, candidate_peak_bytes=1100,
                         stable_launches=1, candidate_launches=1)
    assert judge_trial(_report(same), SPEC).ok
    assert judge_trial(_report(same, outcome="crash"), SPEC).gate == "outcome"
    # a first version (no stable figures): headroom only
    first = CellResources(op="swiglu", tokens=64, candidate_peak_bytes=7 << 20, candidate_launches=3)
    assert judge_trial(_report(first, free=8 << 20), SPEC).ok
    assert judge_trial(_report(first, free=1 << 20), SPEC).gate == "headroom"
