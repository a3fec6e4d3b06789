"""``GET /v1/rollouts/{id}/explain``: every judged metric of every stratum, from the stored verdicts.

Per stratum: the latest verdict's decision, gate, deciding metric and reason, with one row per metric (value,
bounds, margin, sample count, the metric's own decision, and whether it decided), and the history of the
stratum's verdicts (holds are recorded periodically, so bounds can be plotted over time). A numeric or mismatch
rollback also carries ``failure``: the failing check (op, dtype, shape, check, error), its tolerance, the
failing reports and the nodes (:mod:`controller.numeric_detail`). Verdicts written
before per-metric evidence existed show their aggregate latency evidence as ``latency:aggregate``.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from pydantic import BaseModel
from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from controller.db.models import Rollout, Verdict
from controller.errors import NotFound

HISTORY_LIMIT = 2000  # verdict rows per stratum in the history (the newest)
HISTORY_KEYS = ("value", "lower", "upper", "margin", "n", "bound", "bound_side")


class MetricOut(BaseModel):
    metric: str
    kind: str
    unit: str
    value: float | None
    lower: float | None
    upper: float | None
    margin: float | None
    n: int
    decision: str
    deciding: bool
    # latency metrics (issue 25): the statistic, the bound that decides against the margin and its side
    # ("upper" must fall below the margin to pass, "lower" above it to regress), and both arms' figures
    statistic: str | None = None
    bound: float | None = None
    bound_side: str | None = None
    arms: dict[str, Any] | None = None


class HistoryOut(BaseModel):
    at: dt.datetime
    step_index: int
    decision: str
    gate: str
    metrics: dict[str, dict[str, Any]]


class StratumExplain(BaseModel):
    stratum: str
    state: str
    step_index: int
    decision: str
    gate: str
    deciding_metric: str | None
    reason: str
    at: dt.datetime | None
    failure: dict[str, Any] | None = None
    metrics: list[MetricOut]
    history: list[HistoryOut]


class RolloutExplain(BaseModel):
    rollout_id: int
    state: str
    bundle: str
    strata: list[StratumExplain]


def metrics_of(evidence: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The per-metric rows of a verdict's evidence (legacy verdicts: their aggregate latency evidence)."""
    ev = evidence or {}
    rows = ev.get("metrics")
    if isinstance(rows, list):
        return [r for r in rows if isinstance(r, dict) and "metric" in r]
    lat = ev.get("latency")
    if isinstance(lat, dict) and "n" in lat:
        return [{"metric": "latency:aggregate", "kind": "latency_aggregate", "unit": "log_ratio",
                 "value": lat.get("mean"), "lower": lat.get("lower"), "upper": lat.get("upper"),
                 "margin": lat.get("margin"), "n": int(lat.get("n") or 0), "decision": lat.get("decision", "hold"),
                 "deciding": False}]
    return []


def explain(session: Session, rollout_id: int, stratum: str | None = None) -> RolloutExplain:
    r = session.scalars(select(Rollout).where(Rollout.id == rollout_id)
                        .options(selectinload(Rollout.strata), selectinload(Rollout.bundle))).first()
    if r is None:
        raise NotFound(f"no rollout with id {rollout_id}")
    strata = sorted(r.strata, key=lambda s: s.stratum)
    if stratum is not None:
        strata = [s for s in strata if s.stratum == stratum]
        if not strata:
            raise NotFound(f"rollout {rollout_id} has no stratum {stratum!r} "
                           f"(strata: {', '.join(sorted(s.stratum for s in r.strata)) or 'none'})")
    out = []
    for s in strata:
        rows = list(session.scalars(
            select(Verdict).where(Verdict.rollout_id == r.id, Verdict.stratum == s.stratum)
            .order_by(Verdict.at.desc(), Verdict.id.desc()).limit(HISTORY_LIMIT)))
        rows.reverse()
        last = rows[-1] if rows else None
        ev = (last.evidence or {}) if last else {}
        history = [HistoryOut(at=v.at, step_index=v.step_index, decision=v.decision, gate=v.gate, metrics={
            m["metric"]: {k: m.get(k) for k in HISTORY_KEYS} for m in metrics_of(v.evidence)}) for v in rows]
        out.append(StratumExplain(
            stratum=s.stratum, state=s.state, step_index=s.step_index,
            decision=last.decision if last else "none", gate=last.gate if last else "none",
            deciding_metric=ev.get("deciding_metric"), reason=str(ev.get("reason") or s.reason or ""),
            at=last.at if last else None, failure=(ev.get("hard_gate") or {}).get("numeric"),
            metrics=[MetricOut(**m) for m in metrics_of(ev)], history=history))
    return RolloutExplain(rollout_id=r.id, state=r.state, bundle=r.bundle.ref, strata=out)
