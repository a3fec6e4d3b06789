"""Launches gate: more Triton launches per call than stable at any (op, size) cell rolls back
(``plan.launch_gate = "warn"``: recorded as a warning, not a rollback). Medians over the reports."""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Sequence

from controller.judge.gates.base import Breach, GateContext, MetricView, StepEvidence
from controller.signals import ReportSignals
from kernelctl.vocab import GateName, MetricDecision, MetricKind


class LaunchesObs:
    """Per (op, size) cell, the stable and candidate launch counts of every report so far, each sorted (a stable
    sort's order); extended by appended reports (carried by the leader between ticks like
    :class:`~controller.judge.gates.memory.MemoryObs`)."""

    def __init__(self) -> None:
        self.cells: dict[str, tuple[list[float], list[float]]] = {}

    def extend(self, reports: Sequence[tuple[str, ReportSignals]]) -> LaunchesObs:
        for _node, sig in reports:
            for name, (st, ca) in sig.launches.items():
                sts, cas = self.cells.setdefault(name, ([], []))
                bisect.insort(sts, st)
                bisect.insort(cas, ca)
        return self

    def views(self, ctx: GateContext) -> list[MetricView]:
        views = []
        bad_decision = MetricDecision.WARN if ctx.plan.launch_gate == "warn" else MetricDecision.REGRESS
        for name, (sts, cas) in sorted(self.cells.items()):
            st, ca = statistics.median(sts), statistics.median(cas)
            views.append(MetricView(f"launches:{name}", MetricKind.LAUNCHES, "count", float(ca), None, float(st), 0.0,
                                    len(sts), bad_decision if ca > st else MetricDecision.PASS))
        return views


class LaunchesGate:
    name = GateName.LAUNCHES

    def measure(self, ev: StepEvidence, ctx: GateContext) -> list[MetricView]:
        obs = ev.observed("launches", LaunchesObs)
        return obs.views(ctx)

    def evaluate(self, views: list[MetricView], ctx: GateContext) -> Breach | None:
        v = next((v for v in views if v.decision is MetricDecision.REGRESS), None)
        if v is None:
            return None
        return Breach(self.name, v, f"launches per call {v.metric.split(':', 1)[1]}: {v.value:g} vs stable {v.upper:g}")
