"""The judge's gates for one stratum: hard gates, then memory, launches, and the latency family.

Hard gates: a report with outcome numeric_error, mismatch, oom, crash, hang, compile_error or load_error from
a non-stale node rolls the stratum back. Then, over every ok report of the stratum in the whole rollout
(evidence is carried across steps; the bake time runs per step):

* ``memory``: per (op, size) cell the median candidate/stable peak-memory ratio over the plan's memory margin,
  or a candidate peak past the node's free memory, rolls back;
* ``launches``: more Triton launches per call than stable at any cell rolls back (``plan.launch_gate =
  "warn"``: recorded in the verdict, not a rollback);
* ``latency`` / ``e2e``: :func:`controller.judge.family.judge_family` over one series per (op, size) cell,
  the traffic-weighted aggregate and the end-to-end ratio (its own margin); a regressing metric rolls back
  and the verdict names it ("swiglu at 1 token: +95% [+80%, +110%]"); the family passing (aggregate and
  e2e within margin, no cell in regression), every metric with ``min_samples`` and the bake time advances.

A metric with too few samples holds the stratum (a report missing a metric is not a pass for it); past the
deadline without a decision the stratum pauses. Every decision carries per-metric evidence (value, bounds,
margin, n, decision, which one decided) for ``kernelctl rollout explain``. A stratum without a baseline
(first rollout of a bundle) is judged on hard gates and the sample count only. Evidence is gathered with
set-based queries over all active strata at once.
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

from controller import numeric_detail
from controller.db.models import Node, Report, RolloutStratum
from controller.judge.family import FamilyVerdict, MetricSeries, judge_family
from controller.plan import PlanSpec, StepSpec
from controller.signals import AGGREGATE, E2E
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


@dataclass
class StepEvidence:
    """A stratum's usable reports over the whole rollout (ok outcome, non-stale node), in arrival order.

    Evidence is carried across steps: a step change widens the canary, it does not forget what was measured
    (the bake time still runs per step). ``samples``/``node_ids`` are the traffic-weighted aggregate latency
    samples; ``reports`` the stored signals of each report (:mod:`controller.signals`) with its node."""

    ok_reports: int = 0
    samples: list[float] = field(default_factory=list)
    node_ids: list[str] = field(default_factory=list)
    reports: list[tuple[str, dict[str, Any]]] = field(default_factory=list)


def step_evidence(session: Session, strata_ids: list[int]) -> dict[Key, StepEvidence]:
    """One query over all given rollout_strata rows: every ok report of each stratum in its rollout."""
    out: dict[Key, StepEvidence] = defaultdict(StepEvidence)
    if not strata_ids:
        return out
    stmt = (
        select(Report.rollout_id, Report.stratum, Report.node_id, Report.latency_log_ratio, Report.signals)
        .join(RolloutStratum, and_(RolloutStratum.rollout_id == Report.rollout_id,
                                   RolloutStratum.stratum == Report.stratum))
        .join(Node, Node.id == Report.node_id)
        .where(RolloutStratum.id.in_(strata_ids), Report.outcome == "ok", Node.state == "active")
        .order_by(Report.rollout_id, Report.stratum, Report.received_at, Report.id)
    )
    rows = session.connection().execute(stmt).all()  # Core rows: no ORM loading overhead
    for (rid, stratum), group in itertools.groupby(rows, key=lambda r: (r[0], r[1])):
        ev = out[(rid, stratum)]
        for _, _, node_id, ratio, signals in group:
            ev.ok_reports += 1
            if ratio is not None:
                ev.samples.append(ratio)
                ev.node_ids.append(str(node_id))
            ev.reports.append((str(node_id), signals or {}))
    return out


# ------------------------------------------------------------------------------------------- metrics
@dataclass
class MetricView:
    """One judged metric of one stratum at one tick: the row the explain view shows."""

    metric: str
    kind: str  # latency_cell | latency_aggregate | e2e | memory | launches | numeric | hard
    unit: str  # log_ratio | ratio | count | error
    value: float | None
    lower: float | None
    upper: float | None
    margin: float | None
    n: int
    decision: str  # regress | pass | hold | warn | fail
    deciding: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "kind": self.kind, "unit": self.unit, "value": self.value,
                "lower": self.lower, "upper": self.upper, "margin": self.margin, "n": self.n,
                "decision": self.decision, "deciding": self.deciding}


def _median(v: list[float]) -> float:
    return float(statistics.median(v))


def _latency_series(ev: StepEvidence, plan: PlanSpec) -> dict[str, MetricSeries]:
    """The latency family: one series per cell, the traffic-weighted aggregate, and end-to-end."""
    cells: dict[str, tuple[list[float], list[str]]] = {}
    e2e: tuple[list[float], list[str]] = ([], [])
    for node, sig in ev.reports:
        for name, v in (sig.get("cells") or {}).items():
            xs, ns = cells.setdefault(name, ([], []))
            xs.append(float(v))
            ns.append(node)
        if sig.get("e2e") is not None:
            e2e[0].append(float(sig["e2e"]))
            e2e[1].append(node)
    series = {f"latency:{k}": MetricSeries(xs, ns, plan.margin_log) for k, (xs, ns) in sorted(cells.items())}
    series[AGGREGATE] = MetricSeries(list(ev.samples), list(ev.node_ids), plan.margin_log, advance=True)
    if e2e[0] or plan.e2e_required:
        series[E2E] = MetricSeries(e2e[0], e2e[1], plan.e2e_margin_log, advance=True)
    return series


def _resource_views(ev: StepEvidence, plan: PlanSpec) -> tuple[list[MetricView], list[MetricView]]:
    """Memory and launch metrics per cell (medians over the stratum's reports; both are deterministic
    measurements of allocations and launches, the median only guards against a stray report)."""
    mem: dict[str, list[tuple[float, float, float | None]]] = {}
    lau: dict[str, list[tuple[float, float]]] = {}
    for _node, sig in ev.reports:
        free = sig.get("free_memory_bytes")
        for name, (st, ca) in (sig.get("memory") or {}).items():
            mem.setdefault(name, []).append((float(st), float(ca), None if free is None else float(free)))
        for name, (st, ca) in (sig.get("launches") or {}).items():
            lau.setdefault(name, []).append((float(st), float(ca)))
    mviews = []
    for name, obs in sorted(mem.items()):
        ratios = [(ca / st) if st > 0 else (1.0 if ca <= 0 else math.inf) for st, ca, _ in obs]
        value = _median(ratios)
        over_headroom = sum(1 for _st, ca, free in obs if free is not None and ca > free) * 2 > len(obs)
        regress = value > 1 + plan.memory_margin or over_headroom
        mviews.append(MetricView(f"memory:{name}", "memory", "ratio", value if math.isfinite(value) else 1e30,
                                 min(ratios), max(r for r in ratios) if all(map(math.isfinite, ratios)) else 1e30,
                                 plan.memory_margin, len(obs), "regress" if regress else "pass"))
    lviews = []
    for name, lobs in sorted(lau.items()):
        st, ca = _median([o[0] for o in lobs]), _median([o[1] for o in lobs])
        bad = ca > st
        lviews.append(MetricView(f"launches:{name}", "launches", "count", ca, None, st, 0.0, len(lobs),
                                 ("warn" if plan.launch_gate == "warn" else "regress") if bad else "pass"))
    return mviews, lviews


def _numeric_view(ev: StepEvidence) -> MetricView:
    checks = [sig["numeric"] for _n, sig in ev.reports if sig.get("numeric")]
    worst = max((c.get("max_abs_err", 0.0) for c in checks), default=None)
    return MetricView("numeric", "numeric", "error", worst, None, None, None, len(checks),
                      "pass" if checks else "hold")


def _latency_views(fam: FamilyVerdict, series: dict[str, MetricSeries]) -> list[MetricView]:
    out = []
    for name, v in fam.metrics.items():
        kind = "latency_aggregate" if name == AGGREGATE else ("e2e" if name == E2E else "latency_cell")
        # value: the median of the raw samples (what the candidate does); lower/upper: the confidence sequence
        # of the winsorised mean (samples clipped to ±clip), so the value can lie outside the bounds
        raw = list(series[name].samples)
        value = _median(raw) if raw else None
        out.append(MetricView(name, kind, "log_ratio", value, v.lower, v.upper, series[name].margin, v.n,
                              v.decision))
    return out


def describe_cell(view: MetricView) -> str:
    """"swiglu at 1 token: +95% [+80%, +110%]" for a latency metric (log-ratio units)."""
    name = view.metric.split(":", 1)[-1]
    where = name
    if "@" in name:
        op, tokens = name.rsplit("@", 1)
        where = f"{op} at {tokens} token{'s' if tokens != '1' else ''}"
    elif name == E2E:
        where = "end-to-end decoder block"
    elif name == "aggregate":
        where = "traffic-weighted aggregate"

    def pct(x: float | None) -> str:
        return "?" if x is None else f"{math.expm1(x):+.0%}"

    return f"{where}: {pct(view.value)} [{pct(view.lower)}, {pct(view.upper)}]"


# ------------------------------------------------------------------------------------------- decisions
@dataclass
class Decision:
    decision: str  # hold | advance | rollback | pause
    gate: str  # none | numeric | ... | memory | launches | latency | e2e | samples | deadline
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


def _decide(row: RolloutStratum, step: StepSpec, plan: PlanSpec, now: dt.datetime, *,
            hard: HardFailure | None, ev: StepEvidence, canaries: int) -> Decision:
    elapsed = (now - as_utc(row.step_started_at)).total_seconds()
    timing = {"step": row.step_index, "elapsed_seconds": round(elapsed, 3), "bake_seconds": step.bake_seconds,
              "deadline_seconds": step.deadline_seconds, "min_samples": step.min_samples, "canaries": canaries}
    if hard is not None:
        kind = "numeric" if hard.gate in ("numeric", "mismatch") else "hard"
        name = "numeric" if kind == "numeric" else f"hard:{hard.gate}"
        n = sum(hard.outcomes.values())
        err, tol = numeric_detail.error_and_tolerance(hard.numeric)
        view = (MetricView(name, kind, "error", err, None, None, tol, n, "fail") if err is not None
                else MetricView(name, kind, "count", float(n), None, None, None, n, "fail"))
        counts = f"{', '.join(f'{k} {o}' for o, k in sorted(hard.outcomes.items()))} from {hard.nodes} node(s)"
        return Decision("rollback", hard.gate, n,
                        f"hard gate {hard.gate}: {numeric_detail.describe(hard.numeric) if hard.numeric else counts}",
                        {**timing, "hard_gate": hard.as_evidence()}, [view], name)
    baked = elapsed >= step.bake_seconds
    late = elapsed > step.deadline_seconds
    if row.baseline_bundle_id is None:
        n = ev.ok_reports
        evidence = {**timing, "baseline": None, "ok_reports": n,
                    "note": "no baseline: judged on hard gates and sample count only"}
        views = [MetricView("samples", "hard", "count", float(n), None, None, float(step.min_samples), n,
                            "pass" if n >= step.min_samples else "hold")]
        if n >= step.min_samples and baked:
            return Decision("advance", "samples", n, f"no baseline: {n} clean reports >= {step.min_samples}, "
                            "bake time elapsed", evidence, views)
        if late:
            return Decision("pause", "deadline", n, f"inconclusive past the step deadline ({step.deadline_seconds:g}s):"
                            f" {n} clean reports of {step.min_samples} needed", evidence, views, "samples")
        return Decision("hold", "samples", n, f"no baseline: {n}/{step.min_samples} clean reports, "
                        f"baked {min(elapsed, step.bake_seconds):.0f}/{step.bake_seconds:g}s", evidence, views,
                        "samples")
    mviews, lviews = _resource_views(ev, plan)
    numeric = _numeric_view(ev)
    series = _latency_series(ev, plan)
    fam = judge_family(series, alpha=plan.alpha, min_samples=step.min_samples)
    views = [*_latency_views(fam, series), *mviews, *lviews, numeric]
    agg = fam.metrics[AGGREGATE]
    evidence: dict[str, Any] = {**timing, "latency": agg.as_dict(), "family": {
        "decision": fam.decision, "deciding": fam.deciding, "alpha_per_metric": fam.alpha_per_metric,
        "method": fam.method}, "ok_reports": ev.ok_reports}
    n = agg.n
    by_name = {v.metric: v for v in views}
    mem_bad = [v for v in mviews if v.decision == "regress"]
    if mem_bad:
        v = max(mem_bad, key=lambda m: m.value or 0.0)
        return Decision("rollback", "memory", n, f"peak memory {v.metric.split(':', 1)[1]}: {v.value:.2f}x stable "
                        f"(margin {plan.memory_margin:.0%}) or past the node's free memory", evidence, views, v.metric)
    launch_bad = [v for v in lviews if v.decision == "regress"]
    if launch_bad:
        v = launch_bad[0]
        return Decision("rollback", "launches", n, f"launches per call {v.metric.split(':', 1)[1]}: "
                        f"{v.value:g} vs stable {v.upper:g}", evidence, views, v.metric)
    warned = [v.metric for v in lviews if v.decision == "warn"]
    if warned:
        evidence["launch_warnings"] = warned
    if fam.decision == "regress" and fam.deciding is not None:
        v = by_name[fam.deciding]
        gate = "e2e" if fam.deciding == E2E else "latency"
        return Decision("rollback", gate, v.n, f"regression: {describe_cell(v)} (margin "
                        f"{math.expm1(series[fam.deciding].margin):+.0%})", evidence, views, fam.deciding)
    # a metric with too few samples holds the stratum: a report missing a metric is not a pass for it
    short = [v for v in views if v.kind in ("latency_cell", "latency_aggregate", "e2e") and v.n < step.min_samples]
    if numeric.decision == "hold":
        short.append(numeric)
    holding = short[0] if short else (by_name.get(fam.deciding) if fam.deciding else None)
    if fam.decision == "pass" and not short and baked:
        return Decision("advance", "latency", n, f"every metric within its margin ({describe_cell(by_name[AGGREGATE])}"
                        f"{'; e2e ' + describe_cell(by_name[E2E]).split(': ', 1)[1] if E2E in by_name else ''}; "
                        f"{len(views)} metrics, none in regression) after the bake time", evidence, views)
    gate = "e2e" if holding is not None and holding.metric == E2E else "latency"
    if holding is numeric:
        why = "no report with numeric checks yet"
    elif holding is not None and holding.n == 0:
        why = f"no samples yet for {holding.metric} (need {step.min_samples})"
    elif holding is not None and holding.n < step.min_samples:
        why = f"too few samples for {holding.metric}: {holding.n}/{step.min_samples}"
    elif holding is not None:
        why = f"{holding.metric} not yet within margin ({describe_cell(holding)})"
    else:
        why = f"all metrics pass; baking {elapsed:.0f}/{step.bake_seconds:g}s"
    name = holding.metric if holding is not None else None
    if late:
        return Decision("pause", "deadline", n, f"inconclusive past the step deadline ({step.deadline_seconds:g}s):"
                        f" {why}", evidence, views, name)
    return Decision("hold", gate, n, why, evidence, views, name)
