"""Audit queries over the changelog: events by bundle/node/actor/action/time, and what ran on a node at T.

Used by ``kernelctl audit`` (direct, read-only database access) and by ``GET /v1/audit``. Every query is
served by an index on ``events`` or ``activations`` (see controller.db.models). Events come a page at a time
(:func:`events_page`, at most ``controller.paging.PAGE_MAX``, newest first, with a cursor: a page is one
index range however deep it lies and however many events arrive meanwhile); :func:`query_events` follows the
cursors for direct readers. "What ran" is what served:
an activation opens when the node reports a version published to its serving processes (a candidate that
was only staged for its pre-serve trial never appears); a served candidate names its rollout and when the
controller accepted the node's pre-serve trial (``verified_at``; empty: the plan served it before its trial).
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass, replace
from typing import Any

from sqlalchemy import and_, or_, select
from sqlalchemy.orm import Session

from controller.db.models import Activation, Bundle, Event, Node, as_utc
from controller.paging import PAGE_MAX, PageError, after, check_limit, decode_cursor, encode_cursor
from kernelctl.vocab import shown_steps

AUDIT_MAX_LIMIT = 100_000  # events one direct query (kernelctl audit --limit) may follow pages for
CURSOR_KIND = "audit"


class AuditQueryError(ValueError):
    """A filter value the audit cannot use (unknown node, unparseable time, ...)."""


class AuditNotFound(AuditQueryError):
    """The query names a node or bundle the changelog does not know (the CLI's not-found exit code)."""


@dataclass(frozen=True)
class AuditFilters:
    bundle: str | None = None  # NAME or NAME@VERSION
    node: str | None = None
    actor: str | None = None
    action: str | None = None  # exact, or a prefix ending in '.' / '*' (e.g. "rollout.*")
    since: dt.datetime | None = None
    until: dt.datetime | None = None
    limit: int = 100


MAX_AGE_DAYS = 36_500  # a relative age reaches back at most 100 years
MAX_TIME_TEXT = 64
EARLIEST = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)
LATEST = dt.datetime(9000, 1, 1, tzinfo=dt.timezone.utc)
_AGE_RE = re.compile(r"^([0-9]{1,12})([smhd])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_time(value: str, *, now: dt.datetime | None = None) -> dt.datetime:
    """ISO 8601 (``2026-11-22T10:00:00Z``, a date) or relative (``15m``, ``2h``, ``3d`` ago); UTC if naive.

    Bounded before the date library sees it: ASCII digits only, ages up to 100 years, times between 1970 and
    9000 (UTC). Anything else raises :class:`AuditQueryError` (never OverflowError or a bare ValueError).
    """
    text = str(value).strip()
    if len(text) > MAX_TIME_TEXT:
        raise AuditQueryError(f"time value is over {MAX_TIME_TEXT} characters")
    m = _AGE_RE.match(text)
    if m:
        seconds = int(m.group(1)) * _UNITS[m.group(2)]
        if seconds > MAX_AGE_DAYS * 86400:
            raise AuditQueryError(f"age {text!r} is over the limit of {MAX_AGE_DAYS} days (100 years)")
        return (now or dt.datetime.now(dt.timezone.utc)) - dt.timedelta(seconds=seconds)
    try:
        parsed = dt.datetime.fromisoformat(text.replace("Z", "+00:00")) if text.isascii() else None
        if parsed is not None:
            parsed = parsed.replace(tzinfo=dt.timezone.utc) if parsed.tzinfo is None else parsed.astimezone(
                dt.timezone.utc)
    except (ValueError, OverflowError):
        parsed = None
    if parsed is None:
        raise AuditQueryError(
            f"cannot parse time {value!r}: use ISO 8601 (2026-11-22T10:00:00Z) or a relative age (15m, 2h, 3d)"
        )
    if not EARLIEST <= parsed < LATEST:
        raise AuditQueryError(f"time {value!r} is outside {EARLIEST.year}-{LATEST.year} (UTC)")
    return parsed


def query_events(session: Session, filters: AuditFilters) -> list[Event]:
    """Events matching every given filter, newest first, at most ``filters.limit`` (up to
    ``AUDIT_MAX_LIMIT``), read page by page."""
    if not 1 <= filters.limit <= AUDIT_MAX_LIMIT:
        raise AuditQueryError(f"limit must be between 1 and {AUDIT_MAX_LIMIT}, got {filters.limit}")
    out: list[Event] = []
    cursor: str | None = None
    while len(out) < filters.limit:
        page, cursor = events_page(session, replace(filters, limit=min(PAGE_MAX, filters.limit - len(out))),
                                   cursor)
        out.extend(page)
        if cursor is None:
            break
    return out


def events_page(session: Session, filters: AuditFilters, cursor: str | None = None
                ) -> tuple[list[Event], str | None]:
    """One page: at most ``filters.limit`` (1..PAGE_MAX) events matching every filter after ``cursor`` (from
    the previous page), newest first, and the cursor of the next page (None: this is the last)."""
    try:
        check_limit(filters.limit)
        key = decode_cursor(CURSOR_KIND, cursor, dt.datetime, int) if cursor is not None else None
    except PageError as exc:
        raise AuditQueryError(str(exc)) from None
    stmt = select(Event)
    if filters.bundle:
        if "@" in filters.bundle:
            stmt = stmt.where(Event.bundle == filters.bundle)
        else:
            # NAME alone: every version; the (bundle, at) index serves the prefix range.
            stmt = stmt.where(Event.bundle >= f"{filters.bundle}@", Event.bundle < f"{filters.bundle}A")
    if filters.node:
        _require_node(session, filters.node)
        stmt = stmt.where(Event.node == filters.node)
    if filters.actor:
        stmt = stmt.where(Event.actor == filters.actor)
    if filters.action:
        action = filters.action.rstrip("*")
        if action.endswith("."):
            stmt = stmt.where(Event.action >= action, Event.action < action[:-1] + "/")
        else:
            stmt = stmt.where(Event.action == action)
    if filters.since:
        stmt = stmt.where(Event.at >= as_utc(filters.since))
    if filters.until:
        stmt = stmt.where(Event.at <= as_utc(filters.until))
    if key is not None:
        stmt = stmt.where(after((Event.at, Event.id), key, descending=True))
    stmt = stmt.order_by(Event.at.desc(), Event.id.desc()).limit(filters.limit + 1)
    rows = list(session.scalars(stmt))
    if len(rows) <= filters.limit:
        return rows, None
    last = rows[filters.limit - 1]
    return rows[:filters.limit], encode_cursor(CURSOR_KIND, as_utc(last.at), last.id)


def _require_node(session: Session, name: str) -> Node:
    node = session.scalar(select(Node).where(Node.name == name))
    if node is None:
        raise AuditNotFound(f"unknown node {name!r}")
    return node


def active_at(session: Session, node_name: str, at: dt.datetime) -> list[dict[str, Any]]:
    """Which bundle versions served on ``node_name`` at time ``at`` (one row per bundle name)."""
    node = _require_node(session, node_name)
    at = as_utc(at)
    stmt = (
        select(Activation, Bundle)
        .join(Bundle, Bundle.id == Activation.bundle_id)
        .where(
            Activation.node_id == node.id,
            Activation.started_at <= at,
            or_(Activation.ended_at.is_(None), Activation.ended_at > at),
        )
        .order_by(Activation.bundle_name)
    )
    return [
        {
            "node": node_name,
            "bundle": bundle.name,
            "version": bundle.version,
            "digest": bundle.digest,
            "active_since": act.started_at,
            "active_until": act.ended_at,
            "rollout_id": act.rollout_id,  # set when it served as a canary's candidate
            "verified_at": act.verified_at,  # when that node's pre-serve trial was accepted
        }
        for act, bundle in session.execute(stmt)
    ]


def nodes_that_ran(session: Session, bundle_ref: str) -> list[dict[str, Any]]:
    """Every node that ever served ``NAME@VERSION``: one row per activation (staged-only nodes are absent)."""
    name, _, version = bundle_ref.partition("@")
    if not version:
        raise AuditQueryError(f"expected NAME@VERSION, got {bundle_ref!r}")
    bundle = session.scalar(select(Bundle).where(and_(Bundle.name == name, Bundle.version == version)))
    if bundle is None:
        raise AuditNotFound(f"unknown bundle {bundle_ref!r}")
    stmt = (
        select(Node.name, Activation.started_at, Activation.ended_at, Activation.rollout_id, Activation.verified_at)
        .join(Node, Node.id == Activation.node_id)
        .where(Activation.bundle_id == bundle.id)
        .order_by(Node.name, Activation.started_at)
    )
    return [{"node": n, "started_at": s, "ended_at": e, "rollout_id": r, "verified_at": v}
            for n, s, e, r, v in session.execute(stmt)]


def event_to_dict(event: Event) -> dict[str, Any]:
    return {
        "id": event.id,
        "at": as_utc(event.at).isoformat() if event.at else None,  # type: ignore[union-attr]
        "actor": event.actor,
        "action": event.action,
        "subject": event.subject,
        "bundle": event.bundle,
        "node": event.node,
        "rollout_id": event.rollout_id,
        "reason": event.reason,
        "payload": shown_steps(event.payload),  # a stored 0-based "step" is shown from 1
    }
