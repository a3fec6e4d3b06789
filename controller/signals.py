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

Ingestion stores :func:`stored_signals`: the document built as plain data from either encoding of the report's
cell tables (lists of objects, or the columns of :mod:`kernelctl.wire_columns`), the same document
``report_signals(report).stored()`` gives, without a model per cell (the models cost ~0.9 ms of a 23 KB report).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic_core import from_json

from controller.judge.statistic import arms_from_rounds
from kernelctl import wire
from kernelctl.vocab import Statistic
from kernelctl.wire_columns import ArmColumns

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

    @classmethod
    def from_stored_text(cls, text: str | bytes | None) -> ReportSignals:
        """:meth:`from_stored` of the document's JSON text (``controller.gates.SIGNALS_TEXT``), parsed by
        pydantic-core's parser: the judge tick reads every new report's document (11 KB for a 16 KB report),
        and ``json.loads`` (the driver's and SQLAlchemy's JSON type) took about twice as long."""
        return cls.from_stored(None if text is None else from_json(text))

    def stored(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_defaults=False)


def report_signals(report: wire.TrialReport) -> ReportSignals:
    """The signals of one report, typed (see the module docstring; ingestion stores :func:`stored_signals`)."""
    return ReportSignals.model_validate(stored_signals(report))


# The stored document is built as plain data (see the module docstring); key order as ReportSignals dumps it.
ArmRow = tuple[int, float, float, float]  # n, mean_s, p50_s, p99_s


def _latency(st: ArmRow, ca: ArmRow, contended: int) -> dict[str, Any]:
    """One :class:`LatencySignal` as stored: both arms and the judged log-ratios (mean, p99)."""
    return {"mean": math.log(ca[1] / st[1]), "p99": math.log(ca[3] / st[3]),
            "stable": {"n": st[0], "mean_s": st[1], "p50_s": st[2], "p99_s": st[3]},
            "candidate": {"n": ca[0], "mean_s": ca[1], "p50_s": ca[2], "p99_s": ca[3]},
            "contended_windows": contended}


def _row(arm: wire.ArmLatency) -> ArmRow:
    return arm.n, arm.mean_s, arm.p50_s, arm.p99_s


def _arm_rows(arms: ArmColumns) -> list[ArmRow]:
    return list(zip(arms.n, arms.mean_s, arms.p50_s, arms.p99_s, strict=True))


def _tables(report: wire.TrialReport) -> tuple[dict[str, dict[str, Any]], dict[str, float],
                                                list[tuple[str, int | None, int | None, int | None, int | None]]]:
    """The report's cells (as stored), traffic weights and resource rows, from either encoding."""
    cols = report.columns
    if cols is None:  # encoding 1: lists of objects
        cells = {cell_name(c.op, c.tokens): _latency(_row(c.stable), _row(c.candidate), c.contended_windows)
                 for c in report.cells}
        weights = {cell_name(w.op, w.tokens): w.weight for w in report.weights}
        resources = [(cell_name(r.op, r.tokens), r.stable_peak_bytes, r.candidate_peak_bytes, r.stable_launches,
                      r.candidate_launches) for r in report.resources]
        return cells, weights, resources
    cells = {}
    if (c := cols.cells) is not None:  # encoding 2: columns
        contended = c.contended_windows or [0] * len(c.op)
        for op, t, st, ca, k in zip(c.op, c.tokens, _arm_rows(c.stable), _arm_rows(c.candidate), contended,
                                    strict=True):
            cells[cell_name(op, t)] = _latency(st, ca, k)
    weights = {}
    if (w := cols.weights) is not None:
        weights = {cell_name(op, t): x for op, t, x in zip(w.op, w.tokens, w.weight, strict=True)}
    resources = []
    if (r := cols.resources) is not None:
        resources = [(cell_name(op, t), a, b, x, y) for op, t, a, b, x, y in zip(
            r.op, r.tokens, r.column("stable_peak_bytes"), r.column("candidate_peak_bytes"),
            r.column("stable_launches"), r.column("candidate_launches"), strict=True)]
    return cells, weights, resources


def stored_signals(report: wire.TrialReport) -> dict[str, Any]:
    """What ingestion stores in ``reports.signals``: ``report_signals(report).stored()``, either encoding."""
    cells, weights, resources = _tables(report)
    for key, (st, ca) in _legacy_cells(report).items():  # older agents: per-round pairs
        cells.setdefault(key, _latency(*_rounds(st, ca), 0))
    e2e = None
    if report.e2e is not None:
        e2e = _latency(_row(report.e2e.stable), _row(report.e2e.candidate), report.e2e.contended_windows)
    elif report.e2e_pairs:
        e2e = _latency(*_rounds([p.stable_s for p in report.e2e_pairs], [p.candidate_s for p in report.e2e_pairs]), 0)
    elif report.e2e_stable_s is not None and report.e2e_candidate_s is not None:
        e2e = _latency(*_rounds([report.e2e_stable_s], [report.e2e_candidate_s]), 0)
    mem = {name: [float(a), float(b)] for name, a, b, _x, _y in resources if a is not None and b is not None}
    launches = {name: [float(x), float(y)] for name, _a, _b, x, y in resources if x is not None and y is not None}
    numeric = None
    if report.numerics:
        # edge-value checks judge finiteness only; their error at the dtype's limits is not a precision figure
        numeric = {"checks": len(report.numerics),
                   "max_abs_err": float(max((c.max_abs_err for c in report.numerics if c.kind != "edge"), default=0.0)),
                   "kinds": sorted({c.kind for c in report.numerics if c.kind})}
    return {
        "version": SIGNALS_VERSION, "cells": cells, "aggregate": _aggregate(cells, weights), "e2e": e2e,
        "memory": mem, "candidate_peak_bytes": max((b or 0 for _n, _a, b, _x, _y in resources), default=None)
        if mem else None,
        "launches": launches, "free_memory_bytes": report.free_memory_bytes, "numeric": numeric,
        "legacy_cells": {}, "legacy_aggregate": None, "legacy_e2e": None}


def aggregate(cells: dict[str, LatencySignal], weights: Sequence[wire.CellWeight]) -> AggregateSignal | None:
    """Traffic-weighted aggregate of the mean and the p99; None when a weighted cell was not measured."""
    doc = _aggregate({k: c.model_dump() for k, c in cells.items()},
                     {cell_name(c.op, c.tokens): c.weight for c in weights})
    return None if doc is None else AggregateSignal.model_validate(doc)


def _aggregate(cells: dict[str, dict[str, Any]], weights: dict[str, float]) -> dict[str, float] | None:
    """:func:`aggregate` on stored cells and ``{cell: weight}``."""
    if not cells:
        return None
    w = {k: x for k, x in weights.items() if x > 0}
    if not w:  # no profile: every measured cell equally often
        w = dict.fromkeys(cells, 1.0)
    if any(name not in cells for name in w):
        return None
    out = {}
    for stat, pick in ((Statistic.MEAN, "mean_s"), (Statistic.P99, "p99_s")):
        st = sum(wt * cells[k]["stable"][pick] for k, wt in w.items())
        ca = sum(wt * cells[k]["candidate"][pick] for k, wt in w.items())
        out[stat.value] = math.log(ca / st)
    return out


def _legacy_cells(report: wire.TrialReport) -> dict[str, tuple[list[float], list[float]]]:
    groups: dict[str, tuple[list[float], list[float]]] = {}
    for p in report.latency:
        st, ca = groups.setdefault(cell_name(p.op, p.tokens), ([], []))
        st.append(p.stable_s)
        ca.append(p.candidate_s)
    return groups


def _rounds(stable: list[float], candidate: list[float]) -> tuple[ArmRow, ArmRow]:
    """Both arms of an older report's per-round timings (validated as the wire's arms are)."""
    st = wire.ArmLatency(**arms_from_rounds(stable))  # type: ignore[arg-type]
    ca = wire.ArmLatency(**arms_from_rounds(candidate))  # type: ignore[arg-type]
    return _row(st), _row(ca)


def batch_signals(reports: Sequence[wire.TrialReport]) -> list[dict[str, Any]]:
    """:func:`stored_signals` of every report of an ingestion batch."""
    return [stored_signals(r) for r in reports]
