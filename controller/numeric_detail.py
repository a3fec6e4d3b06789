"""What a numeric failure was, read from the stored reports: op, dtype, shape, check, error, tolerance, nodes.

The judge's hard gate counts failing reports (:func:`controller.gates.hard_failures`); this module reads what
those reports say failed, so that every place that shows a numeric or mismatch rollback (the verdict's reason,
hence explain, the page, the webhook and the audit trail) names it::

    add_rmsnorm fp32 hidden=1032, golden check: max_abs_err 0.317 > atol 1e-05 + rtol 1e-05*|ref|
    (2 numeric_error report(s) from 2 node(s): gpu-a, gpu-b)

At ingest :func:`failed_checks` keeps a report's failing checks in ``detail["failed_checks"]``; reports stored
before that carry only ``detail["numerics"]["worst"]`` and the trial's text, which :func:`_legacy_check` reads.
The tolerance is the bundle manifest's for (op, dtype), the stricter of the candidate's and the stable
version's (the trial holds the candidate to both).
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from controller.db.models import Bundle, Node, Report
from kernelctl import wire

NUMERIC_OUTCOMES = ("numeric_error", "mismatch")
MAX_CHECKS = 5  # failing checks kept per report
MAX_NODES = 10  # node names shown
MAX_REPORTS = 500  # failing reports read per tick (a failing stratum is rolled back on the first)
# the trial's note: "1 numeric check(s) over tolerance; first: golden add_rmsnorm fp32 {'hidden': 1032} ..."
_FIRST = re.compile(r"first: (?P<check>[a-z_]+)(?:/(?P<case>\S+))? (?P<op>\S+) (?P<dtype>fp16|bf16|fp32) ")


def failed_checks(report: wire.TrialReport) -> list[dict[str, Any]]:
    """The report's failing numeric checks, worst first (over tolerance before a mismatch with stable, then
    by error): what ingest stores so the judge can say what failed."""
    bad = [c for c in report.numerics
           if not c.within_tolerance or c.unwritten or c.nonfinite or c.vs_stable_within is False]
    bad.sort(key=lambda c: (c.within_tolerance and not c.unwritten, -c.max_abs_err))
    return [{"op": c.op, "dtype": c.dtype, "shape": dict(c.shape), "check": c.kind, "case": c.case,
             "max_abs_err": c.max_abs_err, "max_rel_err": c.max_rel_err, "vs_stable_max_abs": c.vs_stable_max_abs,
             "nonfinite": c.nonfinite, "unwritten": c.unwritten,
             "failed": "tolerance" if not c.within_tolerance or c.unwritten else "vs_stable"}
            for c in bad[:MAX_CHECKS]]


def _legacy_check(detail: dict[str, Any]) -> dict[str, Any] | None:
    """The worst check of a report stored before ``failed_checks`` existed (numerics summary + trial text)."""
    worst = (detail.get("numerics") or {}).get("worst")
    if not isinstance(worst, dict) or "op" not in worst:
        return None
    m = _FIRST.search(str(detail.get("text") or ""))
    same = m is not None and m["op"] == worst["op"] and m["dtype"] == worst.get("dtype")
    return {"op": worst["op"], "dtype": worst.get("dtype"), "shape": worst.get("shape") or {},
            "check": m["check"] if same else None, "case": m["case"] if same else None,
            "max_abs_err": worst.get("max_abs_err"), "failed": "tolerance"}


def _tolerance(manifests: list[dict[str, Any]], op: str, dtype: str | None) -> dict[str, float] | None:
    """The stricter (per field) of the manifests' tolerances for (op, dtype)."""
    tols = [k.get("tolerances", {}).get(dtype) for m in manifests for k in m.get("kernels", [])
            if isinstance(k, dict) and k.get("op") == op]
    tols = [t for t in tols if isinstance(t, dict) and "atol" in t and "rtol" in t]
    if not tols:
        return None
    return {"atol": min(float(t["atol"]) for t in tols), "rtol": min(float(t["rtol"]) for t in tols)}


def numeric_failures(session: Session, keys: set[tuple[int, str]]) -> dict[tuple[int, str], dict[str, Any]]:
    """Per (rollout, stratum): the worst failing check of its numeric_error/mismatch reports from active nodes,
    with its tolerance, the failing reports per outcome and the nodes (one query, plus the manifests)."""
    if not keys:
        return {}
    rows = session.execute(
        select(Report.rollout_id, Report.stratum, Report.outcome, Report.detail, Report.bundle_id,
               Report.stable_bundle_id, Node.name)
        .join(Node, Node.id == Report.node_id)
        .where(Report.rollout_id.in_(sorted({k[0] for k in keys})), Report.outcome.in_(NUMERIC_OUTCOMES),
               Node.state == "active")
        .order_by(Report.id).limit(MAX_REPORTS)).all()
    found: dict[tuple[int, str], dict[str, Any]] = {}
    nodes: dict[tuple[int, str], set[str]] = defaultdict(set)
    for rid, stratum, outcome, detail, bundle_id, stable_id, node in rows:
        key = (rid, stratum)
        if key not in keys:
            continue
        nodes[key].add(node)
        f = found.setdefault(key, {"reports": {}, "worst": None, "bundles": (bundle_id, stable_id)})
        f["reports"][outcome] = f["reports"].get(outcome, 0) + 1
        checks = (detail or {}).get("failed_checks") or [c for c in [_legacy_check(detail or {})] if c]
        for c in checks:
            c = {**c, "node": node}
            w = f["worst"]
            if w is None or (c["failed"], -(c.get("max_abs_err") or 0)) < (w["failed"], -(w.get("max_abs_err") or 0)):
                f["worst"] = c
    ids = {i for f in found.values() for i in f["bundles"] if i is not None}
    manifests = {b.id: b.manifest or {} for b in session.scalars(select(Bundle).where(Bundle.id.in_(sorted(ids))))}
    out: dict[tuple[int, str], dict[str, Any]] = {}
    for key, f in found.items():
        w = f["worst"]
        tol = None
        if w is not None:
            tol = _tolerance([manifests[i] for i in f["bundles"] if i in manifests], w["op"], w.get("dtype"))
        names = sorted(nodes[key])
        out[key] = {"check": w, "tolerance": tol, "reports": f["reports"], "nodes": names[:MAX_NODES],
                    "node_count": len(names)}
    return out


def error_and_tolerance(failure: dict[str, Any] | None) -> tuple[float | None, float | None]:
    """The failing check's error and the bound it is held to (``atol``), for the verdict's metric row."""
    c = (failure or {}).get("check") or {}
    err = c.get("vs_stable_max_abs") if c.get("failed") == "vs_stable" else c.get("max_abs_err")
    tol = ((failure or {}).get("tolerance") or {}).get("atol")
    return (float(err) if isinstance(err, int | float) else None), (float(tol) if tol is not None else None)


def fmt_shape(shape: dict[str, Any] | None) -> str:
    return " ".join(f"{k}={v}" for k, v in (shape or {}).items())


def describe(failure: dict[str, Any]) -> str:
    """One line: what failed, by how much against which tolerance, and where."""
    c, tol = failure.get("check"), failure.get("tolerance")
    counts = ", ".join(f"{n} {o}" for o, n in sorted((failure.get("reports") or {}).items()))
    shown = ", ".join(failure.get("nodes") or [])
    more = (failure.get("node_count") or 0) - len(failure.get("nodes") or [])
    shown += f" and {more} more" if more > 0 else ""
    where = f"({counts} report(s) from {failure.get('node_count')} node(s): {shown})"
    if not c:
        return f"no check detail in the reports {where}"
    what = " ".join(x for x in (c["op"], c.get("dtype") or "", fmt_shape(c.get("shape"))) if x)
    check = f"{c['check']}{'/' + c['case'] if c.get('case') else ''} check" if c.get("check") else "check"
    bound = f"atol {tol['atol']:g} + rtol {tol['rtol']:g}*|ref|" if tol else "its tolerance"
    if c.get("failed") == "vs_stable":
        err = f"max |candidate-stable| {_num(c.get('vs_stable_max_abs'))} > {bound}"
    else:
        err = f"max_abs_err {_num(c.get('max_abs_err'))} > {bound}"
        if c.get("max_rel_err") is not None:
            err += f" (max_rel_err {_num(c['max_rel_err'])})"
    extra = [f"{c[k]} {k}" for k in ("nonfinite", "unwritten") if c.get(k)]
    return f"{what}, {check}: {err}{'; ' + ', '.join(extra) if extra else ''} {where}"


def _num(x: Any) -> str:
    return f"{x:.3g}" if isinstance(x, int | float) else "?"
