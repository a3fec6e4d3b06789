"""Launches gate: more Triton launches per call than stable at any (op, size) cell rolls back
(``plan.launch_gate = "warn"``: recorded as a warning, not a rollback). Medians over the reports."""

from __future__ import annotations

import statistics

from controller.judge.gates.base import Breach, GateContext, MetricView, StepEvidence
from kernelctl.vocab import GateName, MetricDecision, MetricKind


class LaunchesGate:
    name = GateName.LAUNCHES

    def measure(self, ev: StepEvidence, ctx: GateContext) -> list[MetricView]:
        obs: dict[str, list[tuple[float, float]]] = {}
        for _node, sig in ev.reports:
            for name, (st, ca) in sig.launches.items():
                obs.setdefault(name, []).append((st, ca))
        views = []
        bad_decision = MetricDecision.WARN if ctx.plan.launch_gate == "warn" else MetricDecision.REGRESS
        for name, o in sorted(obs.items()):
            st, ca = statistics.median(x[0] for x in o), statistics.median(x[1] for x in o)
            views.append(MetricView(f"launches:{name}", MetricKind.LAUNCHES, "count", float(ca), None, float(st), 0.0,
                                    len(o), bad_decision if ca > st else MetricDecision.PASS))
        return views

    def evaluate(self, views: list[MetricView], ctx: GateContext) -> Breach | None:
        v = next((v for v in views if v.decision is MetricDecision.REGRESS), None)
        if v is None:
            return None
        return Breach(self.name, v, f"launches per call {v.metric.split(':', 1)[1]}: {v.value:g} vs stable {v.upper:g}")
