"""The judge's gates for one stratum: hard gates (rollback on first evidence) and the latency gate.

Hard gates: a report with outcome numeric_error, mismatch, oom, crash, hang, compile_error or load_error from
a non-stale node rolls the stratum back. Latency: the stratum's paired log-ratios of the current step go to
:func:`controller.judge.latency.judge_latency`; regress rolls back, a pass with ``min_samples`` and the bake
time advances, past the deadline without a decision the stratum pauses (no data is never a pass). A stratum
without a baseline (first rollout of a bundle) is judged on hard gates and the sample count only. Evidence
is gathered with set-based queries over all active strata at once.
"""

from __future__ import annotations

import datetime as dt
import itertools
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import and_, func, select
from sqlalchemy.orm import Session

from controller.db.models import Node, Report, RolloutStratum
from controller.judge.latency import advance_upper_bound, judge_latency
from controller.plan import PlanSpec, StepSpec
from kernelctl import wire

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


def as_utc(t: dt.datetime) -> dt.datetime:
    """SQLite hands back naive datetimes (stored in UTC): make every datetime comparable."""
    return t.replace(tzinfo=dt.timezone.utc) if t.tzinfo is None else t.astimezone(dt.timezone.utc)


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


def log_ratio(report: wire.TrialReport) -> float | None:
    """The trial's latency sample: the mean over (op, batch size) of the median ln(candidate/stable) of
    that op's interleaved pairs (the log of the geometric-mean speed ratio); None without pairs.

    Medians per (op, size) make one noisy round harmless; averaging over ops (rather than a median over all
    pairs) keeps a regression confined to one kernel visible: one op 7x slower among nine moves the sample
    by ln(7)/9 = +22%.
    """
    if not report.latency:
        return None
    groups: dict[tuple[str, int], list[float]] = {}
    for p in report.latency:
        groups.setdefault((p.op, p.tokens), []).append(math.log(p.candidate_s / p.stable_s))
    return float(statistics.fmean(statistics.median(v) for v in groups.values()))


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

    def as_evidence(self) -> dict[str, Any]:
        return {"gate": self.gate, "outcomes": self.outcomes, "nodes": self.nodes,
                "first_received_at": self.first_received_at.isoformat()}


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
    return out


@dataclass
class StepEvidence:
    """The current step's usable reports of one stratum (ok outcome, non-stale node), in arrival order."""

    ok_reports: int = 0
    samples: list[float] = field(default_factory=list)
    node_ids: list[str] = field(default_factory=list)


def step_evidence(session: Session, strata_ids: list[int]) -> dict[Key, StepEvidence]:
    """One query over all given rollout_strata rows: reports received since each stratum's step started."""
    out: dict[Key, StepEvidence] = defaultdict(StepEvidence)
    if not strata_ids:
        return out
    stmt = (
        select(Report.rollout_id, Report.stratum, Report.node_id, Report.latency_log_ratio)
        .join(RolloutStratum, and_(RolloutStratum.rollout_id == Report.rollout_id,
                                   RolloutStratum.stratum == Report.stratum))
        .join(Node, Node.id == Report.node_id)
        .where(RolloutStratum.id.in_(strata_ids), Report.received_at >= RolloutStratum.step_started_at,
               Report.outcome == "ok", Node.state == "active")
        .order_by(Report.rollout_id, Report.stratum, Report.received_at, Report.id)
    )
    rows = session.connection().execute(stmt).all()  # Core rows: no ORM loading overhead
    for (rid, stratum), group in itertools.groupby(rows, key=lambda r: (r[0], r[1])):
        ev = out[(rid, stratum)]
        for _, _, node_id, ratio in group:
            ev.ok_reports += 1
            if ratio is not None:
                ev.samples.append(ratio)
                ev.node_ids.append(str(node_id))
    return out


# ------------------------------------------------------------------------------------------- decisions
@dataclass
class Decision:
    decision: str  # hold | advance | rollback | pause
    gate: str  # none | numeric | ... | latency | samples | deadline
    samples: int
    reason: str
    evidence: dict[str, Any]


def decide(row: RolloutStratum, step: StepSpec, plan: PlanSpec, now: dt.datetime, *,
           hard: HardFailure | None, ev: StepEvidence, canaries: int) -> Decision:
    """The decision for one live stratum at ``now`` (pure: no database access)."""
    elapsed = (now - as_utc(row.step_started_at)).total_seconds()
    timing = {"step": row.step_index, "elapsed_seconds": round(elapsed, 3), "bake_seconds": step.bake_seconds,
              "deadline_seconds": step.deadline_seconds, "min_samples": step.min_samples, "canaries": canaries}
    if hard is not None:
        return Decision("rollback", hard.gate, ev.ok_reports,
                        f"hard gate {hard.gate}: {', '.join(f'{n} {o}' for o, n in sorted(hard.outcomes.items()))}"
                        f" from {hard.nodes} node(s)", {**timing, "hard_gate": hard.as_evidence()})
    baked = elapsed >= step.bake_seconds
    late = elapsed > step.deadline_seconds
    if row.baseline_bundle_id is None:
        n = ev.ok_reports
        evidence = {**timing, "baseline": None, "ok_reports": n,
                    "note": "no baseline: judged on hard gates and sample count only"}
        if n >= step.min_samples and baked:
            return Decision("advance", "samples", n, f"no baseline: {n} clean reports >= {step.min_samples}, "
                            "bake time elapsed", evidence)
        if late:
            return Decision("pause", "deadline", n, f"inconclusive past the step deadline ({step.deadline_seconds:g}s):"
                            f" {n} clean reports of {step.min_samples} needed", evidence)
        return Decision("hold", "samples", n, f"no baseline: {n}/{step.min_samples} clean reports, "
                        f"baked {min(elapsed, step.bake_seconds):.0f}/{step.bake_seconds:g}s", evidence)
    v = judge_latency(ev.samples, margin=plan.margin_log, alpha=plan.alpha, min_samples=step.min_samples,
                      node_ids=ev.node_ids)
    evidence = {**timing, "latency": v.as_dict(), "ok_reports": ev.ok_reports}
    if v.decision == "regress":
        return Decision("rollback", "latency", v.n, v.reason, evidence)
    if v.n >= step.min_samples and baked:
        if v.decision == "pass":
            return Decision("advance", "latency", v.n, v.reason, evidence)
        upper = advance_upper_bound(ev.samples, alpha=plan.alpha, node_ids=ev.node_ids)
        evidence["advance_t_upper"] = upper
        if upper is not None and upper < plan.margin_log:
            return Decision("advance", "latency", v.n,
                            f"candidate within margin: t upper bound {math.expm1(upper):+.1%} < margin "
                            f"{plan.latency_margin:+.1%} over {v.n} samples after the bake time "
                            "(no regression in the confidence sequence)", evidence)
    if late:
        return Decision("pause", "deadline", v.n, f"inconclusive past the step deadline ({step.deadline_seconds:g}s):"
                        f" {v.reason}", evidence)
    reason = v.reason if v.decision != "pass" else f"{v.reason}; baking {elapsed:.0f}/{step.bake_seconds:g}s"
    return Decision("hold", "latency", v.n, reason, evidence)
