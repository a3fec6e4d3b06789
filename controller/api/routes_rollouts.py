"""Rollout endpoints: start, list, status (strata, steps, latest verdicts with evidence), explain (every judged
metric per stratum), promote, rollback, pause, resume. Each change is one transaction of the rollout engine (which writes its changelog event)."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Annotated

from fastapi import APIRouter, Path, Query, Request, Response
from sqlalchemy import func, select
from sqlalchemy.orm import Session, selectinload
from sqlalchemy.orm.exc import StaleDataError
from tenacity import retry, retry_if_exception, stop_after_attempt, wait_random

from controller import rollouts
from controller.api.deps import Operator, State, Viewer
from controller.api.pages import Cursor, Limit, keyset_page
from controller.api.schemas import (
    PromoteRequest,
    ReasonRequest,
    RollbackRequest,
    RolloutDetail,
    RolloutOut,
    RolloutStartRequest,
    StepOut,
    StratumOut,
    VerdictOut,
)
from controller.db.engine import aborted_by_lock_cycle
from controller.db.models import Assignment, Bundle, Node, Rollout, Verdict
from controller.errors import ConcurrentWrite, NotFound
from controller.explain import RolloutExplain
from controller.explain import explain as explain_rollout
from kernelctl import wire
from kernelctl.vocab import CANARY_PHASES, TERMINAL_STATES, shown_steps, stratum_key

RolloutId = Annotated[int, Path(ge=1, le=2**63 - 1, description="Rollout id.")]

router = APIRouter(prefix=wire.API_PREFIX + "/rollouts", tags=["rollouts"])
VERDICT_HISTORY = 50


def rollout_out(r: Rollout) -> RolloutOut:
    return RolloutOut(
        id=r.id, bundle=r.bundle.ref, state=r.state, step_index=r.step_index, created_by=r.created_by,
        created_at=r.created_at, updated_at=r.updated_at, reason=r.reason, forced=r.forced,
        promote_from_step=None if r.state in TERMINAL_STATES else rollouts.position(r),
    )


def _verdict_out(v: Verdict) -> VerdictOut:
    return VerdictOut(stratum=v.stratum, step_index=v.step_index, at=v.at, decision=v.decision, gate=v.gate,
                      samples=v.samples, evidence=shown_steps(v.evidence))  # "step" from 1, as shown


def rollout_detail(session: Session, rollout_id: int) -> RolloutDetail:
    r = session.scalars(
        select(Rollout).where(Rollout.id == rollout_id)
        .options(selectinload(Rollout.steps), selectinload(Rollout.strata), selectinload(Rollout.bundle))
    ).first()
    if r is None:
        raise NotFound(f"no rollout with id {rollout_id}")
    verdicts = list(session.scalars(
        select(Verdict).where(Verdict.rollout_id == r.id).order_by(Verdict.at.desc(), Verdict.id.desc())
        .limit(VERDICT_HISTORY)
    ))
    latest: dict[str, Verdict] = {}
    for v in verdicts:
        latest.setdefault(v.stratum, v)
    baselines = {b.id: b.ref for b in session.scalars(
        select(Bundle).where(Bundle.id.in_([s.baseline_bundle_id for s in r.strata if s.baseline_bundle_id]))
    )} if r.strata else {}
    # nodes per state in each stratum: eligible (fleet), assigned (desired = candidate), active (running it);
    # counted in SQL (a 10,000-node fleet is not loaded on every poll of a rollout)
    fleet_counts: Counter[str] = Counter()
    for arch, drv, triton, n in session.execute(
            select(Node.arch, Node.driver_version, Node.triton_version, func.count())
            .group_by(Node.arch, Node.driver_version, Node.triton_version)):
        fleet_counts[stratum_key(arch, drv, triton)] += n
    nodes: dict[str, Counter] = defaultdict(Counter)
    for arch, drv, triton, desired, active, phase in session.execute(
        select(Node.arch, Node.driver_version, Node.triton_version, Assignment.desired_bundle_id,
               Assignment.active_bundle_id, Assignment.phase)
        .join(Node, Node.id == Assignment.node_id)
        .where(Assignment.bundle_name == r.bundle.name, Assignment.rollout_id == r.id)
    ):
        st = stratum_key(arch, drv, triton)
        if desired == r.bundle_id:
            nodes[st]["assigned"] += 1
        if active == r.bundle_id:
            nodes[st]["active"] += 1
        if phase:
            nodes[st][phase] += 1  # trial before serve: staged -> verified -> serving
    strata = [
        StratumOut(
            stratum=s.stratum, state=s.state, step_index=s.step_index, step_started_at=s.step_started_at,
            baseline=baselines.get(s.baseline_bundle_id) if s.baseline_bundle_id else None, reason=s.reason,
            first_failure_at=s.first_failure_at,
            nodes={"fleet": fleet_counts.get(s.stratum, 0), "assigned": nodes[s.stratum]["assigned"],
                   "active": nodes[s.stratum]["active"],
                   **{p: nodes[s.stratum][p] for p in CANARY_PHASES}},
            latest_verdict=_verdict_out(latest[s.stratum]) if s.stratum in latest else None,
        )
        for s in r.strata
    ]
    base = rollout_out(r)
    return RolloutDetail(
        **base.model_dump(), plan=r.plan or {},
        steps=[StepOut(index=s.index, nodes=s.nodes, percent=s.percent, bake_seconds=s.bake_seconds,
                       min_samples=s.min_samples, deadline_seconds=s.deadline_seconds) for s in r.steps],
        strata=strata, verdicts=[_verdict_out(v) for v in verdicts],
    )


def _concurrent(exc: BaseException) -> bool:
    """A lost race with another writer (e.g. the judge's tick): optimistic concurrency, or a transaction the
    database aborted to break a deadlock. Safe to retry on fresh state."""
    return aborted_by_lock_cycle(exc) or isinstance(exc, StaleDataError | ConcurrentWrite)


# Operator transitions re-run their whole transaction when they lose a race with the tick (fresh read each
# time); a real conflict (invalid transition) fails the same way again and is returned as 409.
retry_race = retry(retry=retry_if_exception(_concurrent), stop=stop_after_attempt(4),
                   wait=wait_random(0.05, 0.3), reraise=True)


def _id(obj: object) -> int:
    return obj if isinstance(obj, int) else obj.id  # type: ignore[attr-defined]


@retry_race
def _transition(state, rollout_id: int, action) -> RolloutDetail:  # type: ignore[no-untyped-def]
    """One operator transition in one transaction (re-run on a lost race), answered with the new status."""
    with state.tx() as session:
        action(session)
        session.flush()
        return rollout_detail(session, rollout_id)


@router.post("", status_code=201, response_model=RolloutDetail)
def start(req: RolloutStartRequest, principal: Operator, state: State) -> RolloutDetail:
    """Start a rollout of NAME@VERSION with the given (or default) plan."""
    @retry_race
    def tx() -> RolloutDetail:
        with state.tx() as session:
            r = rollouts.start_rollout(session, req.bundle, actor=principal.actor, plan=req.plan, force=req.force,
                                       reason=req.reason, accept_contract_change=req.accept_contract_change)
            session.flush()
            return rollout_detail(session, _id(r))

    return tx()


@router.get("", response_model=list[RolloutOut])
def list_rollouts(_p: Viewer, state: State, request: Request, response: Response,
                  state_filter: str | None = Query(None, max_length=32, pattern=r"^[a-z_]+$"),
                  limit: int = Limit(100), cursor: str | None = Cursor()) -> list[RolloutOut]:
    """Rollouts, newest first, a page at a time."""
    stmt = select(Rollout).options(selectinload(Rollout.bundle))
    if state_filter:
        stmt = stmt.where(Rollout.state == state_filter)
    with state.read() as session:
        return [rollout_out(r) for r in keyset_page(session, stmt, "rollouts", (Rollout.id,), cursor=cursor,
                                                    limit=limit, request=request, response=response,
                                                    descending=True)]


@router.get("/{rollout_id}", response_model=RolloutDetail)
def show(rollout_id: RolloutId, _p: Viewer, state: State) -> RolloutDetail:
    with state.read() as session:
        return rollout_detail(session, rollout_id)


@router.get("/{rollout_id}/explain", response_model=RolloutExplain)
def explain(rollout_id: RolloutId, _p: Viewer, state: State,
            stratum: Annotated[str | None, Query(max_length=96, description="Only this stratum.")] = None,
            ) -> RolloutExplain:
    """Every judged metric per stratum (value, bounds, margin, n, decision, which decided) and its history."""
    with state.read() as session:
        return explain_rollout(session, rollout_id, stratum)


@router.post("/{rollout_id}/promote", response_model=RolloutDetail,
             responses={409: {"model": wire.ErrorBody, "description": "not at from_step (duplicate or race), "
                              "terminal, or a rollback is in progress"}})
def promote(rollout_id: RolloutId, req: PromoteRequest, principal: Operator, state: State) -> RolloutDetail:
    """Advance a rollout one step from ``from_step`` (or fully with ``full``); exactly once per step."""
    def action(s: Session) -> None:  # refused while a rollback of it is in flight on any replica
        rollouts.promote(s, rollout_id, actor=principal.actor, full=req.full, reason=req.reason,
                         from_step=req.from_step)

    return _transition(state, rollout_id, action)


@router.post("/{rollout_id}/rollback", response_model=RolloutDetail)
def rollback(rollout_id: RolloutId, req: RollbackRequest, principal: Operator, state: State) -> RolloutDetail:
    """Roll back now; while it runs, promotes of this rollout are refused (409) on every replica."""
    with state.tx() as s:  # committed first: promotes waiting for the rollout's lock see it
        intent = rollouts.request_rollback(s, rollout_id)
    try:
        detail = _rollback_transition(state, rollout_id, lambda s: rollouts.rollback(
            s, rollout_id, actor=principal.actor, reason=req.reason, strata=req.strata))
    finally:
        with state.tx() as s:
            rollouts.end_rollback(s, intent)
    state.metrics.rollbacks.inc()
    return detail


@retry(retry=retry_if_exception(_concurrent), stop=stop_after_attempt(10), wait=wait_random(0.02, 0.2),
       reraise=True)
def _rollback_transition(state, rollout_id: int, action) -> RolloutDetail:  # type: ignore[no-untyped-def]
    """A rollback retries harder than other transitions: it must not lose to a racing writer."""
    with state.tx() as session:
        action(session)
        session.flush()
        return rollout_detail(session, rollout_id)


@router.post("/{rollout_id}/pause", response_model=RolloutDetail)
def pause(rollout_id: RolloutId, principal: Operator, state: State, req: ReasonRequest | None = None) -> RolloutDetail:
    reason = (req or ReasonRequest()).reason
    return _transition(state, rollout_id, lambda s: rollouts.pause(s, rollout_id, actor=principal.actor, reason=reason))


@router.post("/{rollout_id}/resume", response_model=RolloutDetail)
def resume(rollout_id: RolloutId, principal: Operator, state: State, req: ReasonRequest | None = None) -> RolloutDetail:
    reason = (req or ReasonRequest()).reason
    return _transition(state, rollout_id, lambda s: rollouts.resume(s, rollout_id, actor=principal.actor, reason=reason))


def count_by_state(session: Session) -> dict[str, int]:
    return dict(session.execute(select(Rollout.state, func.count()).group_by(Rollout.state)).all())
