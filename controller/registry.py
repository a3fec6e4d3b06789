"""Registering what exists: bundle versions (verified before anything is stored), nodes and their heartbeats.

A heartbeat updates liveness, records the versions the node reports staged and active (closing and opening
``activations`` rows, which answer "what ran on node N at time T") and returns the node's desired state.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

from sqlalchemy import bindparam, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from controller.assignments import advance_phases, desired_state
from controller.changelog import record_event
from controller.db.models import Assignment, Bundle, BundleTarget, Node, utcnow
from controller.desired.generation import changed
from controller.enrollment import apply_inventory, mark_active, register_node  # noqa: F401 - register_node re-exported
from controller.errors import Conflict, Invalid, NotFound
from kernelctl import wire
from kernelctl.settings import get_settings
from kernelpack.archive import DEFAULT_LIMITS, Limits
from kernelpack.errors import BundleError
from kernelpack.verify import TrustedKeys, verify_bytes


def _insert(session: Session, row: object, conflict: str) -> None:
    """Insert ``row`` in a savepoint; losing a race with a concurrent insert of the same key is Conflict."""
    try:
        with session.begin_nested():
            session.add(row)
    except IntegrityError:
        raise Conflict(conflict) from None


def register_bundle(session: Session, data: bytes, *, actor: str, trusted_keys: Path | TrustedKeys,
                    limits: Limits | None = None) -> Bundle:
    """Verify a .kpack (signature by a trusted key, manifest, every file digest) and store it.

    ``limits`` bound the work of reading the archive (uncompressed size and file count, see
    :func:`upload_limits`); nothing is stored when they are exceeded.

    Re-pushing identical bytes returns the stored bundle; the same name@version with other bytes is a Conflict.
    """
    if not data:
        raise Invalid("bundle upload is empty")
    try:
        vb = verify_bytes(data, trusted_keys, limits or DEFAULT_LIMITS)
    except BundleError as exc:
        raise Invalid(f"bundle refused: {exc}") from None
    m = vb.manifest
    ref = f"{m.name}@{m.version}"
    existing = session.scalar(select(Bundle).where(Bundle.name == m.name, Bundle.version == m.version))
    if existing is not None:
        if existing.digest == vb.digest:
            return existing
        raise Conflict(f"{ref} is already registered with digest {existing.digest[:16]}…, this upload has "
                       f"{vb.digest[:16]}…: versions are immutable, bump the version")
    bundle = Bundle(
        name=m.name, version=m.version, parent_version=m.parent, digest=vb.digest,
        manifest=json.loads(vb.manifest_bytes), signer_key_id=vb.key_id, status="registered",
        fault_fixture=m.fault_fixture, size_bytes=len(data), content=data, created_at=utcnow(), created_by=actor,
    )
    bundle.targets = [
        BundleTarget(arch=a, min_driver=m.targets.min_driver, cuda=",".join(m.targets.cuda),
                     triton=m.targets.triton, torch=m.targets.torch)
        for a in m.targets.archs
    ]
    _insert(session, bundle, f"{ref} (or its digest) was registered concurrently; retry the push")
    record_event(session, actor=actor, action="bundle.registered", subject=f"bundle:{ref}", bundle=ref,
                 payload={"digest": vb.digest, "signer_key_id": vb.key_id, "size_bytes": len(data),
                          "archs": list(m.targets.archs), "parent": m.parent, "fault_fixture": m.fault_fixture})
    return bundle


def upload_limits(*, max_bundle_bytes: int, max_uncompressed_bytes: int, max_files: int) -> Limits:
    """Archive limits for an uploaded bundle, from the controller's settings."""
    return Limits(max_member_bytes=min(DEFAULT_LIMITS.max_member_bytes, max_uncompressed_bytes),
                  max_total_bytes=max_uncompressed_bytes, max_members=max_files, max_archive_bytes=max_bundle_bytes)


def get_node(session: Session, node_name: str) -> Node:
    node = session.scalar(select(Node).where(Node.name == node_name))
    if node is None:
        raise not_registered(node_name)
    return node


NODES_NAMED = select(Node).where(Node.name.in_(bindparam("names", expanding=True)))  # built once (report intake)


def get_nodes(session: Session, names: set[str]) -> dict[str, Node]:
    """The registered nodes among ``names``, by name, in one statement (absent: :func:`not_registered`)."""
    return {n.name: n for n in session.scalars(NODES_NAMED, {"names": sorted(names)})} if names else {}


def not_registered(node_name: str) -> NotFound:
    """What a request from a node that is not registered is refused with."""
    return NotFound(f"node {node_name} is not registered (the agent must register first)")


def heartbeat(session: Session, req: wire.HeartbeatRequest, now: dt.datetime,
              *, heartbeat_seconds: float | None = None) -> wire.HeartbeatResponse:
    """Record liveness and what the node runs; answer with its desired state."""
    node = get_node(session, req.node_name)
    actor = f"node:{node.name}"
    if req.inventory is not None:
        apply_inventory(session, node, req.inventory, actor=actor)
    node.last_heartbeat_at = now
    mark_active(session, node, actor=actor)
    rows = record_reported(session, node, staged=req.staged, active=req.active, now=now)
    desired = desired_state(session, node, now=now, rows=rows)
    return wire.HeartbeatResponse(
        node_name=node.name, desired=desired, server_time=now,
        heartbeat_seconds=heartbeat_seconds if heartbeat_seconds is not None else get_settings().heartbeat_seconds,
    )


def record_reported(session: Session, node: Node, *, staged: list[wire.BundleRef], active: list[wire.BundleRef],
                    now: dt.datetime) -> dict[str, Assignment]:
    """Store the node's staged versions and apply what it reports active (``assignments.advance_phases``: the
    heartbeat rule's single-row writer). Returns the node's assignments by bundle name (rows created here too).
    """
    names = {r.name for r in staged} | {r.name for r in active}
    rows = {a.bundle_name: a for a in session.scalars(select(Assignment).where(Assignment.node_id == node.id))}
    known: dict[tuple[str, str], tuple[int, str]] = {}
    if names:
        for bid, name, version, digest in session.execute(
            select(Bundle.id, Bundle.name, Bundle.version, Bundle.digest).where(Bundle.name.in_(names))
        ):
            known[(name, version)] = (bid, digest)

    def resolve(ref: wire.BundleRef) -> int | None:
        hit = known.get((ref.name, ref.version))
        return hit[0] if hit is not None and hit[1] == ref.digest else None

    staged_by_name: dict[str, list[str]] = {}
    for r in staged:
        if resolve(r) is not None:
            staged_by_name.setdefault(r.name, []).append(r.version)
    reported: dict[str, int | None] = {}
    for r in active:
        bid = resolve(r)
        if bid is not None:
            reported[r.name] = bid
    for name in sorted(set(rows) | set(staged_by_name) | set(reported)):
        a = rows.get(name)
        versions = {"versions": sorted(staged_by_name.get(name, []))}
        if a is None:
            a = Assignment(node_id=node.id, bundle_name=name, staged={"versions": []}, updated_at=now)
            session.add(a)
            rows[name] = a
            changed(session)
        if (a.staged or {}) != versions:
            a.staged = versions  # informational: not desired state
    advance_phases(session, node, rows, reported, now)
    return rows
