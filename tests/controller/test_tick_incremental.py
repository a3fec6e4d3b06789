"""The incremental judge tick (issue 28, ``controller.evidence``) against the full recompute, tick by tick.

Reports arrive between ticks; at every tick the evidence the cache holds must equal the full read
(``gates.step_evidence``), and a full tick on the same state (rolled back) must take the same decisions and write
the same verdicts, evidence included, as the incremental one (committed). Covered: reports received with an
earlier ``received_at`` than ones already read, a canary going stale and coming back, a stratum advancing and one
rolling back, and on PostgreSQL a report whose id is lower than ones a tick has already read and that commits
after that tick (its transaction was open).
"""

from __future__ import annotations

import pytest
from sqlalchemy import func, select, update

from controller.db.models import Node, Report, RolloutStratum, Verdict
from controller.evidence import EvidenceCache
from controller.gates import step_evidence
from controller.ingest import ingest_reports
from controller.judge.family import judge_family
from controller.judge.gates import GATES, GateContext, StepEvidence
from controller.judge.gates.latency import series
from controller.plan import PlanSpec, StepSpec, load_plan
from controller.tick import run_tick
from kernelctl import wire
from kernelctl.vocab import PROGRESSING
from tests.controller.enginekit import Kit
from tests.controller.test_tick import LIVE, at, baseline, canaries, start


@pytest.fixture
def kit(db_url, tmp_path):
    k = Kit(db_url, tmp_path)
    yield k
    k.close()

JUDGED: dict = {}  # stratum -> ticks whose carried judged statistics were compared (not vacuous)
S90 = "sm_90/drv550/triton3.6.0"
S80 = "sm_80/drv550/triton3.6.0"
PLAN = PlanSpec(steps=[StepSpec(percent=50, bake_seconds=40, min_samples=6, deadline_seconds=900),
                       StepSpec(percent=100, bake_seconds=40, min_samples=6, deadline_seconds=900)],
                max_fleet_share=1.0, max_label_share=1.0)


def _verdicts(s, after: int) -> list[tuple]:
    rows = s.scalars(select(Verdict).where(Verdict.id > after).order_by(Verdict.rollout_id, Verdict.stratum,
                                                                       Verdict.id))
    return [(v.rollout_id, v.stratum, v.step_index, v.decision, v.gate, v.samples, v.evidence) for v in rows]


def _same_evidence(full: dict, inc: dict) -> None:
    full = {k: v for k, v in full.items() if v.ok_reports}
    assert sorted(inc) == sorted(full)
    for key, ev in full.items():
        assert inc[key].ok_reports == ev.ok_reports, key
        assert inc[key].reports == ev.reports, key  # same nodes, same signals, same order


def _full_judged(s, judged: dict, full_ev: dict) -> dict:
    """Per judged stratum: its gate context, the latency family verdict and every gate's metric views, recomputed
    from the whole evidence (exact ``repr``)."""
    out = {}
    for sid, key in judged.items():
        row = s.get(RolloutStratum, sid)
        plan = load_plan(row.rollout.plan)
        ctx = GateContext(plan, plan.steps[min(row.step_index, len(plan.steps) - 1)])
        ev = full_ev.get(key) or StepEvidence()
        ser = series(ev, ctx)
        out[key] = (ctx, repr(judge_family({k: m for k, (m, _k, _s) in ser.items()}, alpha=plan.alpha,
                                           min_samples=ctx.step.min_samples).as_dict()), _views(ev, ctx))
    return out


def _views(ev: StepEvidence, ctx: GateContext) -> str:
    return repr([v.as_dict() for g in GATES for v in g.measure(ev, ctx)])


def judged_tick(kit: Kit, cache: EvidenceCache, seconds: float) -> list[tuple[str, str]]:
    """One tick both ways on the same state: full (rolled back), then incremental (committed); compared, and the
    judged statistics the incremental tick carried (every metric's wealths, bounds, counts) against the family
    recomputed from the whole evidence, bit for bit."""
    with kit.factory() as s, s.begin():
        last = s.scalar(select(func.coalesce(func.max(Verdict.id), 0)))
        full = run_tick(s, at(seconds), settings=LIVE)
        full_verdicts = _verdicts(s, last)
        s.rollback()
    with kit.tx() as s:
        judged = {r.id: (r.rollout_id, r.stratum) for r in s.scalars(
            select(RolloutStratum).where(RolloutStratum.state == PROGRESSING))}
        full_ev, inc_ev = step_evidence(s, list(judged)), cache.step_evidence(s, judged)
        _same_evidence(full_ev, inc_ev)
        want = _full_judged(s, judged, full_ev)
        for ev in inc_ev.values():
            ev.judge.last = None
        inc = run_tick(s, at(seconds), settings=LIVE, cache=cache)
        for key, ev in inc_ev.items():
            if ev.judge.last is not None:  # the gates ran (a baseline, no hard failure)
                ctx, family, views = want[key]
                assert repr(ev.judge.last.as_dict()) == family, key
                assert _views(ev, ctx) == views, key  # memory, launches, latency, numeric: carried = full
                JUDGED[key] = JUDGED.get(key, 0) + 1
        inc_verdicts = _verdicts(s, last)
    assert inc.decisions == full.decisions
    assert (inc.advanced, inc.promoted, inc.paused, inc.holds) == (full.advanced, full.promoted, full.paused,
                                                                  full.holds)
    assert [(r.rollout_id, r.stratum, r.gate) for r in inc.rolled_back] == [
        (r.rollout_id, r.stratum, r.gate) for r in full.rolled_back]
    assert inc_verdicts == full_verdicts
    return inc.decisions


def send(kit: Kit, node: Node, rid: int, cand, stable, ratios: list[float], *, received: float,
         session=None) -> None:
    reps = [kit.report(node, rid, cand, stable, ratio=r, pairs=4) for r in ratios]
    batch = wire.ReportBatch(node_name=node.name, reports=reps)
    if session is not None:
        ingest_reports(session, session.get(Node, node.id), batch, at(received))
        session.flush()
        return
    with kit.tx() as s:
        ingest_reports(s, s.get(Node, node.id), batch, at(received))


def _set_state(kit: Kit, node: Node, state: str) -> None:
    with kit.tx() as s:
        s.execute(update(Node).where(Node.id == node.id).values(state=state))


def test_incremental_tick_equals_full_recompute(kit: Kit) -> None:
    baseline(kit, archs=("sm_90", "sm_80"), n=4)
    rid, cand = start(kit, "1.1.0", archs=("sm_90", "sm_80"), plan=PLAN)
    stable = kit.ref(1)
    cache = EvidenceCache()
    judged_tick(kit, cache, 0)  # begin
    c90, c80 = canaries(kit, rid, S90), canaries(kit, rid, S80)
    assert c90 and c80
    t = 1.0
    for k in range(3):  # reports between ticks; every tick holds (too few samples, then baking)
        for i, n in enumerate(c90):
            send(kit, n, rid, cand, stable, [0.001 * ((i + k) % 3 - 1)], received=t)
        send(kit, c80[0], rid, cand, stable, [0.002, -0.001], received=t)
        t += 5
        judged_tick(kit, cache, t)
    JUDGED.clear()
    restarts = cache.stats.judge_restarts  # one per stratum's first evidence
    # received earlier than reports already read (a later id): it sorts into the middle, as the full read has it
    send(kit, c80[-1], rid, cand, stable, [0.0005], received=2.0)
    judged_tick(kit, cache, t + 1)
    assert cache.stats.judge_restarts == restarts + 1  # not an append: that stratum's judge starts again
    _set_state(kit, c90[0], "stale")  # its reports leave the evidence ...
    judged_tick(kit, cache, t + 2)
    _set_state(kit, c90[0], "active")  # ... and come back
    judged_tick(kit, cache, t + 3)
    assert cache.stats.judge_restarts == restarts + 3
    assert set(JUDGED) == {(rid, S90), (rid, S80)}
    for k in range(4):
        for n in c90 + c80:
            send(kit, n, rid, cand, stable, [0.0, 0.001], received=t + 4 + k)
        judged_tick(kit, cache, t + 5 + k)
    decisions = judged_tick(kit, cache, 60)  # baked: both strata advance (new canaries, evidence carried)
    assert ("latency", "advance") in decisions
    for n in canaries(kit, rid, S80):
        send(kit, n, rid, cand, stable, [0.3] * 6, received=61)  # a regression in one stratum
    decisions = judged_tick(kit, cache, 62)
    assert ("latency", "rollback") in decisions
    judged_tick(kit, cache, 63)
    assert cache.stats.judge_restarts == restarts + 3  # appends only since: the judged state carried
    assert min(JUDGED.values()) >= 6
    assert cache.stats.rebuilds == 1  # one build, then increments only
    with kit.tx() as s:  # each report parsed once (the stratum rolled back is not read again)
        stored = s.scalar(select(func.count()).select_from(Report).where(Report.outcome == "ok"))
    assert cache.stats.rows_parsed == stored


def test_late_committing_report_with_a_lower_id(kit: Kit, db_backend: str) -> None:
    """PostgreSQL: a report's id is taken at INSERT, its commit may come after a tick read higher ids."""
    if db_backend != "postgres":
        return _earlier_received_later_id(kit)
    baseline(kit, archs=("sm_90",), n=6)
    rid, cand = start(kit, "1.1.0", archs=("sm_90",), plan=PLAN)
    stable = kit.ref(1)
    cache = EvidenceCache()
    judged_tick(kit, cache, 0)
    nodes = canaries(kit, rid, S90)
    for n in nodes:  # every canary verified: the late transaction below locks no row a tick writes
        send(kit, n, rid, cand, stable, [0.0], received=1)
    judged_tick(kit, cache, 2)
    with kit.factory() as late:
        late.begin()
        send(kit, nodes[0], rid, cand, stable, [0.004, 0.004, 0.004], received=3, session=late)  # ids taken
        for n in nodes[1:]:
            send(kit, n, rid, cand, stable, [0.001], received=4)  # higher ids, committed first
        judged_tick(kit, cache, 5)  # reads the higher ids; the late ones are not visible yet
        judged_tick(kit, cache, 6)
        assert cache.stats.pending > 0  # the watermark waits for the open transaction
        late.commit()
    judged_tick(kit, cache, 7)  # the late reports are read now, in their place by received_at
    with kit.tx() as s:
        ev = cache.step_evidence(s, {sid: (rid, S90) for sid in s.scalars(
            select(RolloutStratum.id).where(RolloutStratum.rollout_id == rid))})
    assert ev[(rid, S90)].ok_reports == len(nodes) + 3 + len(nodes) - 1
    judged_tick(kit, cache, 8)
    assert cache.stats.pending == 0 and cache.stats.rebuilds == 1


def _sm90_rollout(kit: Kit) -> tuple[int, wire.BundleRef, wire.BundleRef, EvidenceCache, list[Node]]:
    """Four sm_90 nodes on a stable version, a rollout of 1.1.0 started and ticked once:
    (rollout id, candidate, stable, the leader's cache, the canaries)."""
    baseline(kit, archs=("sm_90",), n=4)
    rid, cand = start(kit, "1.1.0", archs=("sm_90",), plan=PLAN)
    cache = EvidenceCache()
    judged_tick(kit, cache, 0)
    return rid, cand, kit.ref(1), cache, canaries(kit, rid, S90)


def _earlier_received_later_id(kit: Kit) -> None:
    """SQLite (one writer: ids commit in order): a report received earlier but stored later is placed by
    received_at, as the full read orders it."""
    rid, cand, stable, cache, nodes = _sm90_rollout(kit)
    for n in nodes:
        send(kit, n, rid, cand, stable, [0.001, 0.002], received=5)
    judged_tick(kit, cache, 6)
    send(kit, nodes[-1], rid, cand, stable, [0.003], received=1)
    judged_tick(kit, cache, 7)
    assert cache.stats.pending == 0 and cache.stats.rebuilds == 1


def test_deleted_node_rebuilds(kit: Kit) -> None:
    """A node's deletion takes its reports with it: the cache reads everything again (and still agrees)."""
    rid, cand, stable, cache, nodes = _sm90_rollout(kit)
    for n in nodes:
        send(kit, n, rid, cand, stable, [0.001], received=1)
    judged_tick(kit, cache, 2)
    with kit.tx() as s:
        s.delete(s.get(Node, nodes[0].id))
    judged_tick(kit, cache, 3)
    assert cache.stats.rebuilds == 2
