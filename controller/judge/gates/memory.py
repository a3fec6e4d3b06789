"""Memory gate: per (op, size) cell the median candidate/stable peak-memory ratio over the plan's memory
margin, or a candidate peak past the node's free memory in most reports, rolls back (peak memory is a
deterministic measurement of allocations; the median only guards against a stray report)."""

from __future__ import annotations

import math
import statistics

from controller.judge.gates.base import Breach, GateContext, MetricView, StepEvidence
from kernelctl.vocab import GateName, MetricDecision, MetricKind

HUGE = 1e30  # a ratio over a zero-byte stable peak, shown as a number


class MemoryGate:
    name = GateName.MEMORY

    def measure(self, ev: StepEvidence, ctx: GateContext) -> list[MetricView]:
        obs: dict[str, list[tuple[float, float, float | None]]] = {}
        for _node, sig in ev.reports:
            for name, (st, ca) in sig.memory.items():
                obs.setdefault(name, []).append((st, ca, None if sig.free_memory_bytes is None
                                                 else float(sig.free_memory_bytes)))
        views = []
        for name, o in sorted(obs.items()):
            ratios = [(ca / st) if st > 0 else (1.0 if ca <= 0 else math.inf) for st, ca, _ in o]
            value = float(statistics.median(ratios))
            over_headroom = sum(1 for _st, ca, free in o if free is not None and ca > free) * 2 > len(o)
            bad = value > 1 + ctx.plan.memory_margin or over_headroom
            views.append(MetricView(f"memory:{name}", MetricKind.MEMORY, "ratio", min(value, HUGE), min(ratios),
                                    min(max(ratios), HUGE), ctx.plan.memory_margin, len(o),
                                    MetricDecision.REGRESS if bad else MetricDecision.PASS))
        return views

    def evaluate(self, views: list[MetricView], ctx: GateContext) -> Breach | None:
        bad = [v for v in views if v.decision is MetricDecision.REGRESS]
        if not bad:
            return None
        v = max(bad, key=lambda m: m.value or 0.0)
        return Breach(self.name, v, f"peak memory {v.metric.split(':', 1)[1]}: {v.value:.2f}x stable (margin "
                                    f"{ctx.plan.memory_margin:.0%}) or past the node's free memory")
