"""The judged signals of one trial report (:class:`ReportSignals`, a pydantic model), computed once at
ingestion and stored with it (``reports.signals``).

One report contributes, per metric (the names the explain view shows, :func:`metric_name`):

* per (op, tokens) cell ``<op>@<tokens>``: a :class:`LatencySignal`: both arms' n, mean, p50 and p99 and the
  judged log-ratios of the mean and of the p99 (:mod:`controller.judge.statistic`);
* ``aggregate``: the traffic-weighted aggregate of the mean and of the p99, present only when the report
  measured every cell its traffic profile weights (weights equal when the report has none);
* ``e2e``: the end-to-end block's :class:`LatencySignal` (from ``e2e``; older agents' ``e2e_pairs`` rounds
  or single median pair otherwise);
* ``memory``/``launches`` per cell: [stable, candidate]; ``free_memory_bytes``; the numeric checks' summary.

A signal the report does not carry is absent (never a default value): the judge holds for a metric with too
few samples, it does not count a missing one as a pass. Documents stored before issue 25 (``cells`` as one
lower-quarter log-ratio per cell) are read by :meth:`ReportSignals.from_stored` into ``legacy_*`` fields:
shown for what they were, never judged as a mean or a p99.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from controller.judge.statistic import arms_from_rounds
from kernelctl import wire
from kernelctl.vocab import Statistic

AGGREGATE = "latency:aggregate"
E2E = "e2e"
SIGNALS_VERSION = 2


def cell_name(op: str, tokens: int) -> str:
    return f"{op}@{tokens}"


def metric_name(base: str, stat: Statistic) -> str:
    """``latency:swiglu@1:mean``, ``latency:aggregate:p99``, ``e2e:mean``."""
    return f"{base}:{stat.value}"


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class ArmSignal(_Model):
    n: int
    mean_s: float
    p50_s: float
    p99_s: float


class LatencySignal(_Model):
    """One cell (or the end-to-end block) of one report: both arms and the judged log-ratios."""

    mean: float  # ln(mean_candidate / mean_stable)
    p99: float  # ln(p99_candidate / p99_stable)
    stable: ArmSignal
    candidate: ArmSignal
    contended_windows: int = 0  # windows the trial dropped from both arms (both slow in them: a busy device)

    def value(self, stat: Statistic) -> float:
        return self.mean if stat is Statistic.MEAN else self.p99

    @classmethod
    def of(cls, arms: wire.ArmsLatency) -> LatencySignal:
        st, ca = arms.stable, arms.candidate  # validated at the wire: no second validation (ingestion's cost)
        return cls.model_construct(
            mean=math.log(ca.mean_s / st.mean_s), p99=math.log(ca.p99_s / st.p99_s),
            stable=ArmSignal.model_construct(n=st.n, mean_s=st.mean_s, p50_s=st.p50_s, p99_s=st.p99_s),
            candidate=ArmSignal.model_construct(n=ca.n, mean_s=ca.mean_s, p50_s=ca.p50_s, p99_s=ca.p99_s),
            contended_windows=arms.contended_windows)


class AggregateSignal(_Model):
    mean: float
    p99: float

    def value(self, stat: Statistic) -> float:
        return self.mean if stat is Statistic.MEAN else self.p99


class NumericSignal(_Model):
    checks: int
    max_abs_err: float
    kinds: list[str] = Field(default_factory=list)


class ReportSignals(_Model):
    """The typed signals of one report (see the module docstring)."""

    version: int = SIGNALS_VERSION
    cells: dict[str, LatencySignal] = Field(default_factory=dict)
    aggregate: AggregateSignal | None = None
    e2e: LatencySignal | None = None
    memory: dict[str, tuple[float, float]] = Field(default_factory=dict)
    candidate_peak_bytes: int | None = None
    launches: dict[str, tuple[float, float]] = Field(default_factory=dict)
    free_memory_bytes: int | None = None
    numeric: NumericSignal | None = None
    legacy_cells: dict[str, float] = Field(default_factory=dict)  # pre-issue-25 documents: shown, not judged
    legacy_aggregate: float | None = None
    legacy_e2e: float | None = None

    @classmethod
    def from_stored(cls, doc: dict[str, Any] | None) -> ReportSignals:
        """Read a stored document, this version's or an older one (``cells`` of plain numbers)."""
        doc = dict(doc or {})
        if doc.get("version") != SIGNALS_VERSION:
            cells = doc.pop("cells", None) or {}
            doc["legacy_cells"] = {k: float(v) for k, v in cells.items() if isinstance(v, (int, float))}
            agg, e2e = doc.pop("aggregate", None), doc.pop("e2e", None)
            doc["legacy_aggregate"] = float(agg) if isinstance(agg, (int, float)) else None
            doc["legacy_e2e"] = float(e2e) if isinstance(e2e, (int, float)) else None
        return cls.model_validate(doc)

    def stored(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_defaults=False)


def report_signals(report: wire.TrialReport) -> ReportSignals:
    """The signals of one report (see the module docstring)."""
    cells = {cell_name(c.op, c.tokens): LatencySignal.of(c) for c in report.cells}
    for key, (st, ca) in _legacy_cells(report).items():  # older agents: per-round pairs
        cells.setdefault(key, LatencySignal.of(_arms(st, ca)))
    e2e = None
    if report.e2e is not None:
        e2e = LatencySignal.of(report.e2e)
    elif report.e2e_pairs:
        e2e = LatencySignal.of(_arms([p.stable_s for p in report.e2e_pairs], [p.candidate_s for p in report.e2e_pairs]))
    elif report.e2e_stable_s is not None and report.e2e_candidate_s is not None:
        e2e = LatencySignal.of(_arms([report.e2e_stable_s], [report.e2e_candidate_s]))
    mem = {cell_name(r.op, r.tokens): (r.stable_peak_bytes, r.candidate_peak_bytes) for r in report.resources
           if r.stable_peak_bytes is not None and r.candidate_peak_bytes is not None}
    launches = {cell_name(r.op, r.tokens): (r.stable_launches, r.candidate_launches) for r in report.resources
                if r.stable_launches is not None and r.candidate_launches is not None}
    numeric = None
    if report.numerics:
        # edge-value checks judge finiteness only; their error at the dtype's limits is not a precision figure
        numeric = NumericSignal(checks=len(report.numerics), kinds=sorted({c.kind for c in report.numerics if c.kind}),
                                max_abs_err=max((c.max_abs_err for c in report.numerics if c.kind != "edge"),
                                                default=0.0))
    return ReportSignals(
        cells=cells, aggregate=aggregate(cells, report.weights), e2e=e2e, memory=mem, launches=launches,
        candidate_peak_bytes=max((r.candidate_peak_bytes or 0 for r in report.resources), default=None) if mem else None,
        free_memory_bytes=report.free_memory_bytes, numeric=numeric)


def aggregate(cells: dict[str, LatencySignal], weights: Sequence[wire.CellWeight]) -> AggregateSignal | None:
    """Traffic-weighted aggregate of the mean and the p99; None when a weighted cell was not measured."""
    if not cells:
        return None
    w = {cell_name(c.op, c.tokens): c.weight for c in weights if c.weight > 0}
    if not w:  # no profile: every measured cell equally often
        w = dict.fromkeys(cells, 1.0)
    if any(name not in cells for name in w):
        return None
    out = {}
    for stat, pick in ((Statistic.MEAN, lambda a: a.mean_s), (Statistic.P99, lambda a: a.p99_s)):
        st = sum(wt * pick(cells[k].stable) for k, wt in w.items())
        ca = sum(wt * pick(cells[k].candidate) for k, wt in w.items())
        out[stat.value] = math.log(ca / st)
    return AggregateSignal(**out)


def _legacy_cells(report: wire.TrialReport) -> dict[str, tuple[list[float], list[float]]]:
    groups: dict[str, tuple[list[float], list[float]]] = {}
    for p in report.latency:
        st, ca = groups.setdefault(cell_name(p.op, p.tokens), ([], []))
        st.append(p.stable_s)
        ca.append(p.candidate_s)
    return groups


def _arms(stable: list[float], candidate: list[float]) -> wire.ArmsLatency:
    return wire.ArmsLatency(stable=wire.ArmLatency(**arms_from_rounds(stable)),  # type: ignore[arg-type]
                            candidate=wire.ArmLatency(**arms_from_rounds(candidate)))  # type: ignore[arg-type]


def batch_signals(reports: Sequence[wire.TrialReport]) -> list[ReportSignals]:
    """:func:`report_signals` of every report of an ingestion batch."""
    return [report_signals(r) for r in reports]
