"""Version switches reported by many heartbeats, recorded in one transaction, set-based: the heartbeat rule's
batch writer.

A heartbeat whose only news is that the node now runs another version (it applied a rollback, a promotion or
a verified candidate) changes the node's assignment (``active_bundle_id``, and the canary phase that follows
from it), closes and opens ``activations`` rows and writes the ``assignment.activated`` / ``deactivated``
events (and ``security.unverified_serve`` for a refused claim): what
:func:`controller.desired.effects.heartbeat_effects` says, as the single-row writer
(``assignments.advance_phases``) applies it, but for a whole batch of nodes in a handful of statements
(``controller.group_commit``). The rows are read ``FOR NO KEY UPDATE`` and the rule applied to them, so a batch is
correct whatever the replica's snapshot believed; a node whose rows or state differ from what the snapshot
promised (stale, a new assignment, an inventory) gets :data:`FULL` and takes the one-transaction path instead.
The rows a batch changed are declared (``controller.desired.generation.changed``): replicas patch them in.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass

from sqlalchemy import bindparam, insert, select, text, update
from sqlalchemy.orm import Session

from controller.assignments import trial_first
from controller.changelog import event_row
from controller.db.models import Activation, Assignment, Bundle, Event, Node
from controller.desired.effects import (
    UNVERIFIED_SERVE,
    AssignmentView,
    RowEffect,
    RowFacts,
    heartbeat_effects,
)
from controller.desired.generation import PatchRow, changed

log = logging.getLogger(__name__)


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
    rows: dict[int, dict[str, RowFacts]] = {}
    stored = session.execute(select(Assignment.node_id, Assignment.bundle_name, Assignment.active_bundle_id,
                                    Assignment.desired_bundle_id, Assignment.stable_bundle_id,
                                    Assignment.rollout_id, Assignment.phase, Assignment.phase_at)
                             .where(Assignment.node_id.in_(ids)).order_by(Assignment.node_id, Assignment.bundle_name)
                             .with_for_update(key_share=True)).all()
    plans = trial_first(session, {r[5] for r in stored if r[5] is not None})
    for nid, name, active, desired, stable, rid, phase, phase_at in stored:
        rows.setdefault(nid, {})[name] = RowFacts(name, active, desired, stable, rid, phase, phase_at,
                                                  plans.get(rid, True) if rid is not None else True)
    out: list[Switched | object] = []
    writes: list[tuple[Switch, str, RowEffect]] = []
    patch: dict[int, dict[str, PatchRow]] = {}
    seen: set[int] = set()
    for it in items:
        mine = rows.get(it.node_id, {})
        if it.node_id not in active_nodes or it.node_id in seen or not set(it.active) <= set(mine):
            out.append(FULL)
            continue
        seen.add(it.node_id)  # a node twice in one batch: the second takes the full path
        effects = heartbeat_effects(mine, it.active, it.at)
        result: dict[str, tuple[AssignmentView, int | None]] = {}
        for name, e in effects.rows.items():
            r = e.row
            view = r.view
            result[name] = (view, r.active_id)
            if e.changed or e.refused:
                writes.append((it, name, e))
            if e.changed:
                patch.setdefault(it.node_id, {})[name] = PatchRow(view, r.active_id)
        out.append(Switched(result, effects.changed))
    _write(session, writes)
    if patch:
        changed(session, rows=patch)
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


def _write(session: Session, writes: list[tuple[Switch, str, RowEffect]]) -> None:
    """The batch's effects in one statement per table (PostgreSQL ``unnest``) or one executemany each."""
    if not writes:
        return
    assign_updates = [{"nid": it.node_id, "bname": name, "active": e.row.active_id, "phase": e.row.phase,
                       "phase_at": e.row.phase_at, "at": it.at} for it, name, e in writes if e.changed]
    closes = [{"nid": it.node_id, "bname": name, "at": it.at} for it, name, e in writes if e.switched]
    opens = [{"node_id": it.node_id, "bundle_id": e.row.active_id, "bundle_name": name, "started_at": it.at,
              "rollout_id": e.tag[0] if e.tag else None, "verified_at": e.tag[1] if e.tag else None}
             for it, name, e in writes if e.switched and e.row.active_id is not None]
    tags = [{"nid": it.node_id, "bname": name, "bid": e.row.active_id, "rid": e.tag[0], "vat": e.tag[1]}
            for it, name, e in writes if e.tag is not None and not e.switched]
    conn = session.connection()
    b = bindparam
    if assign_updates:
        if conn.dialect.name == "postgresql":  # one statement per table for the whole batch
            conn.execute(PG_ASSIGNMENTS, _columns(assign_updates, ("nid", "bname", "active", "phase", "phase_at",
                                                                   "at")))
            if closes:
                conn.execute(PG_CLOSE, _columns(closes, ("nid", "bname", "at")))
        else:
            conn.execute(update(Assignment).where(Assignment.node_id == b("nid"),
                                                  Assignment.bundle_name == b("bname"))
                         .values(active_bundle_id=b("active"), phase=b("phase"), phase_at=b("phase_at"),
                                 updated_at=b("at")), assign_updates)
            if closes:
                conn.execute(update(Activation).where(Activation.node_id == b("nid"),
                                                      Activation.bundle_name == b("bname"),
                                                      Activation.ended_at.is_(None)).values(ended_at=b("at")), closes)
    if opens:
        conn.execute(insert(Activation), opens)
    if tags:
        conn.execute(update(Activation).where(Activation.node_id == b("nid"), Activation.bundle_name == b("bname"),
                                              Activation.bundle_id == b("bid"), Activation.ended_at.is_(None))
                     .values(rollout_id=b("rid"), verified_at=b("vat")), tags)
    bids = {x for _it, _n, e in writes for x in (e.previous_id, e.row.active_id) if x is not None}
    refs = {bid: f"{name}@{version}" for bid, name, version in session.execute(
        select(Bundle.id, Bundle.name, Bundle.version).where(Bundle.id.in_(bids)))} if bids else {}
    events = []
    for it, _name, e in writes:
        actor = f"node:{it.node_name}"
        if e.refused:
            log.warning("security: %s: %s", actor, e.refused)
            events.append(event_row(at=it.at, actor=actor, subject=actor, node=it.node_name, action=UNVERIFIED_SERVE,
                                    bundle=refs.get(e.row.active_id), rollout_id=e.row.rollout_id, reason=e.refused))
        if e.switched:
            activated = e.row.active_id is not None
            prev_ref = refs.get(e.previous_id) if e.previous_id is not None else None
            events.append(event_row(
                at=it.at, actor=actor, subject=actor, node=it.node_name,
                action="assignment.activated" if activated else "assignment.deactivated",
                payload={"previous": prev_ref} if activated else {},
                bundle=refs.get(e.row.active_id) if activated else prev_ref))
    if events:
        conn.execute(insert(Event), events)
