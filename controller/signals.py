"""The judged signals of one trial report, computed once at ingestion and stored with it (``reports.signals``).

One report contributes, per metric name (the names the explain view shows):

* ``latency:<op>@<tokens>``: :func:`controller.judge.statistic.cell_log_ratio` of that cell's interleaved
  pairs (one sample per report and cell);
* ``latency:aggregate``: the traffic-weighted mean of the report's cell samples, weights from the node's
  traffic profile (how often each op and batch size runs per serving step; equal when the report has none);
* ``e2e``: the cell statistic of the end-to-end decoder-block rounds (``e2e_pairs``; the single median pair
  of older agents otherwise);
* ``memory:<op>@<tokens>``: [stable, candidate] peak bytes at the same shape;
* ``launches:<op>@<tokens>``: [stable, candidate] Triton launches per call;
* ``free_memory_bytes``, and the report's numeric checks (count, worst error, kinds).

A signal the report does not carry is absent (never a default value): the judge holds for a metric with too
few samples, it does not count a missing one as a pass.

:func:`batch_signals` computes the signals of a whole batch with the cell statistics of all its reports
vectorised (:func:`controller.judge.statistic.cell_log_ratios` once per pair count, the same numbers as one
:func:`~controller.judge.statistic.cell_log_ratio` per cell): ingestion's per-report cost.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from controller.judge.statistic import cell_log_ratios
from kernelctl import wire

AGGREGATE = "latency:aggregate"
E2E = "e2e"


def cell_name(op: str, tokens: int) -> str:
    return f"{op}@{tokens}"


def report_signals(report: wire.TrialReport) -> dict[str, Any]:
    """The JSON-safe signals of one report (see the module docstring)."""
    return batch_signals([report])[0]


def _cells(report: wire.TrialReport) -> dict[str, tuple[list[float], list[float]]]:
    """The report's latency pairs per cell, cells in (op, tokens) order, pairs in measurement order."""
    groups: dict[tuple[str, int], tuple[list[float], list[float]]] = {}
    for p in report.latency:
        st, ca = groups.setdefault((p.op, p.tokens), ([], []))
        st.append(p.stable_s)
        ca.append(p.candidate_s)
    return {cell_name(op, t): pairs for (op, t), pairs in sorted(groups.items())}


def _log_ratios(cells: list[tuple[list[float], list[float]]]) -> list[float]:
    """``cell_log_ratio`` of every (stable, candidate) cell: one vectorised pass per pair count."""
    out = [0.0] * len(cells)
    by_n: dict[int, list[int]] = {}
    for i, (st, ca) in enumerate(cells):
        if len(st) != len(ca) or not st:
            raise ValueError(f"cell needs equal, non-empty pair lists (got {len(st)} and {len(ca)})")
        by_n.setdefault(len(st), []).append(i)
    for idx in by_n.values():
        s = np.array([cells[i][0] for i in idx], dtype=np.float64)
        c = np.array([cells[i][1] for i in idx], dtype=np.float64)
        bad = ~(np.isfinite(s) & np.isfinite(c) & (s > 0) & (c > 0))
        if bad.any():  # the wire refuses these already: a guard for reports built in-process
            row, col = (int(x[0]) for x in np.nonzero(bad))
            raise ValueError(f"cell pair {col} has a non-positive or non-finite timing ({s[row, col]!r}, "
                             f"{c[row, col]!r})")
        for i, v in zip(idx, cell_log_ratios(s, c).tolist(), strict=True):
            out[i] = v
    return out


def batch_signals(reports: Sequence[wire.TrialReport]) -> list[dict[str, Any]]:
    """:func:`report_signals` of every report, the cell statistics of the whole batch computed together."""
    cells = [_cells(r) for r in reports]
    flat: list[tuple[list[float], list[float]]] = []
    for r, cs in zip(reports, cells, strict=True):
        flat.extend(cs.values())
        if r.e2e_pairs:
            flat.append(([p.stable_s for p in r.e2e_pairs], [p.candidate_s for p in r.e2e_pairs]))
    ratios = iter(_log_ratios(flat))
    out = []
    for r, cs in zip(reports, cells, strict=True):
        sig = _signals(r, {name: next(ratios) for name in cs})
        if r.e2e_pairs:
            sig["e2e"] = next(ratios)
        out.append(sig)
    return out


def _signals(report: wire.TrialReport, cells: dict[str, float]) -> dict[str, Any]:
    weights = {cell_name(w.op, w.tokens): w.weight for w in report.weights}
    out: dict[str, Any] = {"cells": cells}
    if cells:
        ws = [weights.get(k, 1.0 if not weights else 0.0) for k in cells]
        total = sum(ws)
        if total <= 0:  # a profile that weights none of the measured cells: equal weights
            ws, total = [1.0] * len(cells), float(len(cells))
        out["aggregate"] = sum(w * v for w, v in zip(ws, cells.values(), strict=True)) / total
    if report.e2e_pairs:
        out["e2e"] = None  # the cell statistic of the rounds: filled in by batch_signals
    elif report.e2e_stable_s is not None and report.e2e_candidate_s is not None:
        out["e2e"] = math.log(report.e2e_candidate_s / report.e2e_stable_s)
    mem = {cell_name(r.op, r.tokens): [r.stable_peak_bytes, r.candidate_peak_bytes] for r in report.resources
           if r.stable_peak_bytes is not None and r.candidate_peak_bytes is not None}
    launches = {cell_name(r.op, r.tokens): [r.stable_launches, r.candidate_launches] for r in report.resources
                if r.stable_launches is not None and r.candidate_launches is not None}
    if mem:
        out["memory"] = mem
        out["candidate_peak_bytes"] = max(r.candidate_peak_bytes or 0 for r in report.resources)
    if launches:
        out["launches"] = launches
    if report.free_memory_bytes is not None:
        out["free_memory_bytes"] = report.free_memory_bytes
    if report.numerics:
        out["numeric"] = {
            "checks": len(report.numerics),
            # edge-value checks judge finiteness only; their error at the dtype's limits is not a precision figure
            "max_abs_err": max((c.max_abs_err for c in report.numerics if c.kind != "edge"), default=0.0),
            "kinds": sorted({c.kind for c in report.numerics if c.kind}),
        }
    return out
