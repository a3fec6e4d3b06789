"""Trial before serve with REAL agents and a REAL controller (CPU, Triton interpreter).

A watcher thread reads every agent's published ``active.json`` (what kernelpack.runtime serves) every few
milliseconds while rollouts run:

* the numeric-drift fixture is staged and trialled on every canary, rolled back, and never published on any
  node at any moment (and the audit's "what ran" never names it); the crash fixture under
  ``serve_before_trial: true`` is published before its trial (the old behaviour, the opt-out);
* a good candidate is published on each canary only after the controller accepted that node's ok report
  (changelog timestamps), the controller shows the phase per node, paired trials go on while it serves, and
  a rollback puts every node back on its stable version within a few heartbeats.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session

from controller.audit import nodes_that_ran
from controller.db.models import Activation, Bundle, Event, Node, Report
from kernelpack.runtime import read_active
from tests import dbutil
from tests.agents.agentutil import FAST_PROFILE, AgentProcess, push_bundle, start_rollout, wait_for
from tests.agents.bundles import BuiltBundles
from tests.controller.serverutil import ControllerProcess, Zygote
from tests.controller.test_cli_remote import kctl, ok

NODES = ("sp-1", "sp-2")
ROLLBACK_LIMIT_S = 5.0  # heartbeat 1 s: the switch back comes with the next heartbeat reply


def plan(**kw: Any) -> dict[str, Any]:
    """Both nodes canaries at once; ``min_samples`` large keeps the step open (trials go on)."""
    return {"steps": [{"nodes": len(NODES), "bake_seconds": 0, "min_samples": kw.pop("min_samples", 1),
                       "deadline_seconds": 600}], "trial_rounds": 1, "trial_interval_seconds": 0,
            "max_fleet_share": 1.0, "max_label_share": 1.0, **kw}


class Watcher:
    """Records every version each agent's runtime directory publishes, with the wall-clock time seen."""

    def __init__(self, agents: list[AgentProcess]) -> None:
        self.agents = agents
        self.seen: list[tuple[float, str, str]] = []  # (time.time(), node, version)
        self.current: dict[str, str | None] = {a.node_name: None for a in agents}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for a in self.agents:
                try:
                    entry = read_active(a.runtime_dir).get("llm-fused")
                except (OSError, ValueError):
                    continue
                version = entry.version if entry is not None else None
                if version != self.current[a.node_name]:
                    self.current[a.node_name] = version
                    if version is not None:
                        self.seen.append((time.time(), a.node_name, version))
            self._stop.wait(0.005)

    def versions(self) -> set[str]:
        return {v for _, _, v in self.seen}

    def first_seen(self, node: str, version: str) -> float | None:
        return next((t for t, n, v in self.seen if n == node and v == version), None)

    def __enter__(self) -> Watcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.fixture
def fleet(bundles: BuiltBundles, sm90_overrides: Path, tmp_path: Path, zygote: Zygote):
    """A controller, two sm_90 agents serving llm-fused 1.0.0 (promoted), the other versions pushed."""
    with dbutil.fresh_database("sqlite", tmp_path) as url, \
            ControllerProcess(url, tmp_path, trusted_keys_dir=bundles.trusted_dir, zygote=zygote) as ctl:
        op = ctl.client("operator")
        for v in ("1.0.0", "1.1.0", "1.2.0-fault.drift", "1.2.0-fault.crash"):
            push_bundle(op, bundles.paths[v])
        agents = [AgentProcess(tmp_path, controller_url=ctl.url, token=ctl.tokens["enroll"],
                               trusted_keys=bundles.trusted_dir, node_name=n, overrides=sm90_overrides,
                               profile=FAST_PROFILE).start() for n in NODES]
        engine = create_engine(url)
        try:
            wait_for(lambda: len(op.get("/v1/nodes").json()) == len(NODES), 90, "the agents to register",
                     on_timeout=lambda: agents[0].log_text()[-3000:])
            rid = start_rollout(op, "llm-fused@1.0.0", plan())["id"]
            r = op.post(f"/v1/rollouts/{rid}/promote", json={"full": True, "reason": "first version"})
            assert r.status_code == 200, r.text
            wait_for(lambda: all(_published(a) == "1.0.0" for a in agents), 60, "1.0.0 published on both nodes",
                     on_timeout=lambda: agents[0].log_text()[-3000:] + ctl.log_tail())
            yield ctl, op, agents, engine
        finally:
            for a in agents:
                assert a.stop() == 0, a.log_text()[-3000:]
            engine.dispose()


def _published(agent: AgentProcess) -> str | None:
    entry = read_active(agent.runtime_dir).get("llm-fused")
    return entry.version if entry is not None else None


def _utc(t: dt.datetime) -> float:
    return (t if t.tzinfo else t.replace(tzinfo=dt.timezone.utc)).timestamp()


def _wait_state(op: httpx.Client, rid: int, state: str, agents: list[AgentProcess], ctl: ControllerProcess) -> None:
    wait_for(lambda: op.get(f"/v1/rollouts/{rid}").json()["state"] == state, 90, f"rollout {rid} {state}",
             on_timeout=lambda: "\n".join(a.log_text()[-2500:] for a in agents) + ctl.log_tail())


def test_faulty_candidate_is_never_served_unless_the_plan_opts_out(fleet, bundles: BuiltBundles) -> None:
    ctl, op, agents, engine = fleet
    with Watcher(agents) as w:
        rid = start_rollout(op, "llm-fused@1.2.0-fault.drift", plan())["id"]
        _wait_state(op, rid, "rolled_back", agents, ctl)
        time.sleep(2.5)  # a couple more heartbeats: nothing switches to it late either
    assert w.versions() == {"1.0.0"}, w.seen  # never published, on any node, at any moment
    with Session(engine) as s:
        outcomes = s.execute(select(Node.name, Report.outcome).join(Node, Node.id == Report.node_id)
                             .where(Report.rollout_id == rid)).all()
        assert outcomes and {o for _, o in outcomes} == {"numeric_error"}, outcomes
        assert nodes_that_ran(s, "llm-fused@1.2.0-fault.drift") == []  # the audit: it never ran anywhere
        assert s.scalars(select(Event).where(Event.rollout_id == rid, Event.action == "assignment.verified")).all() \
            == []
    # it was really staged and trialled on the node(s) that reported, not merely never sent
    for a in agents:
        if any(n == a.node_name for n, _ in outcomes):
            assert "trial of llm-fused@1.2.0-fault.drift" in a.log_text()

    # the opt-out: serve_before_trial publishes the candidate at once, before its trial's verdict
    with Watcher(agents) as w:
        rid = start_rollout(op, "llm-fused@1.2.0-fault.crash", plan(serve_before_trial=True))["id"]
        _wait_state(op, rid, "rolled_back", agents, ctl)
        wait_for(lambda: all(_published(a) == "1.0.0" for a in agents), 30, "both nodes back on 1.0.0")
    assert "1.2.0-fault.crash" in w.versions(), w.seen
    with Session(engine) as s:
        ran = nodes_that_ran(s, "llm-fused@1.2.0-fault.crash")
        assert ran and all(r["rollout_id"] == rid and r["verified_at"] is None for r in ran), ran


def test_good_candidate_serves_after_its_report_was_accepted_and_rolls_back_fast(fleet) -> None:
    ctl, op, agents, engine = fleet
    with Watcher(agents) as w:
        rid = start_rollout(op, "llm-fused@1.1.0", plan(min_samples=100000))["id"]
        wait_for(lambda: all(w.current[a.node_name] == "1.1.0" for a in agents), 90, "1.1.0 serving on both",
                 on_timeout=lambda: "\n".join(a.log_text()[-2500:] for a in agents) + ctl.log_tail())
        wait_for(lambda: {n["name"]: n.get("phases", {}).get("llm-fused") for n in op.get("/v1/nodes").json()}
                 == dict.fromkeys(NODES, "serving"), 30, "the controller to show phase serving on both nodes")
        # the phase in the rollout status, the compatibility view and the metrics
        (stratum,) = op.get(f"/v1/rollouts/{rid}").json()["strata"]
        assert {k: stratum["nodes"][k] for k in ("staged", "verified", "serving")} == \
            {"staged": 0, "verified": 0, "serving": 2}, stratum
        (cell,) = [c for c in op.get("/v1/compat").json() if c["bundle"] == "llm-fused@1.1.0"]
        assert (cell["state"], cell["phases"]) == ("candidate", {"staged": 0, "verified": 0, "serving": 2}), cell
        metrics = httpx.get(ctl.url + "/metrics").text
        assert 'kernelctl_canary_nodes{phase="serving"} 2.0' in metrics, metrics[-2000:]
        nodes_out = ok(kctl(ctl, "nodes"))
        assert all(line.count("llm-fused: serving") == 1 for line in nodes_out.splitlines() if "sp-" in line)
        assert "0/0/2" in ok(kctl(ctl, "rollout", "status", str(rid)))  # staged/verified/serving
        with Session(engine) as s:
            cand = s.scalar(select(Bundle.id).where(Bundle.version == "1.1.0"))
            for node in NODES:
                nid = s.scalar(select(Node.id).where(Node.name == node))
                first_ok = s.scalar(select(Report.received_at).where(
                    Report.node_id == nid, Report.rollout_id == rid, Report.outcome == "ok")
                    .order_by(Report.received_at).limit(1))
                verified = s.scalar(select(Event.at).where(Event.node == node, Event.rollout_id == rid,
                                                           Event.action == "assignment.verified"))
                act = s.scalars(select(Activation).where(Activation.node_id == nid, Activation.bundle_id == cand)
                                ).one()
                published = w.first_seen(node, "1.1.0")
                assert first_ok is not None and verified is not None and published is not None
                # the order the issue asks for: report accepted -> verified -> published -> recorded serving
                assert _utc(first_ok) <= _utc(verified) <= published <= _utc(act.started_at) + 0.05, (
                    node, first_ok, verified, published, act.started_at)
                # the activation names the rollout and when the verifying report (the first ok one) was accepted
                assert (act.rollout_id, _utc(act.verified_at)) == (rid, _utc(first_ok))

        def trials_while_serving() -> bool:  # paired latency trials go on while the candidate serves
            with Session(engine) as s:
                for node in NODES:
                    nid = s.scalar(select(Node.id).where(Node.name == node))
                    since = s.scalar(select(Activation.started_at).where(
                        Activation.node_id == nid, Activation.bundle_id == cand))
                    n = s.scalar(select(Report.id).where(Report.node_id == nid, Report.rollout_id == rid,
                                                         Report.n_pairs > 0, Report.measured_at > since).limit(1))
                    if n is None:
                        return False
                return True

        wait_for(trials_while_serving, 60, "a paired trial report from each node while 1.1.0 serves")
        t0 = time.time()
        r = op.post(f"/v1/rollouts/{rid}/rollback", json={"reason": "test: rollback speed"})
        assert r.status_code == 200, r.text
        wait_for(lambda: all(w.current[a.node_name] == "1.0.0" for a in agents), 30, "both nodes back on 1.0.0",
                 interval=0.01)
        back = max(t for t, _, v in w.seen if v == "1.0.0") - t0
    print(f"rollback: every node back on stable {back:.2f}s after the operator's rollback")
    assert back < ROLLBACK_LIMIT_S, back
