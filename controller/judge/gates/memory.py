"""Memory gate: per (op, size) cell the median candidate/stable peak-memory ratio over the plan's memory
margin, or a candidate peak past the node's free memory in most reports, rolls back (peak memory is a
deterministic measurement of allocations; the median only guards against a stray report)."""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from controller.judge.gates.base import Breach, GateContext, MetricView, StepEvidence
from controller.signals import ReportSignals
from kernelctl.vocab import GateName, MetricDecision, MetricKind

HUGE = 1e30  # a ratio over a zero-byte stable peak, shown as a number


@dataclass
class _Cell:
    ratios: list[float] = field(default_factory=list)  # candidate/stable peaks, sorted (a stable sort's order)
    over_headroom: int = 0  # reports whose candidate peak is past the node's free memory
    n: int = 0


class MemoryObs:
    """Per (op, size) cell, what the gate needs of every report so far; extended by appended reports (the leader
    carries it between ticks, ``controller.judge.series.JudgeMemo``): the same views as a read of every report."""

    def __init__(self) -> None:
        self.cells: dict[str, _Cell] = {}

    def extend(self, reports: Sequence[tuple[str, ReportSignals]]) -> MemoryObs:
        for _node, sig in reports:
            free = None if sig.free_memory_bytes is None else float(sig.free_memory_bytes)
            for name, (st, ca) in sig.memory.items():
                c = self.cells.setdefault(name, _Cell())
                bisect.insort(c.ratios, (ca / st) if st > 0 else (1.0 if ca <= 0 else math.inf))
                c.over_headroom += free is not None and ca > free
                c.n += 1
        return self

    def views(self, ctx: GateContext) -> list[MetricView]:
        views = []
        for name, c in sorted(self.cells.items()):
            value = float(statistics.median(c.ratios))
            bad = value > 1 + ctx.plan.memory_margin or c.over_headroom * 2 > c.n
            views.append(MetricView(f"memory:{name}", MetricKind.MEMORY, "ratio", min(value, HUGE), c.ratios[0],
                                    min(c.ratios[-1], HUGE), ctx.plan.memory_margin, c.n,
                                    MetricDecision.REGRESS if bad else MetricDecision.PASS))
        return views


class MemoryGate:
    name = GateName.MEMORY

    def measure(self, ev: StepEvidence, ctx: GateContext) -> list[MetricView]:
        obs = ev.observed("memory", MemoryObs)
        return obs.views(ctx)

    def evaluate(self, views: list[MetricView], ctx: GateContext) -> Breach | None:
        bad = [v for v in views if v.decision is MetricDecision.REGRESS]
        if not bad:
            return None
        v = max(bad, key=lambda m: m.value or 0.0)
        return Breach(self.name, v, f"peak memory {v.metric.split(':', 1)[1]}: {v.value:.2f}x stable (margin "
                                    f"{ctx.plan.memory_margin:.0%}) or past the node's free memory")
