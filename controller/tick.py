"""The leader's tick: stale nodes, pending rollouts, and a verdict for every live stratum of every rollout.

One call is one pass in the caller's transaction; each rollout is handled in its own savepoint so a rollout
that an operator changed at the same instant (optimistic-concurrency Conflict) is simply left for the next
tick. Evidence is read with a few set-based queries for all strata at once (no per-node queries). A verdict
row is written when the decision or gate changes, on every non-hold decision, and for a repeated hold at
most every ``plan.hold_verdict_seconds``.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import and_, func, insert, not_, or_, select, update
from sqlalchemy.orm import Session, selectinload
from sqlalchemy.orm.exc import StaleDataError

from controller import assignments, rollouts
from controller.changelog import record_event
from controller.db.models import Event, Node, Rollout, RolloutStratum, Verdict, as_utc
from controller.desired.generation import changed
from controller.errors import Conflict
from controller.evidence import EvidenceCache
from controller.gates import Decision, StepEvidence, decide, hard_failures, step_evidence
from controller.plan import load_plan
from kernelctl.settings import Settings
from kernelctl.vocab import ACTIVE_STATES, PAUSED, PENDING, PROGRESSING

log = logging.getLogger(__name__)
ACTOR = rollouts.SYSTEM_ACTOR


@dataclass(frozen=True)
class RollbackInfo:
    rollout_id: int
    stratum: str
    gate: str
    time_to_rollback_seconds: float | None  # first failing report received -> this decision


@dataclass
class TickResult:
    """What one tick did (for logs and Prometheus metrics)."""

    stale_nodes: list[str] = field(default_factory=list)
    started: list[int] = field(default_factory=list)
    advanced: list[tuple[int, str, int]] = field(default_factory=list)
    promoted: list[tuple[int, str]] = field(default_factory=list)
    rolled_back: list[RollbackInfo] = field(default_factory=list)
    paused: list[tuple[int, str]] = field(default_factory=list)
    holds: int = 0
    decisions: list[tuple[str, str]] = field(default_factory=list)  # (gate, decision) of every live stratum
    verdicts_written: int = 0
    conflicts: list[int] = field(default_factory=list)  # rollouts skipped: changed concurrently
    errors: list[int] = field(default_factory=list)  # rollouts skipped: unexpected error (logged)
    rollouts_by_state: dict[str, int] = field(default_factory=dict)
    max_step_age_seconds: float = 0.0
    duration_seconds: float = 0.0


def mark_stale(session: Session, now: dt.datetime, stale_after_seconds: float,
               startup_grace_seconds: float = 0.0) -> list[str]:
    """Nodes without a heartbeat for ``stale_after_seconds`` become stale (one UPDATE, one event each); a node
    that has not heartbeated since its agent last registered, only ``startup_grace_seconds`` after that
    registration (at least ``stale_after_seconds``: a cold start of the fleet may keep its registration retries
    in the controller's listen queue, and a node is alive while its agent is still registering)."""
    cutoff = now - dt.timedelta(seconds=stale_after_seconds)
    grace = now - dt.timedelta(seconds=max(stale_after_seconds, startup_grace_seconds))
    starting = and_(Node.last_registered_at.is_not(None), Node.last_heartbeat_at <= Node.last_registered_at)
    stale = and_(Node.state == "active", Node.last_heartbeat_at < cutoff,
                 or_(not_(starting), Node.last_registered_at < grace))
    # the rows locked in id order first, as every writer of many nodes does (controller.desired.liveness)
    due = select(Node.id).where(stale).order_by(Node.id).with_for_update(key_share=True)
    marked = dict(session.execute(
        update(Node).where(Node.id.in_(due.scalar_subquery()), stale)
        .values(state="stale").returning(Node.id, Node.name), execution_options={"synchronize_session": False}).all())
    names = list(marked.values())
    if names:
        # a stale node is no canary (its stratum's step is topped up elsewhere); replicas patch its state in
        changed(session, nodes=dict.fromkeys(marked, "stale"))
        reason = f"no heartbeat for {stale_after_seconds:g}s"
        session.execute(insert(Event), [
            {"at": now, "actor": ACTOR, "action": "node.stale", "subject": f"node:{n}", "reason": reason,
             "payload": {}, "node": n} for n in names])
        for obj in session.identity_map.values():  # keep loaded Node objects in step with the UPDATE
            if isinstance(obj, Node) and obj.name in names:
                session.expire(obj, ["state"])
    return names


def _last_verdicts(session: Session, rollout_ids: list[int]) -> dict[tuple[int, str], Verdict]:
    if not rollout_ids:
        return {}
    latest = (select(func.max(Verdict.id)).where(Verdict.rollout_id.in_(rollout_ids))
              .group_by(Verdict.rollout_id, Verdict.stratum))
    return {(v.rollout_id, v.stratum): v for v in session.scalars(select(Verdict).where(Verdict.id.in_(latest)))}


def _judge_view(evidence: dict[str, Any] | None) -> Any:
    ev = evidence or {}
    fam = ev.get("family")
    lat = ev.get("latency")
    return (fam.get("decision") if isinstance(fam, dict) else None,
            lat.get("decision") if isinstance(lat, dict) else None, ev.get("deciding_metric"))


def _should_record(d: Decision, row: RolloutStratum, last: Verdict | None, now: dt.datetime, every: float) -> bool:
    if d.decision != "hold" or last is None:
        return True
    if (last.decision, last.gate, last.step_index) != (d.decision, d.gate, row.step_index):
        return True
    if _judge_view(last.evidence) != _judge_view(d.evidence):
        return True  # e.g. the latency judge went from "too few samples" to "pass, baking"
    return (now - as_utc(last.at)).total_seconds() >= every


def run_tick(session: Session, now: dt.datetime, *, settings: Settings, judge_staleness: bool = True,
             cache: EvidenceCache | None = None) -> TickResult:
    """One judge pass (the leader calls it every ``tick_seconds``). ``judge_staleness`` False: no node is
    marked stale (a leader that took over less than ``stale_after_seconds`` ago has not heard every agent).
    ``cache``: the leader's evidence kept between ticks (only reports new since the last tick are read,
    :mod:`controller.evidence`); None reads every report of every live stratum."""
    t0 = time.perf_counter()
    result = TickResult()
    if judge_staleness:
        result.stale_nodes = mark_stale(session, now, settings.stale_after_seconds,
                                        settings.node_startup_grace_seconds)

    live = list(session.scalars(
        select(Rollout).where(Rollout.state.in_(ACTIVE_STATES))
        .options(selectinload(Rollout.strata), selectinload(Rollout.bundle)).order_by(Rollout.id)))
    for r in [r for r in live if r.state == PENDING]:
        if _guarded(session, result, r.id, lambda r=r: _begin(session, r, now)):
            result.started.append(r.id)
            result.verdicts_written += sum(1 for s in r.strata if s.reason == _CLAMPED)

    rows = [(r, s) for r in live if r.state in (PROGRESSING, PAUSED)
            for s in r.strata if s.state in (PROGRESSING, PAUSED)]
    hard = hard_failures(session, {(r.id, s.stratum) for r, s in rows if s.first_failure_at is not None})
    judged = {s.id: (r.id, s.stratum) for r, s in rows if s.state == PROGRESSING}
    evidence = (step_evidence(session, list(judged)) if cache is None
                else cache.step_evidence(session, judged))
    counts = assignments.canary_counts(session, sorted({r.id for r, _ in rows}))
    last = _last_verdicts(session, sorted({r.id for r, _ in rows}))

    by_rollout: dict[int, list[tuple[RolloutStratum, Decision]]] = {}
    plans = {}
    for r, s in rows:
        key = (r.id, s.stratum)
        plan = plans.setdefault(r.id, load_plan(r.plan))
        if s.state == PAUSED and key not in hard:
            continue  # paused: only hard gates are still enforced
        step = plan.steps[min(s.step_index, len(plan.steps) - 1)]
        d = decide(s, step, plan, now, hard=hard.get(key), ev=evidence.get(key) or StepEvidence(), canaries=counts.get(key, 0))
        by_rollout.setdefault(r.id, []).append((s, d))
        result.decisions.append((d.gate, d.decision))
    rollout_by_id = {r.id: r for r in live}
    for rid, decided in by_rollout.items():
        r = rollout_by_id[rid]
        _guarded(session, result, rid, lambda r=r, decided=decided: _apply(
            session, r, decided, now, plans[r.id], last, counts, hard, result))

    result.rollouts_by_state = dict(session.execute(
        select(Rollout.state, func.count()).group_by(Rollout.state)).all())
    oldest = session.scalar(select(func.min(RolloutStratum.step_started_at))
                            .where(RolloutStratum.state == PROGRESSING))
    result.max_step_age_seconds = max(0.0, (now - as_utc(oldest)).total_seconds()) if oldest else 0.0
    result.duration_seconds = time.perf_counter() - t0
    return result


_CLAMPED = "step clamped by the blast radius"


def _begin(session: Session, r: Rollout, now: dt.datetime) -> None:
    """pending -> progressing; a step-0 clamp is recorded as a verdict (gate blast_radius)."""
    sized = rollouts.begin(session, r, actor=ACTOR, now=now, reason="started by the controller")
    for s in r.strata:
        a = sized.get(s.stratum)
        if a is not None and a.clamp:
            s.reason = _CLAMPED
            session.add(Verdict(rollout_id=r.id, stratum=s.stratum, step_index=0, at=now, decision="hold",
                                gate="blast_radius", samples=0,
                                evidence={"reason": _CLAMPED, "clamp": a.clamp, "sizing": a.as_evidence()}))


def _guarded(session: Session, result: TickResult, rollout_id: int, fn: Any) -> bool:
    """Run ``fn`` in a savepoint; a concurrent change of the rollout skips it until the next tick."""
    try:
        with session.begin_nested():
            fn()
            session.flush()
        return True
    except (Conflict, StaleDataError) as exc:
        log.info("tick: rollout %s changed concurrently, left for the next tick: %s", rollout_id, exc)
        result.conflicts.append(rollout_id)
        return False
    except Exception:  # one broken rollout must not stop the judge for every other one
        log.exception("tick: rollout %s failed; its changes in this tick were undone", rollout_id)
        result.errors.append(rollout_id)
        return False


def _apply(session: Session, r: Rollout, decided: list[tuple[RolloutStratum, Decision]], now: dt.datetime,
           plan: Any, last: dict, counts: dict, hard: dict, result: TickResult) -> None:
    for s, d in decided:
        if s.state not in (PROGRESSING, PAUSED):
            continue  # changed by an earlier decision of this rollout
        step_index = s.step_index
        if d.decision == "hold" and counts.get((r.id, s.stratum), 0) == 0:
            sized = assignments.assign_step(session, r, [s], plan, now=now)[s.stratum]
            d.evidence["top_up"] = sized.as_evidence()
            if sized.added:
                record_event(session, actor=ACTOR, action="rollout.canaries_replaced", subject=f"rollout:{r.id}",
                             reason="no live canary left in the stratum (stale nodes)", bundle=r.bundle.ref,
                             rollout_id=r.id, payload={"stratum": s.stratum, "added": sized.added})
        outcome = d.decision
        if d.decision == "rollback":
            ttr = (now - as_utc(s.first_failure_at)).total_seconds() if s.first_failure_at is not None else None
            rollouts.rollback_strata(session, r, [s], actor=ACTOR, now=now, mark_incompatible=True,
                                     reason=f"judge: {d.reason}", evidence={"gate": d.gate})
            result.rolled_back.append(RollbackInfo(r.id, s.stratum, d.gate, ttr))
        elif d.decision == "advance":
            kind, sized = rollouts.advance_stratum(session, r, s, actor=ACTOR, now=now, reason=f"judge: {d.reason}")
            if sized is not None and sized.clamp:
                d.evidence["next_step_clamp"] = sized.clamp
            if sized is not None:
                d.evidence["next_step"] = sized.as_evidence()
            if kind == "promote":
                outcome = "promote"
                result.promoted.append((r.id, s.stratum))
            else:
                result.advanced.append((r.id, s.stratum, s.step_index))
        elif d.decision == "pause":
            rollouts.pause_stratum(session, r, s, actor=ACTOR, now=now, reason=f"judge: {d.reason}")
            result.paused.append((r.id, s.stratum))
        else:
            result.holds += 1
        if _should_record(d, s, last.get((r.id, s.stratum)), now, plan.hold_verdict_seconds):
            session.add(Verdict(rollout_id=r.id, stratum=s.stratum, step_index=step_index, at=now, decision=outcome,
                                gate=d.gate, samples=d.samples, evidence={"reason": d.reason, **d.evidence}))
            result.verdicts_written += 1
