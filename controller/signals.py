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
"""

from __future__ import annotations

import math
from typing import Any

from controller.judge.statistic import cell_log_ratio
from kernelctl import wire

AGGREGATE = "latency:aggregate"
E2E = "e2e"


def cell_name(op: str, tokens: int) -> str:
    return f"{op}@{tokens}"


def report_signals(report: wire.TrialReport) -> dict[str, Any]:
    """The JSON-safe signals of one report (see the module docstring)."""
    groups: dict[tuple[str, int], tuple[list[float], list[float]]] = {}
    for p in report.latency:
        st, ca = groups.setdefault((p.op, p.tokens), ([], []))
        st.append(p.stable_s)
        ca.append(p.candidate_s)
    cells = {cell_name(op, t): cell_log_ratio(st, ca) for (op, t), (st, ca) in sorted(groups.items())}
    weights = {cell_name(w.op, w.tokens): w.weight for w in report.weights}
    out: dict[str, Any] = {"cells": cells}
    if cells:
        ws = [weights.get(k, 1.0 if not weights else 0.0) for k in cells]
        total = sum(ws)
        if total <= 0:  # a profile that weights none of the measured cells: equal weights
            ws, total = [1.0] * len(cells), float(len(cells))
        out["aggregate"] = sum(w * v for w, v in zip(ws, cells.values(), strict=True)) / total
    if report.e2e_pairs:
        out["e2e"] = cell_log_ratio([p.stable_s for p in report.e2e_pairs], [p.candidate_s for p in report.e2e_pairs])
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
