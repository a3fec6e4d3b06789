"""The fleet's desired state at one generation: an immutable snapshot, loaded in one read or patched copy-on-write.

Everything the heartbeat reply depends on, loaded in one consistent read (REPEATABLE READ on PostgreSQL) with
the generation it reflects (:func:`load_snapshot`). Desired state is computed with the same pure function as
the database path (:func:`controller.assignments.build_desired`) and memoised per (stratum, CPU node,
assignment rows): the nodes of a stratum that run its stable version share one answer (the memo is a cache of
that pure function, the only thing a snapshot fills in after it is built). A snapshot is never changed:
:meth:`Snapshot.patched` and :meth:`Snapshot.with_nodes` return a new one sharing what did not change.
:meth:`Snapshot.fast_path` asks :func:`controller.desired.effects.heartbeat_effects` whether a heartbeat's
effects are liveness only; only then is it answered from memory.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from sqlalchemy import Text, cast, exists, select
from sqlalchemy.orm import Session, sessionmaker

from controller.assignments import build_desired, is_cpu
from controller.compat import TargetInfo, node_rejection, stratum_key
from controller.db.models import (
    Assignment,
    Bundle,
    BundleTarget,
    Node,
    Rollout,
    RolloutStratum,
    StableVersion,
)
from controller.desired.effects import AssignmentView, Effects, RowFacts, heartbeat_effects
from controller.desired.generation import KEEP, Patch, read_generation
from controller.plan import PlanSpec, load_plan
from kernelctl import wire
from kernelctl.vocab import FullHeartbeat

EMPTY: Mapping[Any, Any] = MappingProxyType({})


@dataclass(frozen=True)
class Row:
    """One assignment row as the snapshot sees it."""

    view: AssignmentView
    active_id: int | None
    staged: tuple[str, ...] | None  # None: a stored shape the heartbeat would rewrite


@dataclass(frozen=True)
class NodeView:
    id: int
    name: str
    stratum: str
    cpu: bool
    state: str
    rows: Mapping[str, Row]
    needs_sync: bool = False  # a stable version of its stratum is missing from its assignments

    @functools.cached_property
    def key(self) -> tuple[Any, ...]:
        """What the node's desired state depends on (nodes with equal keys get the same answer)."""
        return (self.stratum, self.cpu, tuple(sorted((r.view for r in self.rows.values()),
                                                     key=lambda v: v.bundle_name)))


def _frozen(d: dict[Any, Any]) -> Mapping[Any, Any]:
    return MappingProxyType(d)


@dataclass(frozen=True)
class Snapshot:
    """Desired state of the whole fleet at one generation (immutable: see the module docstring)."""

    generation: int
    nodes: Mapping[str, NodeView] = field(default_factory=lambda: EMPTY)
    by_ref: Mapping[tuple[str, str, str], int] = field(default_factory=lambda: EMPTY)  # (name, version, digest) -> bundle id
    refs: Mapping[int, wire.BundleRef] = field(default_factory=lambda: EMPTY)
    manifests: Mapping[int, dict[str, Any]] = field(default_factory=lambda: EMPTY)
    plans: Mapping[int, PlanSpec] = field(default_factory=lambda: EMPTY)
    strata_state: Mapping[tuple[int, str], str] = field(default_factory=lambda: EMPTY)
    stable_strata: frozenset[str] = frozenset()  # strata with a stable version of some bundle
    by_id: Mapping[int, str] = field(default_factory=lambda: EMPTY)  # node id -> name
    _memo: dict[tuple[Any, ...], list[wire.DesiredBundle]] = field(default_factory=dict, compare=False, repr=False)

    def desired(self, node: NodeView) -> list[wire.DesiredBundle]:
        """The node's desired state (memoised: nodes with the same key share one list)."""
        hit = self._memo.get(node.key)
        if hit is None:
            views = [r.view for r in node.rows.values()]
            states = {rid: st for (rid, s), st in self.strata_state.items() if s == node.stratum}
            hit = build_desired(views, refs=dict(self.refs), manifests=dict(self.manifests), plans=dict(self.plans),
                                strata_state=states, stratum=node.stratum, cpu=node.cpu)
            self._memo[node.key] = hit
        return hit

    # ----------------------------------------------------------------------------- copy-on-write
    def patched(self, generation: int, patch: Patch) -> Snapshot:
        """This snapshot with a commit's rows and strata (``patch``); at ``generation`` when the commit came
        right after this snapshot and declared everything it changed, else at this snapshot's generation
        (a reload brings the rest)."""
        nodes = dict(self.nodes)
        for nid, mine in patch.rows.items():
            name = self.by_id.get(nid)
            node = nodes.get(name) if name is not None else None
            if node is None:
                continue
            rows = dict(node.rows)
            for bname, p in mine.items():
                old = rows.get(bname)
                active = (old.active_id if old is not None else None) if p.active_id is KEEP else p.active_id
                rows[bname] = Row(p.view, active, old.staged if old is not None else ())
            nodes[node.name] = replace(node, rows=_frozen(rows))
        for nid, state in patch.nodes.items():
            name = self.by_id.get(nid)
            node = nodes.get(name) if name is not None else None
            if node is not None:
                nodes[node.name] = replace(node, state=state)
        strata = {**self.strata_state, **patch.strata}
        whole = patch.complete and generation == self.generation + 1
        memo = self._memo if not patch.strata else {}
        return replace(self, generation=generation if whole else self.generation, nodes=_frozen(nodes),
                       strata_state=_frozen(strata), _memo=memo)

    def with_nodes(self, nodes: list[NodeView]) -> Snapshot:
        """This snapshot knowing nodes registered after it was loaded (one copy for all of them)."""
        return replace(self, nodes=_frozen({**self.nodes, **{n.name: n for n in nodes}}),
                       by_id=_frozen({**self.by_id, **{n.id: n.name for n in nodes}}))

    # ----------------------------------------------------------------------------- heartbeats
    def staged_changes(self, node: NodeView, req: wire.HeartbeatRequest) -> dict[str, tuple[str, ...]]:
        """bundle name -> the staged versions this heartbeat reports where they differ from the snapshot."""
        staged: dict[str, list[str]] = {}
        for r in req.staged:
            if (r.name, r.version, r.digest) in self.by_ref:
                staged.setdefault(r.name, []).append(r.version)
        out: dict[str, tuple[str, ...]] = {}
        for name, row in node.rows.items():
            versions = tuple(sorted(staged.get(name, [])))
            if row.staged != versions:
                out[name] = versions
        return out

    def reported(self, node: NodeView, req: wire.HeartbeatRequest) -> dict[str, int | None] | None:
        """The reported active version (bundle id) per bundle name of the node, when the snapshot can judge
        the heartbeat; None when it needs the full transaction (:meth:`judge` says why)."""
        judged = self.judge(node, req)
        return None if isinstance(judged, FullHeartbeat) else judged

    def judge(self, node: NodeView, req: wire.HeartbeatRequest) -> dict[str, int | None] | FullHeartbeat:
        """:meth:`reported`'s answer, or why the heartbeat needs the full transaction (an inventory, a node not
        active or missing a stable version, a version the snapshot does not know, a bundle the node has no row
        for, a stored ``staged`` shape to rewrite)."""
        if node.state != "active":
            return FullHeartbeat.NOT_ACTIVE
        if req.inventory is not None:
            return FullHeartbeat.INVENTORY
        if node.needs_sync:
            return FullHeartbeat.NEEDS_SYNC
        active: dict[str, int | None] = {}
        for r in req.active:
            bid = self.by_ref.get((r.name, r.version, r.digest))
            if bid is None:
                return FullHeartbeat.UNKNOWN_VERSION  # let the transaction resolve it
            active[r.name] = bid
        for name in set(active) | {r.name for r in req.staged if (r.name, r.version, r.digest) in self.by_ref}:
            row = node.rows.get(name)
            if row is None or row.staged is None:
                return FullHeartbeat.NO_ROW
        return {name: active.get(name) for name in node.rows}

    def facts(self, node: NodeView) -> dict[str, RowFacts]:
        """The node's rows as :func:`heartbeat_effects` reads them."""
        return {name: RowFacts(name, r.active_id, r.view.desired_id, r.view.stable_id, r.view.rollout_id,
                               r.view.phase, trial_first=self.trial_first(r.view.rollout_id))
                for name, r in node.rows.items()}

    def trial_first(self, rollout_id: int | None) -> bool:
        plan = self.plans.get(rollout_id) if rollout_id is not None else None
        return plan is None or not plan.serve_before_trial

    def effects(self, node: NodeView, req: wire.HeartbeatRequest, now: Any = None) -> Effects | None:
        """What this heartbeat writes by the one rule, when the snapshot can judge it (None: the full transaction
        decides, see :meth:`reported`)."""
        reported = self.reported(node, req)
        return heartbeat_effects(self.facts(node), reported, now) if reported is not None else None

    def fast_path(self, node: NodeView, req: wire.HeartbeatRequest, now: Any = None) -> bool:
        """True when this heartbeat's effects are liveness only (and staged versions, informational, written
        in batches by the replica)."""
        effects = self.effects(node, req, now)
        return effects is not None and effects.liveness_only


def new_node_view(node_id: int, name: str, inventory: wire.Inventory, snap: Snapshot) -> NodeView:
    """The view of a node registered after ``snap`` was loaded (no assignments yet)."""
    return _unassigned(node_id, name, inventory.arch, inventory.driver_version, inventory.cuda_version,
                       inventory.triton_version, inventory.gpu_name, snap)


def _unassigned(node_id: int, name: str, arch: str, driver: str, cuda: str, triton: str, gpu: str,
                snap: Snapshot) -> NodeView:
    stratum = stratum_key(arch, driver, triton)
    return NodeView(node_id, name, stratum, is_cpu(cuda, gpu), "active", EMPTY,
                    needs_sync=stratum in snap.stable_strata)


def load_unassigned(factory: sessionmaker[Session], names: list[str], snap: Snapshot) -> dict[str, NodeView]:
    """(worker thread) The named nodes that are active and have no assignment row yet (registered through
    another replica since ``snap`` was loaded), viewed as the registering replica added them; a node with rows is
    left to the reload (its rows may be newer than ``snap``). One statement for every name."""
    with factory() as session:
        found = session.execute(select(Node.id, Node.name, Node.arch, Node.driver_version, Node.cuda_version,
                                       Node.triton_version, Node.gpu_name)
                                .where(Node.name.in_(names), Node.state == "active",
                                       ~exists().where(Assignment.node_id == Node.id))).all()
        session.rollback()
    return {row.name: _unassigned(*row, snap) for row in found}


@functools.lru_cache(maxsize=4096)
def _staged(raw: str | None) -> tuple[str, ...] | None:
    """The staged versions of a stored ``staged`` document (its JSON text: the fleet shares a few values, each
    parsed once)."""
    try:
        doc = json.loads(raw) if raw is not None else None
    except ValueError:
        return None
    if isinstance(doc, dict) and set(doc) == {"versions"} and isinstance(doc["versions"], list) \
            and all(isinstance(v, str) for v in doc["versions"]):
        return tuple(doc["versions"])
    return None


def load_snapshot(factory: sessionmaker[Session]) -> Snapshot:
    """Read the whole desired state in one consistent snapshot (a few set-based queries)."""
    by_ref: dict[tuple[str, str, str], int] = {}
    refs: dict[int, wire.BundleRef] = {}
    manifests: dict[int, dict[str, Any]] = {}
    plans: dict[int, PlanSpec] = {}
    strata_state: dict[tuple[int, str], str] = {}
    nodes: dict[str, NodeView] = {}
    with factory() as session:
        if session.get_bind().dialect.name == "postgresql":
            session.connection(execution_options={"isolation_level": "REPEATABLE READ", "postgresql_readonly": True})
        generation = read_generation(session)
        for bid, name, version, digest in session.execute(select(Bundle.id, Bundle.name, Bundle.version,
                                                                  Bundle.digest)):
            by_ref[(name, version, digest)] = bid
            refs[bid] = wire.BundleRef(name=name, version=version, digest=digest)
        rows: dict[int, dict[str, Row]] = {}
        rollout_ids: set[int] = set()
        wanted: set[int] = set()
        for nid, bname, desired, stable, rid, phase, active, staged in session.execute(select(
                Assignment.node_id, Assignment.bundle_name, Assignment.desired_bundle_id,
                Assignment.stable_bundle_id, Assignment.rollout_id, Assignment.phase, Assignment.active_bundle_id,
                cast(Assignment.staged, Text))):
            rows.setdefault(nid, {})[bname] = Row(AssignmentView(bname, desired, stable, rid, phase), active,
                                                  _staged(staged))
            if rid is not None:
                rollout_ids.add(rid)
            if desired is not None:
                wanted.add(desired)
        if wanted:
            for bid, manifest in session.execute(select(Bundle.id, Bundle.manifest).where(Bundle.id.in_(wanted))):
                manifests[bid] = {"traffic": (manifest or {}).get("traffic") or {}}
        if rollout_ids:
            for rid, plan in session.execute(select(Rollout.id, Rollout.plan).where(Rollout.id.in_(rollout_ids))):
                plans[rid] = load_plan(plan)
            for rid, stratum, st in session.execute(select(RolloutStratum.rollout_id, RolloutStratum.stratum,
                                                           RolloutStratum.state)
                                                    .where(RolloutStratum.rollout_id.in_(rollout_ids))):
                strata_state[(rid, stratum)] = st
        stables: dict[str, list[tuple[str, int]]] = {}
        for stratum, bname, bid in session.execute(select(StableVersion.stratum, StableVersion.bundle_name,
                                                          StableVersion.bundle_id)):
            stables.setdefault(stratum, []).append((bname, bid))
        targets: dict[int, list[TargetInfo]] = {}
        stable_ids = {bid for lst in stables.values() for _n, bid in lst}
        if stable_ids:
            for t in session.scalars(select(BundleTarget).where(BundleTarget.bundle_id.in_(stable_ids))):
                targets.setdefault(t.bundle_id, []).append(TargetInfo.of(t))
        rejects: dict[tuple[Any, ...], bool] = {}
        for nid, name, arch, drv, cuda, triton, torch, gpu, state in session.execute(select(
                Node.id, Node.name, Node.arch, Node.driver_version, Node.cuda_version, Node.triton_version,
                Node.torch_version, Node.gpu_name, Node.state)):
            stratum = stratum_key(arch, drv, triton)
            cpu = is_cpu(cuda, gpu)
            mine = rows.get(nid, {})
            needs_sync = False
            for bname, bid in stables.get(stratum, []):
                a = mine.get(bname)
                if a is not None and (a.view.rollout_id is not None or a.view.stable_id == bid):
                    continue
                rk = (bid, arch, drv, cuda, triton, torch)
                if rk not in rejects:
                    probe = _Probe(arch, drv, cuda, triton, torch)
                    rejects[rk] = node_rejection(targets.get(bid, []), probe) is not None  # type: ignore[arg-type]
                if not rejects[rk]:
                    needs_sync = True
                    break
            nodes[name] = NodeView(nid, name, stratum, cpu, state, _frozen(mine), needs_sync)
        session.rollback()
    return Snapshot(generation, _frozen(nodes), _frozen(by_ref), _frozen(refs), _frozen(manifests), _frozen(plans),
                    _frozen(strata_state), frozenset(stables), _frozen({v.id: k for k, v in nodes.items()}))


@dataclass(frozen=True)
class _Probe:
    """The node fields the compatibility matrix reads."""

    arch: str
    driver_version: str
    cuda_version: str
    triton_version: str
    torch_version: str
