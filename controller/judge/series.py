"""A stratum's judged latency series, built from its reports by appending (issue 25's rule, issue 28's carry).

Every report contributes one sample per statistic (mean, p99) to each of its cells, to the traffic-weighted
aggregate when it has one and to end to end when it has e2e timings; a series is in report order, with the node of
each sample. The latency gate (:mod:`controller.judge.gates.latency`) builds them from the whole evidence each
time (:class:`SeriesBuilder` over every report); the leader's evidence cache (``controller.evidence``) keeps a
:class:`JudgeMemo` per stratum instead, which reads only the reports appended since the last tick and carries the
family's tests (:class:`~controller.judge.family.FamilyState`), so the decision is the same, bit for bit, and a
tick costs what the new reports cost.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from controller.judge.family import FamilyState, FamilyVerdict, MetricSeries
from controller.plan import PlanSpec
from controller.signals import AGGREGATE, E2E, ReportSignals, metric_name
from kernelctl.vocab import MetricKind, Statistic

STATISTICS = (Statistic.MEAN, Statistic.P99)
Judged = dict[str, tuple[MetricSeries, MetricKind, Statistic]]


def margins(plan: PlanSpec, base: str) -> dict[Statistic, float]:
    """Log-ratio margins of one metric base (a cell, the aggregate or e2e) per statistic."""
    mean = plan.e2e_margin if base == E2E else plan.latency_margin
    return {Statistic.MEAN: math.log1p(mean), Statistic.P99: math.log1p(max(plan.p99_margin, mean))}


class SeriesBuilder:
    """The per-metric sample lists of a stratum, extended report by report (lists only ever appended to)."""

    def __init__(self) -> None:
        self.acc: dict[tuple[str, Statistic], tuple[list[float], list[str]]] = {}
        self.kinds: dict[str, MetricKind] = {}

    def extend(self, reports: Sequence[tuple[str, ReportSignals]]) -> SeriesBuilder:
        acc, kinds = self.acc, self.kinds

        def add(base: str, kind: MetricKind, stat: Statistic, value: float, node: str) -> None:
            xs, ns = acc.setdefault((base, stat), ([], []))
            xs.append(value)
            ns.append(node)
            kinds[base] = kind

        for node, sig in reports:
            for stat in STATISTICS:
                for cell, c in sig.cells.items():
                    add(f"latency:{cell}", MetricKind.LATENCY_CELL, stat, c.value(stat), node)
                if sig.aggregate is not None:
                    add(AGGREGATE, MetricKind.LATENCY_AGGREGATE, stat, sig.aggregate.value(stat), node)
                if sig.e2e is not None:
                    add(E2E, MetricKind.E2E, stat, sig.e2e.value(stat), node)
        return self

    def series(self, plan: PlanSpec) -> Judged:
        """Every judged latency series of the stratum: cells (sorted), then the aggregate, then e2e."""
        kinds = dict(self.kinds)
        bases = [*sorted(b for b, k in kinds.items() if k is MetricKind.LATENCY_CELL), AGGREGATE]
        kinds.setdefault(AGGREGATE, MetricKind.LATENCY_AGGREGATE)
        if E2E in kinds or plan.e2e_required:
            bases.append(E2E)
            kinds.setdefault(E2E, MetricKind.E2E)
        out = {}
        for base in bases:
            m = margins(plan, base)
            for stat in STATISTICS:
                xs, ns = self.acc.get((base, stat), ([], []))
                out[metric_name(base, stat)] = (MetricSeries(xs, ns, m[stat], summary=base in (AGGREGATE, E2E)),
                                                kinds[base], stat)
        return out


class Carried(Protocol):
    """What a gate carries between ticks: its measurements, extended by the reports appended since."""

    def extend(self, reports: Sequence[tuple[str, ReportSignals]]) -> Any: ...


C = TypeVar("C", bound=Carried)


class JudgeMemo:
    """One stratum's judged state carried between the leader's ticks: each gate's measurements (the latency
    series, the memory and launch observations) and the family's tests.

    It continues only the report list object it has read before, grown by appends (its owner hands a fresh
    list whenever the evidence changed otherwise: a late report placed earlier, a node leaving or coming back);
    any other list starts it again from the whole evidence. Not thread-safe (one tick at a time)."""

    def __init__(self) -> None:
        self._start(None)
        self.restarts = 0  # times it started again (a list other than the one it had read)
        self.last: FamilyVerdict | None = None  # the latest verdict (for the differential tests)

    def _start(self, source: list[tuple[str, ReportSignals]] | None) -> None:
        self.source = source
        self._carried: dict[str, tuple[Carried, int]] = {}  # name -> (measurements, reports read into them)
        self.family = FamilyState()

    def carried(self, name: str, reports: list[tuple[str, ReportSignals]], factory: Callable[[], C]) -> C:
        """The measurements ``name`` (made by ``factory``) extended by the reports they have not read yet."""
        if reports is not self.source or any(n > len(reports) for _, n in self._carried.values()):
            self.restarts += self.source is not None
            self._start(reports)
        acc, n = self._carried.get(name) or (factory(), 0)
        acc.extend(reports[n:])
        self._carried[name] = (acc, len(reports))
        return acc  # type: ignore[return-value]

