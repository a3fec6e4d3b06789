"""Writing the append-only event log: every state change records one event in the same transaction."""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy.orm import Session

from controller.db.models import Event, utcnow


def record_event(
    session: Session,
    *,
    actor: str,
    action: str,
    subject: str,
    reason: str | None = None,
    payload: dict[str, Any] | None = None,
    bundle: str | None = None,
    node: str | None = None,
    rollout_id: int | None = None,
) -> Event:
    """Add an event to the session (it commits with the caller's transaction, or not at all).

    ``action`` is dotted (``bundle.registered``, ``rollout.started``, ``rollout.promoted``,
    ``rollout.rolled_back``, ``node.registered``, ``assignment.activated`` ...); ``bundle`` is
    ``name@version`` and ``node`` the node name, both indexed for the audit queries.
    """
    event = Event(
        at=utcnow(),
        actor=actor,
        action=action,
        subject=subject,
        reason=reason,
        payload=payload or {},
        bundle=bundle,
        node=node,
        rollout_id=rollout_id,
    )
    session.add(event)
    return event


def event_row(*, at: dt.datetime, actor: str, action: str, subject: str, reason: str | None = None,
              payload: dict[str, Any] | None = None, bundle: str | None = None, node: str | None = None,
              rollout_id: int | None = None) -> dict[str, Any]:
    """One event as a row for a bulk ``insert(Event)`` (set-based writers: the same fields as
    :func:`record_event`)."""
    return {"at": at, "actor": actor, "action": action, "subject": subject, "reason": reason,
            "payload": payload or {}, "bundle": bundle, "node": node, "rollout_id": rollout_id}
