"""The rollout state machine: start, promote, rollback, pause, resume (per rollout and per stratum).

States: ``pending -> progressing(step k) -> ... -> promoted``; ``progressing <-> paused``;
``pending|progressing|paused -> rolled_back``; ``promoted``, ``partly_promoted`` and ``rolled_back`` are
terminal. Each stratum has its own state in ``rollout_strata`` (pending | progressing | paused | promoted |
rolled_back) and the rollout's state summarises them (:func:`summarise`): while any stratum is live, the
liveliest; then ``promoted`` (every stratum promoted), ``rolled_back`` (every stratum rolled back) or
``partly_promoted`` (some of each: the version is stable where promoted and marked incompatible where rolled
back; it is not revoked). Steps are stored 0-based (``step_index``); people see
:func:`kernelctl.vocab.step_number`. Every function runs inside the caller's transaction, writes its changelog
event there (with the rollout's state right after it, ``rollout_state``), is idempotent (repeating an action is
a no-op success without a second event) and refuses an invalid transition with :class:`Conflict`.
``row_version`` on rollouts and strata turns a concurrent writer into :class:`ConcurrentWrite`, a retryable
:class:`Conflict` (every transition also touches the rollout row, so two writers never both win).
"""

from __future__ import annotations

import datetime as dt
import functools
import re
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from sqlalchemy import delete, select
from sqlalchemy.orm import Session
from sqlalchemy.orm.exc import StaleDataError

from controller import assignments
from controller.changelog import record_event
from controller.compat import cached_fleet, eligible_by_stratum
from controller.contract import ContractChange, contract_changes
from controller.db.models import (
    Bundle,
    Incompatibility,
    RollbackIntent,
    Rollout,
    RolloutStep,
    RolloutStratum,
    StableVersion,
    utcnow,
)
from controller.desired.generation import changed
from controller.errors import ConcurrentWrite, Conflict, Invalid, NotFound
from controller.plan import PlanSpec, load_plan
from controller.providers import op_clashes
from kernelctl.vocab import (
    ACTIVE_STATES,
    PARTLY_PROMOTED,
    PAUSED,
    PENDING,
    PROGRESSING,
    PROMOTED,
    ROLLED_BACK,
    TERMINAL_STATES,
    step_number,
)

REF_RE = re.compile(r"^([a-z0-9][a-z0-9._-]{0,127})@(\d+\.\d+\.\d+(?:-[0-9A-Za-z.-]+)?(?:\+[0-9A-Za-z.-]+)?)$")
SYSTEM_ACTOR = "controller"
F = TypeVar("F", bound=Callable[..., Any])


def parse_ref(ref: str) -> tuple[str, str]:
    """Split ``name@version``; Invalid when it is not of that form."""
    m = REF_RE.match(ref or "")
    if not m:
        raise Invalid(f"bundle reference {ref!r} is not NAME@VERSION (e.g. llm-fused@1.1.0)")
    return m.group(1), m.group(2)


def get_bundle(session: Session, ref: str) -> Bundle:
    name, version = parse_ref(ref)
    b = session.scalar(select(Bundle).where(Bundle.name == name, Bundle.version == version))
    if b is None:
        raise NotFound(f"bundle {ref} is not registered (push it first: kernelctl bundle push)")
    return b


def get_rollout(session: Session, rollout_id: int, *, lock: bool = False) -> Rollout:
    """The rollout; ``lock`` takes its row lock (PostgreSQL ``FOR NO KEY UPDATE``): operator actions serialise."""
    r = session.get(Rollout, rollout_id, with_for_update={"key_share": True} if lock else None)
    if r is None:
        raise NotFound(f"rollout {rollout_id} does not exist")
    return r


def flush(session: Session, what: str) -> None:
    """Flush; a lost optimistic-concurrency race becomes Conflict naming the row."""
    try:
        session.flush()
    except StaleDataError:
        raise ConcurrentWrite(what) from None


def guarded(fn: F) -> F:
    """Turn a lost optimistic-concurrency race anywhere in ``fn`` (flush or autoflush) into Conflict."""

    @functools.wraps(fn)
    def wrapper(session: Session, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(session, *args, **kwargs)
        except StaleDataError:
            what = f"rollout {args[0]}" if args and isinstance(args[0], int) else "the rollout"
            raise ConcurrentWrite(what) from None

    return wrapper  # type: ignore[return-value]


def _strata_changed(session: Session, rollout: Rollout, rows: list[RolloutStratum]) -> None:
    """These strata's states changed: declared for the replicas' snapshots (``controller.desired.generation``)."""
    changed(session, strata={(rollout.id, r.stratum): r.state for r in rows})


def _touch(rollout: Rollout, now: dt.datetime) -> None:
    rollout.updated_at = now  # bumps row_version: any two transitions of one rollout conflict


def _event(session: Session, rollout: Rollout, action: str, *, actor: str, reason: str | None = None,
           payload: dict[str, Any] | None = None) -> None:
    """The changelog event of a transition; its payload carries the rollout's state right after it
    (``rollout_state``: what a notification sent later reports). A payload's ``step`` is the stored 0-based
    index, as in every changelog event (the database keeps one convention; readers show step_number)."""
    record_event(session, actor=actor, action=action, subject=f"rollout:{rollout.id}", reason=reason,
                 payload={**(payload or {}), "rollout_state": rollout.state}, bundle=rollout.bundle.ref,
                 rollout_id=rollout.id)


def summarise(rollout: Rollout) -> str:
    """The rollout state implied by its strata."""
    states = {s.state for s in rollout.strata}
    for st in (PROGRESSING, PAUSED, PENDING):
        if st in states:
            return st
    if PROMOTED in states:
        return PARTLY_PROMOTED if ROLLED_BACK in states else PROMOTED
    return ROLLED_BACK


def outcomes(rollout: Rollout) -> dict[str, list[str]]:
    """The strata of a rollout by their state (``{"promoted": [...], "rolled_back": [...]}``), sorted."""
    out: dict[str, list[str]] = {}
    for s in sorted(rollout.strata, key=lambda x: x.stratum):
        out.setdefault(s.state, []).append(s.stratum)
    return out


def _sync_summary(rollout: Rollout) -> None:
    rollout.state = summarise(rollout)
    live = [s.step_index for s in rollout.strata if s.state in ACTIVE_STATES]
    rollout.step_index = min(live) if live else max((s.step_index for s in rollout.strata), default=0)


# ------------------------------------------------------------------------------------------------ start
@guarded
def start_rollout(
    session: Session,
    bundle_ref: str,
    *,
    actor: str,
    plan: PlanSpec | None = None,
    force: bool = False,
    reason: str | None = None,
    now: dt.datetime | None = None,
    accept_contract_change: str | None = None,
) -> Rollout:
    """Create a pending rollout of ``bundle_ref`` over the strata where it is eligible and not yet stable.

    Starting the same version again while its rollout is active returns that rollout (no-op). A candidate that
    loosens a baseline's numeric contract (:mod:`controller.contract`) is refused unless
    ``accept_contract_change`` says why (recorded in the ``rollout.started`` event).
    """
    now = now or utcnow()
    name, _ = parse_ref(bundle_ref)
    # lock every version of this bundle name: concurrent starts of one name serialise (PostgreSQL)
    session.execute(select(Bundle.id).where(Bundle.name == name).with_for_update(key_share=True)).all()
    bundle = get_bundle(session, bundle_ref)
    if bundle.status == "revoked" and not force:
        raise Conflict(f"{bundle.ref} is revoked ({bundle.status_reason or 'no reason recorded'}); "
                       "start it with force to roll it out anyway")
    plan = plan or PlanSpec()
    active = list(session.scalars(select(Rollout).join(Bundle, Bundle.id == Rollout.bundle_id)
                                  .where(Bundle.name == name, Rollout.state.in_(ACTIVE_STATES))))
    for r in active:
        if r.bundle_id == bundle.id:
            return r
    fleet = [n for n in cached_fleet(session) if n.state == "active"]
    eligible = eligible_by_stratum(bundle, fleet)
    if not eligible:
        targets = ", ".join(f"{t.arch} drv>={t.min_driver} triton {t.triton} torch {t.torch}" for t in bundle.targets)
        raise Conflict(f"no eligible nodes for {bundle.ref}: no active node matches its targets ({targets})")
    stable = dict(session.execute(select(StableVersion.stratum, StableVersion.bundle_id)
                                  .where(StableVersion.bundle_name == name)).all())
    incompatible = dict(session.execute(select(Incompatibility.stratum, Incompatibility.reason)
                                        .where(Incompatibility.bundle_id == bundle.id)).all())
    excluded: dict[str, str] = {}
    chosen: list[str] = []
    for s in sorted(eligible):
        if stable.get(s) == bundle.id:
            excluded[s] = "already the stable version"
        elif s in incompatible and not force:
            excluded[s] = f"marked incompatible: {incompatible[s]}"
        else:
            chosen.append(s)
    if not chosen:
        why = "; ".join(f"{s}: {w}" for s, w in excluded.items())
        raise Conflict(f"nothing to roll out for {bundle.ref}: every eligible stratum is excluded ({why})")
    for r in active:
        overlap = sorted({s.stratum for s in r.strata if s.state in ACTIVE_STATES} & set(chosen))
        if overlap:
            raise Conflict(f"rollout {r.id} of {r.bundle.ref} is still active on {', '.join(overlap)}: "
                           "finish, roll back or wait for it first")
    if clashes := op_clashes(session, bundle, chosen):  # a node serves each op from one active bundle
        raise Conflict(f"{bundle.ref} would be a second active bundle for the same ops: {'; '.join(clashes)}; "
                       "a node serves each op from one bundle: drop the ops from one of them")
    changes: dict[str, list[str]] = {}
    for bid in sorted({stable[s] for s in chosen if stable.get(s) is not None}):
        base = session.get(Bundle, bid)
        if base is not None and (diff := contract_changes(bundle.manifest or {}, base.manifest or {})):
            changes[base.ref] = diff
    if changes and not (accept_contract_change or "").strip():
        first_ref, first = next(iter(changes.items()))
        more = sum(len(v) for v in changes.values()) - 1
        raise ContractChange(
            f"{bundle.ref} changes the numeric contract of {first_ref}: {first[0]}"
            f"{f' (and {more} more)' if more else ''}; start it with accept_contract_change (a reason) to accept")
    rollout = Rollout(bundle=bundle, state=PENDING, step_index=0, plan=plan.model_dump(mode="json"),
                      created_by=actor, created_at=now, updated_at=now, reason=reason, forced=force)
    rollout.steps = [
        RolloutStep(index=i, nodes=st.nodes, percent=st.percent, bake_seconds=st.bake_seconds,
                    min_samples=st.min_samples, deadline_seconds=st.deadline_seconds)
        for i, st in enumerate(plan.steps)
    ]
    rollout.strata = [
        RolloutStratum(stratum=s, baseline_bundle_id=stable.get(s), state=PENDING, step_index=0,
                       step_started_at=now)
        for s in chosen
    ]
    session.add(rollout)
    flush(session, f"bundle {bundle.ref}")
    _strata_changed(session, rollout, rollout.strata)
    _event(session, rollout, "rollout.started", actor=actor, reason=reason, payload={
        "strata": {s: {"eligible": len(eligible[s]), "baseline": _ref_of(session, stable.get(s))} for s in chosen},
        "excluded": excluded, "forced": force, "plan": rollout.plan,
        **({"contract_change": {"accepted": accept_contract_change, "changes": changes}} if changes else {})})
    return rollout


def _ref_of(session: Session, bundle_id: int | None) -> str | None:
    if bundle_id is None:
        return None
    b = session.get(Bundle, bundle_id)
    return b.ref if b else None


# ------------------------------------------------------------------------------- step-level transitions
def begin(session: Session, rollout: Rollout, *, actor: str, now: dt.datetime, reason: str | None = None
          ) -> dict[str, assignments.StepAssignment]:
    """pending -> progressing at step 0: pick and switch the first canaries."""
    if rollout.state != PENDING:
        raise Conflict(f"rollout {rollout.id} is {rollout.state}, not pending")
    rows = [s for s in rollout.strata if s.state == PENDING]
    for s in rows:
        s.state, s.step_index, s.step_started_at = PROGRESSING, 0, now
    _strata_changed(session, rollout, rows)
    sized = assignments.assign_step(session, rollout, rows, load_plan(rollout.plan), now=now)
    _sync_summary(rollout)
    _touch(rollout, now)
    _event(session, rollout, "rollout.progressing", actor=actor, reason=reason,
           payload={"step": 0, "strata": {k: v.as_evidence() for k, v in sized.items()}})
    return sized


def advance_stratum(session: Session, rollout: Rollout, row: RolloutStratum, *, actor: str, now: dt.datetime,
                    reason: str | None = None) -> tuple[str, assignments.StepAssignment | None]:
    """Move one stratum to its next step, or promote it after the last; returns ("advance"|"promote", sizing)."""
    plan = load_plan(rollout.plan)
    if row.step_index + 1 >= len(plan.steps):
        promote_stratum(session, rollout, row, actor=actor, now=now, reason=reason)
        return "promote", None
    row.step_index += 1
    row.state, row.step_started_at = PROGRESSING, now
    _strata_changed(session, rollout, [row])
    sized = assignments.assign_step(session, rollout, [row], plan, now=now)[row.stratum]
    _sync_summary(rollout)
    _touch(rollout, now)
    _event(session, rollout, "rollout.advanced", actor=actor, reason=reason,
           payload={"stratum": row.stratum, "step": row.step_index, "sizing": sized.as_evidence()})
    return "advance", sized


def promote_stratum(session: Session, rollout: Rollout, row: RolloutStratum, *, actor: str, now: dt.datetime,
                    reason: str | None = None) -> None:
    """The candidate becomes the stable version of this stratum."""
    before = rollout.state
    row.state, row.reason = PROMOTED, reason
    _strata_changed(session, rollout, [row])
    nodes = assignments.make_stable(session, rollout, row.stratum, now=now)
    _sync_summary(rollout)
    _event(session, rollout, "rollout.stratum_promoted", actor=actor, reason=reason,
           payload={"stratum": row.stratum, "step": row.step_index, "nodes": nodes})
    _finish_if_done(session, rollout, before=before, actor=actor, now=now, reason=reason)


def rollback_strata(session: Session, rollout: Rollout, rows: list[RolloutStratum], *, actor: str, reason: str,
                    now: dt.datetime, mark_incompatible: bool, evidence: dict[str, Any] | None = None) -> int:
    """Switch the canaries of ``rows`` back to stable now; optionally mark the version incompatible there."""
    if not rows:
        return 0
    names = {r.stratum for r in rows}
    before = rollout.state
    for r in rows:
        r.state, r.reason = ROLLED_BACK, reason
    _strata_changed(session, rollout, rows)
    everything = all(s.state in TERMINAL_STATES for s in rollout.strata) and not any(
        s.state == PROMOTED for s in rollout.strata)
    reverted = assignments.revert_to_stable(session, rollout.id, None if everything else names, now=now)
    if mark_incompatible:
        existing = set(session.scalars(select(Incompatibility.stratum).where(
            Incompatibility.bundle_id == rollout.bundle_id, Incompatibility.stratum.in_(names))))
        for s in sorted(names - existing):
            session.add(Incompatibility(bundle_id=rollout.bundle_id, stratum=s, reason=reason, at=now))
            record_event(session, actor=actor, action="bundle.incompatible", subject=f"bundle:{rollout.bundle.ref}",
                         reason=reason, payload={"stratum": s}, bundle=rollout.bundle.ref, rollout_id=rollout.id)
    _sync_summary(rollout)
    _event(session, rollout, "rollout.stratum_rolled_back", actor=actor, reason=reason,
           payload={"strata": sorted(names), "reverted_nodes": reverted, **(evidence or {})})
    _finish_if_done(session, rollout, before=before, actor=actor, now=now, reason=reason)
    return reverted


def pause_stratum(session: Session, rollout: Rollout, row: RolloutStratum, *, actor: str, reason: str,
                  now: dt.datetime) -> None:
    row.state, row.reason = PAUSED, reason
    _strata_changed(session, rollout, [row])
    before = rollout.state
    _sync_summary(rollout)
    _touch(rollout, now)
    action = "rollout.paused" if rollout.state == PAUSED and before != PAUSED else "rollout.stratum_paused"
    _event(session, rollout, action, actor=actor, reason=reason, payload={"stratum": row.stratum,
                                                                           "step": row.step_index})


def _finish_if_done(session: Session, rollout: Rollout, *, before: str, actor: str, now: dt.datetime,
                    reason: str | None) -> None:
    """Write the rollout's terminal event once its last live stratum ended: ``rollout.promoted``,
    ``rollout.partly_promoted`` (with the strata of each outcome and their reasons) or ``rollout.rolled_back``
    (which revokes the version); ``before`` is the rollout's state before the calling transition, so only the
    transition that ends it writes the event."""
    _sync_summary(rollout)
    _touch(rollout, now)
    if rollout.state == before or rollout.state not in TERMINAL_STATES:
        return
    if rollout.state in (PROMOTED, PARTLY_PROMOTED):
        by = outcomes(rollout)
        _event(session, rollout, f"rollout.{rollout.state}", actor=actor, reason=reason, payload={
            "promoted": by.get(PROMOTED, []), "rolled_back": by.get(ROLLED_BACK, []),
            "reasons": {s.stratum: s.reason for s in rollout.strata if s.reason}})
        return
    _event(session, rollout, "rollout.rolled_back", actor=actor, reason=reason,
           payload={"strata": [s.stratum for s in rollout.strata]})
    revoke_bundle(session, rollout.bundle, actor=actor, reason=reason or f"rollout {rollout.id} rolled back",
                  rollout_id=rollout.id)


def revoke_bundle(session: Session, bundle: Bundle, *, actor: str, reason: str, rollout_id: int | None = None) -> bool:
    """Mark a version revoked so nothing re-rolls it unless forced; False when it already was."""
    if bundle.status == "revoked":
        return False
    bundle.status, bundle.status_reason = "revoked", reason
    record_event(session, actor=actor, action="bundle.revoked", subject=f"bundle:{bundle.ref}", reason=reason,
                 bundle=bundle.ref, rollout_id=rollout_id)
    return True


# ----------------------------------------------------------------------------------- operator actions
def _live_rows(rollout: Rollout) -> list[RolloutStratum]:
    return [s for s in rollout.strata if s.state in ACTIVE_STATES]


def position(rollout: Rollout) -> int:
    """The step a promote moves a rollout *from*: its step index, -1 while it is pending (not started)."""
    return -1 if rollout.state == PENDING else rollout.step_index


def where(step_index: int) -> str:
    """A :func:`position` as people read it: ``pending`` (-1) or ``at step N`` (N from 1)."""
    return "pending (not started)" if step_index < 0 else f"at step {step_number(step_index)}"


ROLLBACK_INTENT_SECONDS = 60.0  # an intent older than this (its replica crashed mid-rollback) no longer blocks


def request_rollback(session: Session, rollout_id: int, *, now: dt.datetime | None = None) -> int:
    """Record that a rollback of ``rollout_id`` is in flight (commit it before the rollback itself): every
    replica's promote of that rollout is refused until :func:`end_rollback` (a rollback wins over a promote).
    Needs no lock on the rollout, so it lands while a racing promote holds it. Returns the intent's id."""
    if session.get(Rollout, rollout_id) is None:
        raise NotFound(f"rollout {rollout_id} not found")
    intent = RollbackIntent(rollout_id=rollout_id, at=now or utcnow())
    session.add(intent)
    session.flush()
    return intent.id


def end_rollback(session: Session, intent_id: int) -> None:
    """The rollback of :func:`request_rollback` is over (committed or refused)."""
    session.execute(delete(RollbackIntent).where(RollbackIntent.id == intent_id))


def rollback_pending(session: Session, rollout_id: int, *, now: dt.datetime | None = None) -> bool:
    """A rollback of ``rollout_id`` is in flight on some replica (see :class:`RollbackIntent`)."""
    since = (now or utcnow()) - dt.timedelta(seconds=ROLLBACK_INTENT_SECONDS)
    return session.scalar(select(RollbackIntent.id).where(RollbackIntent.rollout_id == rollout_id,
                                                          RollbackIntent.at > since).limit(1)) is not None


@guarded
def promote(
    session: Session,
    rollout_id: int,
    *,
    actor: str,
    full: bool = False,
    reason: str | None = None,
    to_step: int | None = None,
    from_step: int | None = None,
    now: dt.datetime | None = None,
) -> Rollout:
    """Advance every live stratum one step (``full``: make the candidate stable everywhere now).

    ``from_step`` is the step the caller promotes from (:func:`position`: -1 for a pending rollout); when the
    rollout is not there any more (a duplicate request, or another operator or the judge moved it) the promote
    is refused with Conflict and nothing changes, so a promote counts at most once. ``to_step`` makes a step
    promotion idempotent instead: strata already at or past it are left alone.
    """
    now = now or utcnow()
    rollout = get_rollout(session, rollout_id, lock=True)  # waits for any writer holding it, then looks
    if rollout.state == ROLLED_BACK:
        raise Conflict(f"rollout {rollout_id} is rolled back (terminal): it cannot be promoted; "
                       "start a new rollout (with force for a revoked version)")
    if rollback_pending(session, rollout_id, now=now):  # a rollback always wins over a racing promote
        raise Conflict(f"a rollback of rollout {rollout_id} is in progress: promote refused, nothing changed")
    ended = rollout.state in (PROMOTED, PARTLY_PROMOTED)
    if from_step is not None and (ended or position(rollout) != from_step):
        at = f"{rollout.state} (terminal)" if ended else where(position(rollout))
        raise Conflict(f"rollout {rollout_id} is {at}, not {where(from_step)}: it was already promoted from "
                       f"there or changed meanwhile; nothing was changed (check `kernelctl rollout "
                       f"status {rollout_id}`)")
    if ended:
        return rollout
    if rollout.state == PENDING:
        begin(session, rollout, actor=actor, now=now, reason=reason)
        if not full:
            flush(session, f"rollout {rollout_id}")
            return rollout
    rows = _live_rows(rollout)
    if full:
        for row in rows:
            promote_stratum(session, rollout, row, actor=actor, now=now, reason=reason)
    else:
        moved = False
        for row in rows:
            if to_step is not None and row.step_index >= to_step:
                continue
            advance_stratum(session, rollout, row, actor=actor, now=now, reason=reason)
            moved = True
        if not moved:
            return rollout
    flush(session, f"rollout {rollout_id}")
    return rollout


@guarded
def rollback(
    session: Session,
    rollout_id: int,
    *,
    actor: str,
    reason: str,
    strata: Iterable[str] | None = None,
    now: dt.datetime | None = None,
) -> Rollout:
    """Return canaries to stable at once: every live stratum, or the listed strata (marked incompatible there).

    Rolling back every stratum revokes the version. When a stratum was already promoted the version stays
    stable there: the rolled-back strata are marked incompatible instead and the rollout ends
    ``partly_promoted`` (never ``promoted``)."""
    now = now or utcnow()
    if not reason or not reason.strip():
        raise Invalid("a rollback needs a reason (it is recorded in the changelog)")
    rollout = get_rollout(session, rollout_id, lock=True)
    if rollout.state == PROMOTED:
        raise Conflict(f"rollout {rollout_id} is promoted (terminal): roll forward with a new rollout instead")
    # partly_promoted: nothing is live; a repeated rollback is a no-op and naming a promoted stratum a Conflict
    if rollout.state == ROLLED_BACK:
        return rollout
    by_name = {s.stratum: s for s in rollout.strata}
    if strata is None:
        rows = _live_rows(rollout)
        # strata already promoted keep the version stable there: it is not revoked, so mark it incompatible
        # where it is rolled back (compat shows rolled_back, and nothing re-rolls it there by accident)
        partly = any(s.state == PROMOTED for s in rollout.strata)
        rollback_strata(session, rollout, rows, actor=actor, reason=reason, now=now, mark_incompatible=partly)
    else:
        wanted = list(dict.fromkeys(strata))
        if not wanted:
            raise Invalid("strata is empty: name at least one stratum, or omit it to roll back everything")
        unknown = [s for s in wanted if s not in by_name]
        if unknown:
            raise Invalid(f"rollout {rollout_id} has no stratum {', '.join(unknown)} "
                          f"(it has {', '.join(sorted(by_name))})")
        done = [s for s in wanted if by_name[s].state == PROMOTED]
        if done:
            raise Conflict(f"stratum {', '.join(done)} of rollout {rollout_id} is already promoted")
        rows = [by_name[s] for s in wanted if by_name[s].state in ACTIVE_STATES]
        if not rows:
            return rollout
        rollback_strata(session, rollout, rows, actor=actor, reason=reason, now=now, mark_incompatible=True)
    flush(session, f"rollout {rollout_id}")
    return rollout


@guarded
def pause(session: Session, rollout_id: int, *, actor: str, reason: str | None = None,
          now: dt.datetime | None = None) -> Rollout:
    """progressing -> paused: canaries stay as they are, nothing widens or is judged for latency."""
    now = now or utcnow()
    rollout = get_rollout(session, rollout_id)
    if rollout.state == PAUSED:
        return rollout
    if rollout.state != PROGRESSING:
        raise Conflict(f"rollout {rollout_id} is {rollout.state}: only a progressing rollout can be paused")
    for s in rollout.strata:
        if s.state == PROGRESSING:
            s.state, s.reason = PAUSED, reason or "paused by operator"
    _strata_changed(session, rollout, rollout.strata)
    _sync_summary(rollout)
    _touch(rollout, now)
    _event(session, rollout, "rollout.paused", actor=actor, reason=reason)
    flush(session, f"rollout {rollout_id}")
    return rollout


@guarded
def resume(session: Session, rollout_id: int, *, actor: str, reason: str | None = None,
           now: dt.datetime | None = None) -> Rollout:
    """paused -> progressing; each resumed stratum starts a fresh evidence window (bake, samples, deadline)."""
    now = now or utcnow()
    rollout = get_rollout(session, rollout_id)
    if rollout.state == PROGRESSING:
        return rollout
    if rollout.state != PAUSED:
        raise Conflict(f"rollout {rollout_id} is {rollout.state}: only a paused rollout can be resumed")
    resumed = []
    for s in rollout.strata:
        if s.state == PAUSED:
            s.state, s.reason, s.step_started_at = PROGRESSING, None, now
            resumed.append(s.stratum)
    _strata_changed(session, rollout, rollout.strata)
    _sync_summary(rollout)
    _touch(rollout, now)
    _event(session, rollout, "rollout.resumed", actor=actor, reason=reason, payload={"strata": resumed})
    flush(session, f"rollout {rollout_id}")
    return rollout
