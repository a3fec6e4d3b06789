"""Latency gate (issue 25): the mean and the p99 of every (op, tokens) cell, of the traffic-weighted aggregate
and end to end, each a series of per-report log-ratios judged against its own margin by
:func:`controller.judge.family.judge_family` (anytime-valid betting tests, weighted Bonferroni).

Margins: the mean against ``plan.latency_margin`` (e2e: ``plan.e2e_margin``), the p99 against
``plan.p99_margin`` (default wider). A regressing metric rolls back and the verdict names cell and statistic
("swiglu at 1 token, p99: lower bound +12% > margin +10%"); every metric must *pass* (its upper bound below
its margin, now) for the stratum to advance. ``e2e`` metrics decide with gate ``e2e``.
"""

from __future__ import annotations

import math

from controller.judge.family import FamilyVerdict, judge_family
from controller.judge.gates.base import Breach, GateContext, MetricView, StepEvidence
from controller.judge.series import Judged, SeriesBuilder
from controller.signals import AGGREGATE, E2E
from kernelctl.vocab import GateName, MetricDecision, MetricKind


def series(ev: StepEvidence, ctx: GateContext) -> Judged:
    """Every judged latency series of the stratum: cells (sorted), then the aggregate, then e2e (from every
    report, or, when the evidence carries the leader's :class:`~controller.judge.series.JudgeMemo`, from the
    reports appended since it last read)."""
    return ev.observed("latency", SeriesBuilder).series(ctx.plan)


def _arms(ev: StepEvidence, base: str) -> dict[str, object] | None:
    """The latest report's per-arm figures of a cell or e2e (what a reader checks the ratio against)."""
    for _node, sig in reversed(ev.reports):
        c = sig.e2e if base == E2E else sig.cells.get(base.split(":", 1)[1])
        if c is not None:
            return {"stable": c.stable.model_dump(), "candidate": c.candidate.model_dump(),
                    "contended_windows": c.contended_windows}
    return None


def views_of(fam: FamilyVerdict, ser: Judged, ev: StepEvidence) -> list[MetricView]:
    out = []
    for name, v in fam.metrics.items():
        s, kind, stat = ser[name]
        raw = list(s.samples)
        decision = MetricDecision(v.decision)
        side, bound = ("lower", v.lower) if decision is MetricDecision.REGRESS else ("upper", v.upper)
        base = name.rsplit(":", 1)[0]
        out.append(MetricView(name, kind, "log_ratio", float(sum(raw) / len(raw)) if raw else None, v.lower,
                              v.upper, s.margin, v.n, decision, statistic=stat, must_pass=s.must_pass,
                              bound=bound, bound_side=side, arms=None if kind is MetricKind.LATENCY_AGGREGATE
                              else _arms(ev, base)))
    return out


def where(metric: str) -> str:
    """``latency:swiglu@1:p99`` -> "swiglu at 1 token, p99"."""
    base, _, stat = metric.rpartition(":")
    name = base.split(":", 1)[-1] if base.startswith("latency:") else base
    if base == E2E:
        text = "end to end"
    elif base == AGGREGATE:
        text = "traffic-weighted aggregate"
    elif "@" in name:
        op, tokens = name.rsplit("@", 1)
        text = f"{op} at {tokens} token{'s' if tokens != '1' else ''}"
    else:
        text = name
    return f"{text}, {stat}"


def pct(x: float | None) -> str:
    return "none yet" if x is None else f"{math.expm1(x):+.1%}"


def describe(view: MetricView) -> str:
    """"swiglu at 1 token, mean: +9.5% (lower bound +6.1% > margin +2.0%)" (the bound that decides)."""
    rel = ">" if view.bound_side == "lower" else "<"
    if view.decision is MetricDecision.HOLD:
        rel = "not yet <"
    return (f"{where(view.metric)}: {pct(view.value)} ({view.bound_side} bound {pct(view.bound)} {rel} margin "
            f"{pct(view.margin)}, n={view.n})")


class LatencyGate:
    name = GateName.LATENCY

    def measure(self, ev: StepEvidence, ctx: GateContext) -> list[MetricView]:
        ser = series(ev, ctx)
        fam = judge_family({k: s for k, (s, _kind, _stat) in ser.items()}, alpha=ctx.plan.alpha,
                           min_samples=ctx.step.min_samples, state=None if ev.judge is None else ev.judge.family)
        if ev.judge is not None:
            ev.judge.last = fam
        return views_of(fam, ser, ev)

    def evaluate(self, views: list[MetricView], ctx: GateContext) -> Breach | None:
        v = next((v for v in views if v.statistic is not None and v.decision is MetricDecision.REGRESS), None)
        if v is None:
            return None
        gate = GateName.E2E if v.kind is MetricKind.E2E else GateName.LATENCY
        return Breach(gate, v, f"regression: {describe(v)}")
