"""Trial before serve, in the changelog: staged -> verified (accepted ok report) -> serving (node reports it).

Desired state and phases through the real heartbeat and report-ingestion functions on SQLite and
PostgreSQL: the candidate becomes the desired active version only after this node's hard-gates-passed report
was accepted; a failing report (or a failure anywhere in the stratum) never verifies it; the activation of a
served candidate names its rollout and when its trial was accepted; ``serve_before_trial`` restores serving
at once; a rollback clears the phase and makes the stable version active.
"""

from __future__ import annotations

import datetime as dt

import pytest
from sqlalchemy import select

from controller import registry
from controller.assignments import desired_state
from controller.audit import active_at
from controller.db.models import Activation, Assignment, Node
from controller.ingest import ingest_reports
from controller.rollouts import promote, rollback, start_rollout
from kernelctl import wire
from tests.controller.enginekit import T0, Kit
from tests.controller.test_assignments import begin, plan


@pytest.fixture
def kit(db_url, tmp_path):
    k = Kit(db_url, tmp_path)
    yield k
    k.close()


def _stable_and_candidate(kit: Kit, nodes: int = 2, **plan_kw) -> tuple[int, wire.BundleRef, wire.BundleRef]:
    kit.nodes(nodes)
    stable_id = kit.push("1.0.0")
    with kit.tx() as s:
        rid = start_rollout(s, "llm-fused@1.0.0", actor="op").id
        promote(s, rid, actor="op", full=True)
    cand_id = kit.push("1.1.0")
    rid, _ = begin(kit, "llm-fused@1.1.0", plan(100, max_fleet_share=1.0, **plan_kw))
    return rid, kit.ref(stable_id), kit.ref(cand_id)


def _heartbeat(kit: Kit, node: str, active: list[wire.BundleRef], at: dt.datetime) -> wire.DesiredBundle:
    with kit.tx() as s:
        resp = registry.heartbeat(s, wire.HeartbeatRequest(node_name=node, active=active), at, heartbeat_seconds=5)
    (d,) = resp.desired
    return d


def _send(kit: Kit, node: str, rid: int, cand: wire.BundleRef, stable: wire.BundleRef | None, outcome: str,
          at: dt.datetime) -> None:
    with kit.tx() as s:
        n = kit.node(s, node)
        batch = wire.ReportBatch(node_name=node, reports=[kit.report(n, rid, cand, stable, outcome=outcome, at=at)])
        ingest_reports(s, n, batch, at)


def _phase(kit: Kit, node: str) -> str | None:
    with kit.tx() as s:
        return s.scalar(select(Assignment.phase).join(Node, Node.id == Assignment.node_id).where(Node.name == node))


def test_candidate_serves_only_after_accepted_ok_report(kit: Kit) -> None:
    rid, stable, cand = _stable_and_candidate(kit)
    t = [T0 + dt.timedelta(seconds=i) for i in range(10)]
    d = _heartbeat(kit, "gpu-000", [stable], t[1])
    assert (d.active, d.phase, d.trial.candidate) == (stable, "staged", cand)  # staged + trial, stable serves
    _send(kit, "gpu-000", rid, cand, stable, "ok", t[2])
    assert _phase(kit, "gpu-000") == "verified"
    assert _phase(kit, "gpu-001") == "staged"  # verification is per node
    d = _heartbeat(kit, "gpu-000", [stable], t[3])
    assert (d.active, d.phase, d.trial.candidate) == (cand, "verified", cand)  # serve it; paired trials go on
    d = _heartbeat(kit, "gpu-000", [cand], t[4])  # the agent published it
    assert (d.active, d.phase) == (cand, "serving")
    assert _heartbeat(kit, "gpu-001", [stable], t[4]).active == stable
    with kit.tx() as s:
        act = s.scalar(select(Activation).where(Activation.bundle_id == s.scalar(
            select(Assignment.desired_bundle_id).join(Node, Node.id == Assignment.node_id)
            .where(Node.name == "gpu-000"))))
        assert (act.rollout_id, act.verified_at.replace(tzinfo=dt.timezone.utc)) == (rid, t[2])
        ran = active_at(s, "gpu-000", t[4] + dt.timedelta(milliseconds=1))
        assert [(r["version"], r["rollout_id"]) for r in ran] == [("1.1.0", rid)]
        assert ran[0]["verified_at"] is not None
        assert [r["version"] for r in active_at(s, "gpu-000", t[3])] == ["1.0.0"]
    (ev,) = kit.events("assignment.verified")
    assert (ev.node, ev.bundle, ev.rollout_id) == ("gpu-000", "llm-fused@1.1.0", rid)


@pytest.mark.parametrize("outcome", ["numeric_error", "crash"])
def test_failing_trial_never_verifies_the_stratum(kit: Kit, outcome: str) -> None:
    rid, stable, cand = _stable_and_candidate(kit)
    _send(kit, "gpu-000", rid, cand, stable, outcome, T0 + dt.timedelta(seconds=1))
    # another node of the stratum passes afterwards: the stratum has a hard failure, it is not verified either
    _send(kit, "gpu-001", rid, cand, stable, "ok", T0 + dt.timedelta(seconds=2))
    assert (_phase(kit, "gpu-000"), _phase(kit, "gpu-001")) == ("staged", "staged")
    for node in ("gpu-000", "gpu-001"):
        assert _heartbeat(kit, node, [stable], T0 + dt.timedelta(seconds=3)).active == stable
    assert kit.events("assignment.verified") == []


def test_ok_report_escalated_by_its_numerics_does_not_verify(kit: Kit) -> None:
    rid, stable, cand = _stable_and_candidate(kit, nodes=1)
    bad = wire.NumericCheck(op="bias_gelu", dtype="fp32", shape={"n": 8}, max_abs_err=1.0, max_rel_err=1.0,
                            within_tolerance=False)
    with kit.tx() as s:
        n = kit.node(s, "gpu-000")
        r = kit.report(n, rid, cand, stable, outcome="ok", numerics=[bad])
        ingest_reports(s, n, wire.ReportBatch(node_name="gpu-000", reports=[r]), T0)
    assert _phase(kit, "gpu-000") == "staged"


def test_rollback_clears_phase_and_serves_stable(kit: Kit) -> None:
    rid, stable, cand = _stable_and_candidate(kit, nodes=1)
    _send(kit, "gpu-000", rid, cand, stable, "ok", T0)
    _heartbeat(kit, "gpu-000", [cand], T0 + dt.timedelta(seconds=1))
    assert _phase(kit, "gpu-000") == "serving"
    with kit.tx() as s:
        rollback(s, rid, actor="op", reason="test", now=T0 + dt.timedelta(seconds=2))
    d = _heartbeat(kit, "gpu-000", [cand], T0 + dt.timedelta(seconds=3))
    assert (d.active, d.role, d.phase, d.trial) == (stable, "stable", None, None)
    assert _phase(kit, "gpu-000") is None


def test_serve_before_trial_serves_at_once(kit: Kit) -> None:
    rid, stable, cand = _stable_and_candidate(kit, nodes=1, serve_before_trial=True)
    d = _heartbeat(kit, "gpu-000", [stable], T0)
    assert (d.active, d.phase, d.trial.candidate) == (cand, "staged", cand)
    d = _heartbeat(kit, "gpu-000", [cand], T0 + dt.timedelta(seconds=1))
    assert d.phase == "serving"
    with kit.tx() as s:
        (act,) = s.scalars(select(Activation).where(Activation.ended_at.is_(None)))
        assert (act.rollout_id, act.verified_at) == (rid, None)  # served before any trial: the audit says so


def test_first_version_serves_nothing_until_verified(kit: Kit) -> None:
    kit.nodes(1)
    bid = kit.push("1.0.0")
    rid, _ = begin(kit, "llm-fused@1.0.0", plan(100, max_fleet_share=1.0))
    ref = kit.ref(bid)
    d = _heartbeat(kit, "gpu-000", [], T0)
    assert (d.active, d.stable, d.phase, d.trial.candidate) == (None, None, "staged", ref)
    _send(kit, "gpu-000", rid, ref, None, "ok", T0 + dt.timedelta(seconds=1))
    assert _heartbeat(kit, "gpu-000", [], T0 + dt.timedelta(seconds=2)).active == ref
    with kit.tx() as s:  # the heartbeat reply and desired_state agree
        assert desired_state(s, kit.node(s, "gpu-000"), now=T0 + dt.timedelta(seconds=2))[0].phase == "verified"
