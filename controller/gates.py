"""The judge's gates for one stratum: hard gates, then the judged gates behind one interface.

Hard gates (this module, :func:`hard_failures` and the first branch of :func:`decide`): a report with outcome
numeric_error, mismatch, oom, crash, hang, compile_error or load_error from a non-stale node rolls the stratum
back. Then, over every ok report of the stratum in the whole rollout (evidence is carried across steps; the
bake time runs per step), the judged gates of :mod:`controller.judge.gates`, in order, each with ``measure``
(metric rows from the reports' typed signals) and ``evaluate`` (a breach or none):

* ``memory`` (:mod:`~controller.judge.gates.memory`), ``launches`` (:mod:`~controller.judge.gates.launches`);
* ``latency`` / ``e2e`` (:mod:`~controller.judge.gates.latency`): the mean and the p99 of every cell, of the
  traffic-weighted aggregate and end to end, each against its own margin; a regression names cell and
  statistic;
* ``numeric`` (:mod:`~controller.judge.gates.numeric`): holds until a report carried numeric checks.

The stratum advances when every must-pass metric passes *now* (a pass is re-checked at every tick, so a
regression after an early pass rolls back at any step) and the bake time has elapsed; a metric with too few
samples holds it; past the deadline without a decision the stratum pauses, unless every metric is sampled
and none regressed: then it may collect up to ``deadline_extension`` more (anytime-valid tests: looking longer
costs no error level). Every decision carries per-metric
evidence for ``kernelctl rollout explain``. A stratum without a baseline (first rollout of a bundle) is judged
on hard gates and the sample count only. Evidence is gathered with set-based queries over all active strata.
"""

from __future__ import annotations

import datetime as dt
import itertools
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Text, and_, cast, func, select
from sqlalchemy.orm import Session

from controller import numeric_detail
from controller.db.models import Node, Report, RolloutStratum, as_utc
from controller.judge.gates import GATES, Breach, GateContext, MetricView, StepEvidence
from controller.judge.gates.latency import describe
from controller.plan import PlanSpec, StepSpec
from controller.signals import AGGREGATE, ReportSignals, metric_name
from kernelctl import wire
from kernelctl.vocab import GateName, MetricDecision, MetricKind, Statistic, StepDecision

OUTCOME_GATE = {
    "numeric_error": "numeric",
    "mismatch": "mismatch",
    "oom": "oom",
    "crash": "crash",
    "hang": "hang",
    "compile_error": "compile",
    "load_error": "load",
}
GATE_ORDER = ("numeric", "mismatch", "crash", "oom", "hang", "compile", "load")
Key = tuple[int, str]  # (rollout_id, stratum)


# ------------------------------------------------------------------------------------- per-report facts
def effective_outcome(report: wire.TrialReport) -> str:
    """The report's outcome, escalated when it says ``ok`` but its own numeric checks failed."""
    if report.outcome != "ok":
        return report.outcome
    if any(not c.within_tolerance or c.unwritten for c in report.numerics):
        return "numeric_error"
    if any(c.vs_stable_within is False for c in report.numerics):
        return "mismatch"
    return "ok"


def numerics_summary(report: wire.TrialReport) -> dict[str, Any]:
    checks = report.numerics
    return {
        "checks": len(checks),
        "out_of_tolerance": sum(not c.within_tolerance for c in checks),
        "unwritten": sum(c.unwritten for c in checks),
        "vs_stable_mismatch": sum(c.vs_stable_within is False for c in checks),
        "max_abs_err": max((c.max_abs_err for c in checks), default=None),
        "max_rel_err": max((c.max_rel_err for c in checks), default=None),
        "worst": next(({"op": c.op, "dtype": c.dtype, "shape": c.shape, "max_abs_err": c.max_abs_err}
                       for c in sorted(checks, key=lambda c: (c.within_tolerance, -c.max_abs_err))), None),
    }


# ------------------------------------------------------------------------------------------- evidence
@dataclass
class HardFailure:
    gate: str
    outcomes: dict[str, int]
    nodes: int
    first_received_at: dt.datetime
    numeric: dict[str, Any] | None = None  # what failed (controller.numeric_detail), numeric/mismatch gates

    def as_evidence(self) -> dict[str, Any]:
        return {"gate": self.gate, "outcomes": self.outcomes, "nodes": self.nodes,
                "first_received_at": self.first_received_at.isoformat(),
                **({"numeric": self.numeric} if self.numeric else {})}


def hard_failures(session: Session, keys: set[Key]) -> dict[Key, HardFailure]:
    """Failing reports (any step of the rollout) from non-stale nodes, per (rollout, stratum)."""
    if not keys:
        return {}
    rids = sorted({k[0] for k in keys})
    rows = session.execute(
        select(Report.rollout_id, Report.stratum, Report.outcome, func.count(), func.count(Report.node_id.distinct()),
               func.min(Report.received_at))
        .join(Node, Node.id == Report.node_id)
        .where(Report.rollout_id.in_(rids), Report.outcome != "ok", Node.state == "active")
        .group_by(Report.rollout_id, Report.stratum, Report.outcome)
    ).all()
    acc: dict[Key, dict[str, Any]] = {}
    for rid, stratum, outcome, n, nodes, first in rows:
        key = (rid, stratum)
        if key not in keys or outcome not in OUTCOME_GATE:
            continue
        a = acc.setdefault(key, {"outcomes": {}, "nodes": 0, "first": as_utc(first)})
        a["outcomes"][outcome] = n
        a["nodes"] = max(a["nodes"], nodes)
        a["first"] = min(a["first"], as_utc(first))
    out = {}
    for key, a in acc.items():
        gates = {OUTCOME_GATE[o] for o in a["outcomes"]}
        gate = next(g for g in GATE_ORDER if g in gates)
        out[key] = HardFailure(gate, a["outcomes"], a["nodes"], a["first"])
    detail = numeric_detail.numeric_failures(session, {k for k, h in out.items() if h.gate in ("numeric", "mismatch")})
    for key, d in detail.items():
        out[key].numeric = d
    return out


# the stored signals as the database's JSON text (read by ReportSignals.from_stored_text: no json.loads)
SIGNALS_TEXT = cast(Report.signals, Text)


def step_evidence(session: Session, strata_ids: list[int]) -> dict[Key, StepEvidence]:
    """One query over all given rollout_strata rows: every ok report of each stratum in its rollout."""
    out: dict[Key, StepEvidence] = defaultdict(StepEvidence)
    if not strata_ids:
        return out
    stmt = (
        select(Report.rollout_id, Report.stratum, Report.node_id, SIGNALS_TEXT)
        .join(RolloutStratum, and_(RolloutStratum.rollout_id == Report.rollout_id,
                                   RolloutStratum.stratum == Report.stratum))
        .join(Node, Node.id == Report.node_id)
        .where(RolloutStratum.id.in_(strata_ids), Report.outcome == "ok", Node.state == "active")
        .order_by(Report.rollout_id, Report.stratum, Report.received_at, Report.id)
    )
    rows = session.connection().execute(stmt).all()  # Core rows: no ORM loading overhead
    for (rid, stratum), group in itertools.groupby(rows, key=lambda r: (r[0], r[1])):
        ev = out[(rid, stratum)]
        for _, _, node_id, signals in group:
            ev.ok_reports += 1
            ev.reports.append((str(node_id), ReportSignals.from_stored_text(signals)))
    return out


# ------------------------------------------------------------------------------------------- decisions
@dataclass
class Decision:
    decision: StepDecision
    gate: GateName
    samples: int
    reason: str
    evidence: dict[str, Any]
    metrics: list[MetricView] = field(default_factory=list)
    deciding_metric: str | None = None


def _finish(d: Decision) -> Decision:
    for m in d.metrics:
        m.deciding = m.metric == d.deciding_metric
    d.evidence["metrics"] = [m.as_dict() for m in d.metrics]
    d.evidence["deciding_metric"] = d.deciding_metric
    return d


def decide(row: RolloutStratum, step: StepSpec, plan: PlanSpec, now: dt.datetime, *,
           hard: HardFailure | None, ev: StepEvidence, canaries: int) -> Decision:
    """The decision for one live stratum at ``now`` (pure: no database access)."""
    return _finish(_decide(row, step, plan, now, hard=hard, ev=ev, canaries=canaries))


def _hard_decision(hard: HardFailure, ev: StepEvidence, timing: dict[str, Any]) -> Decision:
    """A failing report rolls back: the hard gate named with what failed (op, dtype, shape, check, error and
    tolerance: controller.numeric_detail) or its outcomes counted per kind."""
    kind = MetricKind.NUMERIC if hard.gate in ("numeric", "mismatch") else MetricKind.HARD
    name = "numeric" if kind is MetricKind.NUMERIC else f"hard:{hard.gate}"
    count = sum(hard.outcomes.values())
    err, tol = numeric_detail.error_and_tolerance(hard.numeric)
    view = (MetricView(name, kind, "error", err, None, None, tol, count, MetricDecision.FAIL) if err is not None
            else MetricView(name, kind, "count", float(count), None, None, None, count, MetricDecision.FAIL))
    counts = f"{', '.join(f'{n} {o}' for o, n in sorted(hard.outcomes.items()))} from {hard.nodes} node(s)"
    return Decision(StepDecision.ROLLBACK, GateName(hard.gate), count,
                    f"hard gate {hard.gate}: {numeric_detail.describe(hard.numeric) if hard.numeric else counts}",
                    {**timing, "hard_gate": hard.as_evidence()}, [view], name)


def _no_baseline(ev: StepEvidence, step: StepSpec, timing: dict[str, Any], baked: bool, late: bool) -> Decision:
    n = ev.ok_reports
    evidence = {**timing, "baseline": None, "ok_reports": n,
                "note": "no baseline: judged on hard gates and sample count only"}
    ok = n >= step.min_samples
    views = [MetricView("samples", MetricKind.HARD, "count", float(n), None, None, float(step.min_samples), n,
                        MetricDecision.PASS if ok else MetricDecision.HOLD)]
    if ok and baked:
        return Decision(StepDecision.ADVANCE, GateName.SAMPLES, n, f"no baseline: {n} clean reports >= "
                        f"{step.min_samples}, bake time elapsed", evidence, views)
    if late:
        return Decision(StepDecision.PAUSE, GateName.DEADLINE, n, f"inconclusive past the step deadline "
                        f"({step.deadline_seconds:g}s): {n} clean reports of {step.min_samples} needed", evidence,
                        views, "samples")
    return Decision(StepDecision.HOLD, GateName.SAMPLES, n, f"no baseline: {n}/{step.min_samples} clean reports, "
                    f"baked {min(timing['elapsed_seconds'], step.bake_seconds):.0f}/{step.bake_seconds:g}s",
                    evidence, views, "samples")


def _holding_reason(holding: MetricView | None, step: StepSpec, elapsed: float) -> str:
    if holding is None:
        return f"all metrics pass; baking {elapsed:.0f}/{step.bake_seconds:g}s"
    if holding.kind is MetricKind.NUMERIC:
        return "no report with numeric checks yet"
    if holding.n == 0:
        return f"no samples yet for {holding.metric} (need {step.min_samples})"
    if holding.n < step.min_samples:
        return f"too few samples for {holding.metric}: {holding.n}/{step.min_samples}"
    return f"{holding.metric} not yet within margin ({describe(holding)})"


def _judge_evidence(views: list[MetricView], timing: dict[str, Any], ev: StepEvidence) -> dict[str, Any]:
    agg = next((v for v in views if v.metric == metric_name(AGGREGATE, Statistic.MEAN)), None)
    latency = {} if agg is None else {"decision": agg.decision.value, "n": agg.n, "mean": agg.value,
                                      "lower": agg.lower, "upper": agg.upper, "margin": agg.margin}
    return {**timing, "latency": latency, "ok_reports": ev.ok_reports,
            "family": {"decision": _family_state(views), "metrics": sum(1 for v in views if v.statistic)}}


def _family_state(views: list[MetricView]) -> str:
    lat = [v for v in views if v.statistic is not None]
    if any(v.decision is MetricDecision.REGRESS for v in lat):
        return "regress"
    return "pass" if lat and all(v.decision is MetricDecision.PASS for v in lat if v.must_pass) else "hold"


def _tests_running(views: list[MetricView], step: StepSpec) -> bool:
    """The deadline extension's condition (``StepSpec.deadline_extension``): every metric still holding is a
    judged latency metric with ``min_samples`` samples, i.e. its anytime-valid tests are running and nothing
    regressed (a regression rolled back before this is asked). Looking longer at an anytime-valid test costs no
    error level, so such a stratum may collect evidence past the deadline; a stratum holding for samples it does
    not get, or for numeric checks, pauses at the deadline as before."""
    waiting = [v for v in views if v.must_pass and v.decision is not MetricDecision.PASS]
    return bool(waiting) and all(v.statistic is not None and v.n >= step.min_samples for v in waiting)


def _decide(row: RolloutStratum, step: StepSpec, plan: PlanSpec, now: dt.datetime, *,
            hard: HardFailure | None, ev: StepEvidence, canaries: int) -> Decision:
    elapsed = (now - as_utc(row.step_started_at)).total_seconds()
    timing = {"step": row.step_index, "elapsed_seconds": round(elapsed, 3), "bake_seconds": step.bake_seconds,
              "deadline_seconds": step.deadline_seconds,
              "extended_deadline_seconds": step.extended_deadline_seconds, "min_samples": step.min_samples,
              "canaries": canaries}
    if hard is not None:
        return _hard_decision(hard, ev, timing)
    baked, late = elapsed >= step.bake_seconds, elapsed > step.deadline_seconds
    if row.baseline_bundle_id is None:
        return _no_baseline(ev, step, timing, baked, late)
    ctx = GateContext(plan, step)
    per_gate = [(g, g.measure(ev, ctx)) for g in GATES]
    views = [v for _g, vs in per_gate for v in vs]
    evidence = _judge_evidence(views, timing, ev)
    n = ev.ok_reports
    breach: Breach | None = next((b for g, vs in per_gate if (b := g.evaluate(vs, ctx)) is not None), None)
    if breach is not None:
        return Decision(StepDecision.ROLLBACK, breach.gate, breach.view.n, breach.reason, evidence, views,
                        breach.view.metric)
    warned = [v.metric for v in views if v.decision is MetricDecision.WARN]
    if warned:
        evidence["launch_warnings"] = warned
    holding = next((v for v in views if v.must_pass and v.decision is not MetricDecision.PASS), None)
    if holding is None and baked:
        return Decision(StepDecision.ADVANCE, GateName.LATENCY, n, f"every metric within its margin (mean and p99 "
                        f"of {sum(1 for v in views if v.statistic) // 2} latency metrics, none in regression) after "
                        "the bake time", evidence, views)
    why = _holding_reason(holding, step, elapsed)
    name = holding.metric if holding is not None else None
    gate = GateName.E2E if holding is not None and holding.kind is MetricKind.E2E else GateName.LATENCY
    if late and _tests_running(views, step) and elapsed <= step.extended_deadline_seconds:
        evidence["deadline_extended"] = True
        return Decision(StepDecision.HOLD, gate, n, f"past the step deadline ({step.deadline_seconds:g}s), extended "
                        f"to {step.extended_deadline_seconds:g}s (every metric sampled, none in regression): {why}",
                        evidence, views, name)
    if late:
        return Decision(StepDecision.PAUSE, GateName.DEADLINE, n, f"inconclusive past the step deadline "
                        f"({step.deadline_seconds:g}s): {why}", evidence, views, name)
    return Decision(StepDecision.HOLD, gate, n, why, evidence, views, name)
