"""Version switches reported by many heartbeats, recorded in one transaction, set-based.

A heartbeat whose only news is that the node now runs another version (it applied a rollback, a promotion or
a verified candidate) changes the node's assignment (``active_bundle_id``, and the canary phase that follows
from it: ``controller.assignments.advance_phases``), closes and opens ``activations`` rows and writes the
``assignment.activated`` / ``deactivated`` events: exactly what ``registry.heartbeat`` writes for it, but
for a whole batch of nodes in a handful of statements (``controller.group_commit``). The rows are read
``FOR UPDATE`` and compared with what each node reports, so a batch is correct whatever the replica's
snapshot believed; a node whose rows or state differ from what the snapshot promised (stale, a new
assignment, an inventory) gets :data:`FULL` and takes the one-transaction path instead.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from sqlalchemy import bindparam, insert, select, text, update
from sqlalchemy.orm import Session

from controller.assignments import AssignmentView
from controller.changelog import event_row
from controller.db.models import Activation, Assignment, Bundle, Event, Node
from controller.desired_cache import mark_desired_changed


@dataclass(frozen=True)
class Switch:
    """One heartbeat's reported active versions: bundle name -> bundle id (None: nothing active)."""

    node_id: int
    node_name: str
    active: dict[str, int | None]
    at: dt.datetime


@dataclass(frozen=True)
class Switched:
    """The node's assignment rows after the write: bundle name -> (view, active bundle id)."""

    rows: dict[str, tuple[AssignmentView, int | None]]
    changed: bool


FULL = object()  # this heartbeat needs the full transaction (registry.heartbeat)


def record_switches(session: Session, items: list[Switch]) -> list[Switched | object]:
    """Record every item's reported versions (see the module docstring); one result per item, in order."""
    ids = sorted({it.node_id for it in items})
    active_nodes = set(session.scalars(select(Node.id).where(Node.id.in_(ids), Node.state == "active")))
    rows: dict[int, dict[str, dict[str, object]]] = {}
    for a in session.execute(select(Assignment.node_id, Assignment.bundle_name, Assignment.active_bundle_id,
                                    Assignment.desired_bundle_id, Assignment.stable_bundle_id,
                                    Assignment.rollout_id, Assignment.phase, Assignment.phase_at,
                                    Assignment.updated_at)
                             .where(Assignment.node_id.in_(ids)).order_by(Assignment.node_id, Assignment.bundle_name)
                             .with_for_update()).mappings():
        rows.setdefault(a["node_id"], {})[a["bundle_name"]] = dict(a)
    out: list[Switched | object] = []
    assign_updates: list[dict[str, object]] = []
    closes: list[dict[str, object]] = []
    opens: list[dict[str, object]] = []
    tags: list[dict[str, object]] = []
    events: list[tuple[Switch, str, int | None, int | None]] = []  # item, bundle name, previous, new
    seen: set[int] = set()
    for it in items:
        mine = rows.get(it.node_id, {})
        if it.node_id not in active_nodes or it.node_id in seen or not set(it.active) <= set(mine):
            out.append(FULL)
            continue
        seen.add(it.node_id)  # a node twice in one batch: the second takes the full path
        changed = False
        result: dict[str, tuple[AssignmentView, int | None]] = {}
        for name, a in mine.items():
            new_id = it.active.get(name)
            previous = a["active_bundle_id"]
            phase, phase_at = a["phase"], a["phase_at"]
            switched = previous != new_id
            if switched:
                closes.append({"nid": it.node_id, "bname": name, "at": it.at})
                if new_id is not None:
                    opens.append({"node_id": it.node_id, "bundle_id": new_id, "bundle_name": name,
                                  "started_at": it.at, "rollout_id": None, "verified_at": None})
                events.append((it, name, previous, new_id))  # type: ignore[arg-type]
            desired, stable, rid = a["desired_bundle_id"], a["stable_bundle_id"], a["rollout_id"]
            if rid is not None and desired is not None and desired != stable:  # advance_phases
                runs = new_id == desired
                if runs and phase != "serving":
                    verified_at = phase_at if phase == "verified" else None
                    if switched:
                        opens[-1].update(rollout_id=rid, verified_at=verified_at)
                    else:
                        tags.append({"nid": it.node_id, "bname": name, "bid": desired, "rid": rid,
                                     "vat": verified_at})
                    phase, phase_at = "serving", it.at
                elif not runs and phase == "serving":
                    phase, phase_at = "verified", it.at
            if switched or phase != a["phase"]:
                changed = True
                assign_updates.append({"nid": it.node_id, "bname": name, "active": new_id, "phase": phase,
                                       "phase_at": phase_at, "at": it.at if switched else a["updated_at"]})
            result[name] = (AssignmentView(name, desired, stable, rid, phase), new_id)  # type: ignore[arg-type]
        out.append(Switched(result, changed))
    _write(session, assign_updates, closes, opens, tags, events)
    return out


PG_ASSIGNMENTS = text(
    "UPDATE assignments AS a SET active_bundle_id = v.active, phase = v.phase, phase_at = v.phase_at, "
    "updated_at = v.at FROM unnest(CAST(:nid AS bigint[]), CAST(:bname AS text[]), CAST(:active AS bigint[]), "
    "CAST(:phase AS text[]), CAST(:phase_at AS timestamptz[]), CAST(:at AS timestamptz[])) "
    "AS v(nid, bname, active, phase, phase_at, at) WHERE a.node_id = v.nid AND a.bundle_name = v.bname")
PG_CLOSE = text(
    "UPDATE activations AS x SET ended_at = v.at FROM unnest(CAST(:nid AS bigint[]), CAST(:bname AS text[]), "
    "CAST(:at AS timestamptz[])) AS v(nid, bname, at) "
    "WHERE x.node_id = v.nid AND x.bundle_name = v.bname AND x.ended_at IS NULL")


def _columns(rows: list[dict[str, object]], names: tuple[str, ...]) -> dict[str, list[object]]:
    """Rows as one array per column (PostgreSQL ``unnest`` parameters)."""
    return {n: [r[n] for r in rows] for n in names}


def _write(session: Session, assign_updates: list[dict[str, object]], closes: list[dict[str, object]],
           opens: list[dict[str, object]], tags: list[dict[str, object]],
           events: list[tuple[Switch, str, int | None, int | None]]) -> None:
    if not assign_updates:
        return
    conn = session.connection()
    b = bindparam
    if conn.dialect.name == "postgresql":  # one statement per table for the whole batch
        conn.execute(PG_ASSIGNMENTS, _columns(assign_updates, ("nid", "bname", "active", "phase", "phase_at", "at")))
        if closes:
            conn.execute(PG_CLOSE, _columns(closes, ("nid", "bname", "at")))
    else:
        conn.execute(update(Assignment).where(Assignment.node_id == b("nid"), Assignment.bundle_name == b("bname"))
                     .values(active_bundle_id=b("active"), phase=b("phase"), phase_at=b("phase_at"),
                             updated_at=b("at")), assign_updates)
        if closes:
            conn.execute(update(Activation).where(Activation.node_id == b("nid"), Activation.bundle_name == b("bname"),
                                                  Activation.ended_at.is_(None)).values(ended_at=b("at")), closes)
    if opens:
        conn.execute(insert(Activation), opens)
    if tags:
        conn.execute(update(Activation).where(Activation.node_id == b("nid"), Activation.bundle_name == b("bname"),
                                              Activation.bundle_id == b("bid"), Activation.ended_at.is_(None))
                     .values(rollout_id=b("rid"), verified_at=b("vat")), tags)
    if events:
        bids = {x for _it, _n, p, q in events for x in (p, q) if x is not None}
        refs = {bid: f"{name}@{version}" for bid, name, version in session.execute(
            select(Bundle.id, Bundle.name, Bundle.version).where(Bundle.id.in_(bids)))}
        rows = []
        for it, _name, previous, new in events:
            prev_ref = refs.get(previous) if previous is not None else None
            activated = new is not None
            rows.append(event_row(
                at=it.at, actor=f"node:{it.node_name}", subject=f"node:{it.node_name}", node=it.node_name,
                action="assignment.activated" if activated else "assignment.deactivated",
                payload={"previous": prev_ref} if activated else {}, bundle=refs.get(new) if activated else prev_ref))
        conn.execute(insert(Event), rows)
    mark_desired_changed(session)
