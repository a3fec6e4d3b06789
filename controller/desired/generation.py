"""The desired-state generation: one counter, bumped by the commits that declare a change of desired state.

Which writes change desired state is said at the write: the writer calls :func:`changed` in its transaction
(assignments, canary phases, rollout strata, stable versions, a node's state or inventory; not liveness,
not staged versions, not a new node: a replica that meets a node it does not know loads it on its own).
A writer that knows exactly which rows it changed passes them (``rows``: node id -> bundle name ->
:class:`PatchRow`; ``strata``: (rollout id, stratum) -> state): a commit whose every change came with its
rows carries a complete :class:`Patch`, which replicas apply to their snapshot without a reload (a switch
batch, a verified canary, a rollback, a pause). Any :func:`changed` without rows makes the patch partial:
the rows it has are still applied at once (their watches answer), and the snapshot is reloaded for the rest.
``nodes`` (node id -> state) declares a node marked stale or back to active: its next heartbeat's road
(the full transaction while it is stale) changes, its desired state does not.

:func:`install_generation_hooks` adds the bump to a sessionmaker: right before COMMIT one ``UPDATE ...
RETURNING`` takes the next value (the row lock is held only for the commit, so generations are ordered like
the commits) and, on PostgreSQL, ``pg_notify('kernelctl_desired', notice)`` wakes every replica when the
transaction commits; after the commit ``on_commit(generation, patch)`` tells this process. The notice carries
the patch too when it fits a NOTIFY payload (:func:`notice`: a switch batch, a verified canary, a pause), so the
other API workers and replicas patch their snapshots as this process does instead of reloading them (with two
workers, each reloaded about once a second for the other's switches, and a watch woken by a rollback then waited
behind a reload in progress); a larger patch (a rollback of many canaries) still sends the generation alone.
"""

from __future__ import annotations

import base64
import json
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import event, text
from sqlalchemy.orm import Session, sessionmaker

from controller.desired.effects import AssignmentView

CHANNEL = "kernelctl_desired"
PATCH = "kctl_desired_patch"  # session.info: the Patch this transaction declared (present: it changed desired state)
GENERATION = "kctl_generation"
LAST_GENERATION = "kctl_last_generation"  # the value the last commit of this session bumped to (kept)


class _Keep:
    """PatchRow.active_id: the write did not touch the row's active version (one object, in every process)."""

    def __reduce__(self) -> str:
        return "KEEP"  # unpickled as this module's KEEP: a patch from a report worker process keeps meaning it

    def __repr__(self) -> str:
        return "KEEP"


KEEP = _Keep()


@dataclass(frozen=True)
class PatchRow:
    """One assignment row as a commit left it (``active_id`` KEEP: unchanged by this write)."""

    view: AssignmentView
    active_id: Any = KEEP


@dataclass
class Patch:
    """What one transaction changed in desired state; ``complete``: nothing else (no reload needed)."""

    rows: dict[int, dict[str, PatchRow]] = field(default_factory=dict)
    strata: dict[tuple[int, str], str] = field(default_factory=dict)
    nodes: dict[int, str] = field(default_factory=dict)  # node id -> state (a node marked stale, or back)
    complete: bool = True


NOTICE_MAX_BYTES = 7900  # PostgreSQL refuses a NOTIFY payload of 8000 bytes or more


def notice(generation: int, patch: Patch) -> str:
    """The NOTIFY payload for a commit at ``generation``: ``"<generation>"``, or ``"<generation> <patch>"`` with
    the patch as compact JSON (zlib + base64 when that is what fits) when it fits :data:`NOTICE_MAX_BYTES`."""
    rows = [[nid, name, p.view.desired_id, p.view.stable_id, p.view.rollout_id, p.view.phase,
             "K" if p.active_id is KEEP else p.active_id] for nid, mine in patch.rows.items() for name, p in mine.items()]
    # "c": complete for a replica that reads no "n" (one still running code from before node patches, during a
    # rolling upgrade: it reloads rather than miss a node's state); "cn": complete for one that reads "n"
    doc = json.dumps({"r": rows, "s": [[rid, st, state] for (rid, st), state in patch.strata.items()],
                      "n": [[nid, state] for nid, state in patch.nodes.items()],
                      "c": patch.complete and not patch.nodes, "cn": patch.complete}, separators=(",", ":"))
    for body in (doc, "z" + base64.b64encode(zlib.compress(doc.encode(), 6)).decode()):
        out = f"{generation} {body}"
        if len(out.encode()) <= NOTICE_MAX_BYTES:
            return out
    return str(generation)


def read_notice(payload: str) -> tuple[int, Patch | None]:
    """(generation, the patch or None) from a :func:`notice`; raises ValueError on anything else."""
    head, _, body = payload.partition(" ")
    generation = int(head)
    if not body:
        return generation, None
    if body.startswith("z"):
        body = zlib.decompress(base64.b64decode(body[1:])).decode()
    doc = json.loads(body)
    rows: dict[int, dict[str, PatchRow]] = {}
    for nid, name, desired, stable, rollout, phase, active in doc["r"]:
        rows.setdefault(int(nid), {})[name] = PatchRow(AssignmentView(name, desired, stable, rollout, phase),
                                                       KEEP if active == "K" else active)
    strata = {(int(rid), st): state for rid, st, state in doc["s"]}
    nodes = {int(nid): str(state) for nid, state in doc.get("n", [])}  # absent: a replica before node patches
    return generation, Patch(rows=rows, strata=strata, nodes=nodes, complete=bool(doc.get("cn", doc["c"])))


def read_generation(session: Session) -> int:
    """The current desired-state generation (0 before migration 0005 seeded it)."""
    return int(session.execute(text("SELECT value FROM desired_generation WHERE id = 1")).scalar() or 0)


def changed(session: Session, *, rows: dict[int, dict[str, PatchRow]] | None = None,
            strata: dict[tuple[int, str], str] | None = None, nodes: dict[int, str] | None = None) -> None:
    """This transaction changes desired state (its commit bumps the generation); with ``rows``/``strata``/
    ``nodes`` (node id -> state), exactly these (see the module docstring)."""
    patch: Patch = session.info.setdefault(PATCH, Patch())
    if rows is None and strata is None and nodes is None:
        patch.complete = False
        return
    for nid, mine in (rows or {}).items():
        patch.rows.setdefault(nid, {}).update(mine)
    patch.strata.update(strata or {})
    patch.nodes.update(nodes or {})


HOOKED = "_kctl_on_commit"  # the factory's hooks are installed; their on_commit target


def install_generation_hooks(factory: sessionmaker[Session],
                             on_commit: Callable[[int, Patch], None] | None = None) -> None:
    """Bump the generation in every transaction of ``factory`` that declared a change (see module doc).

    Installed once per factory; a later call only changes where ``on_commit`` goes (one hub per factory)."""
    installed = HOOKED in factory.__dict__
    setattr(factory, HOOKED, on_commit)
    if installed:
        return

    @event.listens_for(factory, "before_commit")
    def _before_commit(session: Session) -> None:
        if session.get_nested_transaction() is not None or PATCH not in session.info:
            return  # a savepoint (the outer commit bumps), or nothing declared
        value = session.execute(text(
            "UPDATE desired_generation SET value = value + 1 WHERE id = 1 RETURNING value")).scalar()
        if value is None:
            session.info.pop(PATCH, None)
            return
        session.info[GENERATION] = session.info[LAST_GENERATION] = int(value)
        if session.get_bind().dialect.name == "postgresql":
            session.execute(text("SELECT pg_notify(:ch, :v)"),
                            {"ch": CHANNEL, "v": notice(int(value), session.info[PATCH])})

    @event.listens_for(factory, "after_commit")
    def _after_commit(session: Session) -> None:
        if session.get_nested_transaction() is not None:
            return  # a savepoint released: the outer commit bumps and reports
        value = session.info.pop(GENERATION, None)
        patch = session.info.pop(PATCH, None)
        target = getattr(factory, HOOKED)
        if value is not None and patch is not None and target is not None:
            target(int(value), patch)

    @event.listens_for(factory, "after_soft_rollback")
    def _after_rollback(session: Session, previous: Any) -> None:
        if previous.nested:  # a savepoint undone: which of its declared rows stand is unknown, reload instead
            patch = session.info.get(PATCH)
            if patch is not None:
                session.info[PATCH] = Patch(complete=False)
        elif session.get_nested_transaction() is None:
            session.info.pop(PATCH, None)
            session.info.pop(GENERATION, None)
