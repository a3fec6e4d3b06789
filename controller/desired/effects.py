"""What one heartbeat changes: the heartbeat rule, written once (``heartbeat_effects``).

Given a node's assignment rows as stored and the versions the node reports active, :func:`heartbeat_effects`
says what the heartbeat writes: each row's new active version and canary phase, the activation history
(closed and opened rows, the rollout and verification tags of a candidate that starts serving) and the
security refusals. It is pure (no database): the single-row writer (``controller.assignments.advance_phases``
through ``registry.heartbeat``), the batch writer (``controller.switches``) and the replica's fast path
(``controller.desired.snapshot.Snapshot.fast_path``: "the effects are liveness only") all apply it, so the
differential tests compare one rule with its applications.

Trial before serve is a controller fact, not a node's claim: a canary's phase becomes ``verified`` only from an
accepted passing report (``assignments.mark_verified``), and ``serving`` only from ``verified`` (or at once
where the plan says ``serve_before_trial``). A node that reports an unverified candidate active is refused:
its phase stays, the reported version is recorded as what it runs, and a ``security.unverified_serve`` event
is written once, when it switches to it.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, replace

SERVING, VERIFIED, STAGED = "serving", "verified", "staged"
UNVERIFIED_SERVE = "security.unverified_serve"


@dataclass(frozen=True)
class AssignmentView:
    """What the desired state of one bundle on a node depends on (a row of ``assignments``)."""

    bundle_name: str
    desired_id: int | None
    stable_id: int | None
    rollout_id: int | None
    phase: str | None


@dataclass(frozen=True)
class RowFacts:
    """One assignment row as stored (what the rule reads)."""

    bundle_name: str
    active_id: int | None
    desired_id: int | None
    stable_id: int | None
    rollout_id: int | None
    phase: str | None
    phase_at: dt.datetime | None = None
    trial_first: bool = True  # the rollout's plan needs a verified trial before the candidate serves

    @property
    def candidate(self) -> bool:
        return self.rollout_id is not None and self.desired_id is not None and self.desired_id != self.stable_id

    @property
    def view(self) -> AssignmentView:
        """What desired state depends on in this row (what a writer declares, what replicas patch in)."""
        return AssignmentView(self.bundle_name, self.desired_id, self.stable_id, self.rollout_id, self.phase)


@dataclass(frozen=True)
class RowEffect:
    """The row after the heartbeat and what else the write does for it."""

    row: RowFacts  # the row as it will be stored
    switched: bool  # the reported active version differs from the stored one (activation closed/opened)
    previous_id: int | None
    before_phase: str | None
    tag: tuple[int, dt.datetime | None] | None = None  # (rollout id, verified_at): the candidate starts serving
    refused: str | None = None  # why the node's claim was refused (a security event)

    @property
    def changed(self) -> bool:
        return self.switched or self.row.phase != self.before_phase


@dataclass(frozen=True)
class Effects:
    rows: dict[str, RowEffect]

    @property
    def liveness_only(self) -> bool:
        """Nothing but liveness to write: the fast path may answer it from the snapshot."""
        return not any(e.changed or e.refused for e in self.rows.values())

    @property
    def changed(self) -> bool:
        return any(e.changed for e in self.rows.values())

    @property
    def desired_unchanged(self) -> bool:
        """No phase moves: only active versions and their history are written, and the node's desired state (its
        rows' :class:`AssignmentView`, which hold no active version) is the same after the write as before. The
        reply to such a heartbeat does not depend on its write (the hub holds a watch while it commits)."""
        return all(e.row.phase == e.before_phase for e in self.rows.values())


def heartbeat_effects(rows: dict[str, RowFacts], reported: dict[str, int | None], now: dt.datetime) -> Effects:
    """Apply what the node reports (bundle name -> active bundle id, None or absent: nothing active) to its
    stored rows (bundle name -> row). Names the node reports without a row are the caller's business (the
    single-row writer creates the row first; the batch writer and the fast path send such a node the full
    way)."""
    out: dict[str, RowEffect] = {}
    for name, a in rows.items():
        new_id = reported.get(name)
        switched = new_id != a.active_id
        phase, phase_at = a.phase, a.phase_at
        tag: tuple[int, dt.datetime | None] | None = None
        refused = None
        if a.candidate:
            runs = new_id == a.desired_id
            if runs and phase != SERVING:
                if phase == VERIFIED or not a.trial_first:
                    tag = (a.rollout_id, phase_at if phase == VERIFIED else None)  # type: ignore[assignment]
                    phase, phase_at = SERVING, now
                elif switched:  # staged (or no phase) with no accepted passing report: the claim is refused
                    refused = (f"node reports candidate {name} (bundle id {new_id}) active before its trial was "
                               f"verified (phase {phase or 'none'}): refused, the phase stays {phase or 'none'}")
            elif not runs and phase == SERVING:
                phase, phase_at = VERIFIED, now  # a restart that lost its state: it may serve it again
        out[name] = RowEffect(replace(a, active_id=new_id, phase=phase, phase_at=phase_at), switched, a.active_id,
                              a.phase, tag, refused)
    return Effects(out)
