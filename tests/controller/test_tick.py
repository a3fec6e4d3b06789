"""The leader's tick: start, hard gates, latency regress/pass/hold, deadlines, stale nodes, verdict de-duplication."""

from __future__ import annotations

import datetime as dt

import pytest
from sqlalchemy import select, update

from controller.db.models import Bundle, Incompatibility, Node, Rollout, RolloutStratum, Verdict
from controller.enrollment import register_node
from controller.ingest import ingest_reports
from controller.plan import PlanSpec, StepSpec
from controller.rollouts import get_rollout, promote, start_rollout
from controller.tick import run_tick
from kernelctl import wire
from kernelctl.settings import Settings
from tests.controller.enginekit import T0, Kit, inventory

S90 = "sm_90/drv550/triton3.6.0"
S80 = "sm_80/drv550/triton3.6.0"
LIVE = Settings(stale_after_seconds=1e7)
PLAN = PlanSpec(steps=[StepSpec(nodes=1, bake_seconds=60, min_samples=5, deadline_seconds=600),
                       StepSpec(percent=100, bake_seconds=60, min_samples=5, deadline_seconds=600)],
                max_fleet_share=1.0, max_label_share=1.0)


@pytest.fixture
def kit(db_url, tmp_path):
    k = Kit(db_url, tmp_path)
    yield k
    k.close()


def at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


def tick(kit: Kit, seconds: float, settings: Settings = LIVE):
    with kit.tx() as s:
        return run_tick(s, at(seconds), settings=settings)


def baseline(kit: Kit, archs=("sm_90",), n: int = 3) -> None:
    for a in archs:
        kit.nodes(n, prefix=a, arch=a)
    kit.push("1.0.0", archs=archs)
    with kit.tx() as s:
        rid = start_rollout(s, "llm-fused@1.0.0", actor="op").id
        promote(s, rid, actor="op", full=True)


def start(kit: Kit, version: str, archs=("sm_90",), plan: PlanSpec = PLAN) -> tuple[int, wire.BundleRef]:
    bid = kit.push(version, archs=archs)
    with kit.tx() as s:
        rid = start_rollout(s, f"llm-fused@{version}", actor="op", plan=plan, now=T0).id
    return rid, kit.ref(bid)


def canaries(kit: Kit, rid: int, stratum: str | None = None) -> list[Node]:
    from controller.db.models import Assignment
    with kit.tx() as s:
        nodes = list(s.scalars(select(Node).join(Assignment, Assignment.node_id == Node.id)
                               .where(Assignment.rollout_id == rid).order_by(Node.name)))
    return [n for n in nodes if stratum is None or n.arch == stratum[:5]]


def send(kit: Kit, node: Node, rid: int, cand, stable, n: int, *, ratio: float = 0.0, outcome: str = "ok",
         now: float = 1.0) -> None:
    reps = [kit.report(node, rid, cand, stable, ratio=None if outcome != "ok" else ratio, outcome=outcome)
            for _ in range(n)]
    with kit.tx() as s:
        ingest_reports(s, s.get(Node, node.id), wire.ReportBatch(node_name=node.name, reports=reps), at(now))


def verdicts(kit: Kit, rid: int) -> list[Verdict]:
    with kit.tx() as s:
        return list(s.scalars(select(Verdict).where(Verdict.rollout_id == rid).order_by(Verdict.id)))


def test_tick_starts_pending_then_holds_without_data(kit: Kit) -> None:
    baseline(kit)
    rid, _ = start(kit, "1.1.0")
    res = tick(kit, 0)
    assert res.started == [rid] and len(canaries(kit, rid)) == 1
    assert res.rollouts_by_state == {"promoted": 1, "progressing": 1}
    res = tick(kit, 10)
    assert res.holds == 1 and res.decisions == [("latency", "hold")]
    v = verdicts(kit, rid)
    assert [(x.decision, x.gate, x.samples) for x in v] == [("hold", "latency", 0)]
    assert "no samples yet" in v[0].evidence["reason"]


def test_every_hard_gate_rolls_back_with_time_to_rollback(kit: Kit) -> None:
    baseline(kit)
    gates = {"numeric_error": "numeric", "mismatch": "mismatch", "oom": "oom", "crash": "crash", "hang": "hang",
             "compile_error": "compile", "load_error": "load"}
    for i, (outcome, gate) in enumerate(gates.items()):
        rid, cand = start(kit, f"1.1.{i}")
        t = 100 * i
        tick(kit, t)
        (node,) = canaries(kit, rid)
        stable = kit.ref(1)
        send(kit, node, rid, cand, stable, 3, now=t + 1)
        send(kit, node, rid, cand, stable, 1, outcome=outcome, now=t + 2)
        res = tick(kit, t + 3.5)
        assert [(r.rollout_id, r.stratum, r.gate) for r in res.rolled_back] == [(rid, S90, gate)], outcome
        assert res.rolled_back[0].time_to_rollback_seconds == pytest.approx(1.5)
        with kit.tx() as s:
            r = get_rollout(s, rid)
            assert r.state == "rolled_back" and s.get(Bundle, r.bundle_id).status == "revoked"
        v = verdicts(kit, rid)[-1]
        assert (v.decision, v.gate) == ("rollback", gate) and v.evidence["hard_gate"]["outcomes"] == {outcome: 1}
        assert canaries(kit, rid) == []
    assert len(kit.events("rollout.rolled_back")) == len(gates)
    assert all(e.actor == "controller" for e in kit.events("rollout.stratum_rolled_back"))


def test_gate_rollback_of_one_stratum_while_other_continues(kit: Kit) -> None:
    baseline(kit, archs=("sm_90", "sm_80"))
    rid, cand = start(kit, "1.1.0", archs=("sm_90", "sm_80"))
    tick(kit, 0)
    (a,) = canaries(kit, rid, S80)
    send(kit, a, rid, cand, kit.ref(1), 1, outcome="mismatch", now=1)
    res = tick(kit, 2)
    assert [(r.stratum, r.gate) for r in res.rolled_back] == [(S80, "mismatch")]
    with kit.tx() as s:
        r = get_rollout(s, rid)
        assert r.state == "progressing" and {x.stratum: x.state for x in r.strata} == {
            S80: "rolled_back", S90: "progressing"}
        assert s.scalar(select(Incompatibility.stratum)) == S80
        assert s.get(Bundle, r.bundle_id).status == "registered"


def test_latency_regression_rolls_back(kit: Kit) -> None:
    baseline(kit)
    rid, cand = start(kit, "1.1.0")
    tick(kit, 0)
    (node,) = canaries(kit, rid)
    send(kit, node, rid, cand, kit.ref(1), 40, ratio=0.2, now=5)
    res = tick(kit, 10)
    assert [(r.gate, r.time_to_rollback_seconds) for r in res.rolled_back] == [("latency", None)]
    v = verdicts(kit, rid)[-1]
    lat = v.evidence["latency"]
    assert v.decision == "rollback" and lat["decision"] == "regress" and lat["lower"] > lat["margin"]
    assert v.samples == 40


def test_latency_pass_waits_for_bake_then_advances_then_promotes(kit: Kit) -> None:
    baseline(kit)
    rid, cand = start(kit, "1.1.0")
    tick(kit, 0)
    (node,) = canaries(kit, rid)
    send(kit, node, rid, cand, kit.ref(1), 40, ratio=-0.05, now=5)
    res = tick(kit, 30)  # pass but bake (60 s) not over
    assert res.decisions == [("latency", "hold")] and "baking" in verdicts(kit, rid)[-1].evidence["reason"]
    res = tick(kit, 61)
    assert res.advanced == [(rid, S90, 1)]
    assert verdicts(kit, rid)[-1].decision == "advance"
    assert len(canaries(kit, rid)) == 3
    # evidence is carried across steps: step 1 holds only for its own bake time, then the step-0 reports plus
    # the new canaries' reports advance it
    res = tick(kit, 100)
    assert res.decisions == [("latency", "hold")]
    assert "baking" in verdicts(kit, rid)[-1].evidence["reason"]
    assert verdicts(kit, rid)[-1].evidence["latency"]["n"] == 40  # not forgotten at the step change
    for n in canaries(kit, rid):
        send(kit, n, rid, cand, kit.ref(1), 15, ratio=-0.05, now=101)
    res = tick(kit, 200)
    assert res.promoted == [(rid, S90)]
    with kit.tx() as s:
        assert get_rollout(s, rid).state == "promoted"
    assert verdicts(kit, rid)[-1].decision == "promote"


def test_deadline_pauses_as_inconclusive(kit: Kit) -> None:
    baseline(kit)
    rid, cand = start(kit, "1.1.0")
    tick(kit, 0)
    (node,) = canaries(kit, rid)
    send(kit, node, rid, cand, kit.ref(1), 2, ratio=-0.05, now=5)  # too few samples: never a pass
    res = tick(kit, 601)
    assert res.paused == [(rid, S90)]
    with kit.tx() as s:
        assert get_rollout(s, rid).state == "paused"
    v = verdicts(kit, rid)[-1]
    assert (v.decision, v.gate) == ("pause", "deadline") and "too few samples" in v.evidence["reason"]
    assert kit.events("rollout.paused", rollout_id=rid)[0].actor == "controller"
    assert tick(kit, 700).decisions == []  # paused: not judged for latency
    send(kit, node, rid, cand, kit.ref(1), 1, outcome="oom", now=701)  # ...but hard gates still apply
    res = tick(kit, 702)
    assert [(r.gate, r.time_to_rollback_seconds) for r in res.rolled_back] == [("oom", 1.0)]


def test_stale_nodes_marked_and_excluded_from_evidence(kit: Kit) -> None:
    baseline(kit, n=3)
    rid, cand = start(kit, "1.1.0")
    tick(kit, 0)
    (node,) = canaries(kit, rid)
    send(kit, node, rid, cand, kit.ref(1), 1, outcome="crash", now=1)
    with kit.tx() as s:
        s.execute(update(Node).where(Node.id != node.id).values(last_heartbeat_at=at(95)))
    with kit.factory() as s:  # a leader that took over less than stale_after ago judges no staleness yet
        assert run_tick(s, at(100), settings=Settings(stale_after_seconds=30), judge_staleness=False).stale_nodes == []
        s.rollback()
    res = tick(kit, 100, Settings(stale_after_seconds=30))
    assert res.stale_nodes == [node.name] and res.rolled_back == []
    assert [e.node for e in kit.events("node.stale")] == [node.name]
    with kit.tx() as s:
        assert get_rollout(s, rid).state == "progressing"
    # the stale canary is replaced by a live one at the same tick (it had no live canary left)
    live = [n.name for n in canaries(kit, rid) if n.state == "active"]
    assert len(live) == 1 and kit.events("rollout.canaries_replaced")[0].payload["added"] == live


def test_a_node_still_registering_has_a_start_up_grace(kit: Kit) -> None:
    """A node not heartbeated since its agent (re-)registered is stale only after the start-up grace (its
    registration reply may have been lost in a cold start); once it heartbeated, after ``stale_after``."""
    alive, starting, again = kit.nodes(3)
    with kit.tx() as s:  # one heartbeat after registering (the liveness flush writes only this column)
        s.execute(update(Node).where(Node.name == alive).values(last_heartbeat_at=at(5)))
        register_node(s, again, inventory(), actor="enroll", now=at(50))  # a retry whose first reply was lost
    grace = Settings(stale_after_seconds=30, node_startup_grace_seconds=120)
    assert tick(kit, 100, grace).stale_nodes == [alive]
    assert tick(kit, 121, grace).stale_nodes == [starting]
    assert tick(kit, 169, grace).stale_nodes == []
    assert tick(kit, 171, grace).stale_nodes == [again]
    # a grace shorter than stale_after is stale_after
    kit.nodes(1, prefix="late", now=at(200))
    short = Settings(stale_after_seconds=30, node_startup_grace_seconds=1)
    assert tick(kit, 229, short).stale_nodes == []
    assert tick(kit, 231, short).stale_nodes == ["late-000"]


def test_no_baseline_judged_on_samples_and_hard_gates(kit: Kit) -> None:
    kit.nodes(3, prefix="sm_90")
    rid, cand = start(kit, "1.0.0")
    tick(kit, 0)
    (node,) = canaries(kit, rid)
    send(kit, node, rid, cand, None, 5, ratio=None, now=1)
    res = tick(kit, 61)
    assert res.advanced == [(rid, S90, 1)]
    v = verdicts(kit, rid)[-1]
    assert v.gate == "samples" and v.evidence["baseline"] is None and "no baseline" in v.evidence["note"]


def test_hold_verdicts_are_not_repeated_every_tick(kit: Kit) -> None:
    baseline(kit)
    rid, _ = start(kit, "1.1.0")
    for t in range(0, 60, 2):
        tick(kit, t)
    assert len(verdicts(kit, rid)) == 1
    tick(kit, 62)  # hold_verdict_seconds (60) elapsed since the first hold
    assert len(verdicts(kit, rid)) == 2


def test_blast_radius_clamp_recorded_in_verdict(kit: Kit) -> None:
    baseline(kit, n=4)
    plan = PlanSpec(steps=[StepSpec(percent=100, bake_seconds=0, min_samples=1, deadline_seconds=60)],
                    max_fleet_share=0.25)
    rid, _ = start(kit, "1.1.0", plan=plan)
    tick(kit, 0)
    assert len(canaries(kit, rid)) == 1
    v = verdicts(kit, rid)[0]
    assert v.gate == "blast_radius" and v.evidence["clamp"]["requested"] == 4
    assert "max_fleet_share" in v.evidence["clamp"]["limited_by"][0]


def test_rollout_rows_consistent_after_tick(kit: Kit) -> None:
    baseline(kit)
    rid, _ = start(kit, "1.1.0")
    tick(kit, 0)
    with kit.tx() as s:
        r = s.get(Rollout, rid)
        st = s.scalar(select(RolloutStratum).where(RolloutStratum.rollout_id == rid))
        assert (r.state, r.step_index, st.state, st.step_index) == ("progressing", 0, "progressing", 0)
