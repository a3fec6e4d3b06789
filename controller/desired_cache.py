"""The fleet's desired state per generation: the counter, the commit hook that bumps it, and the snapshot.

Generation: one row (``desired_generation``) bumped by every commit that changes what some node should run
or what the controller knows it runs (assignments, rollouts, their strata, stable versions, a node's state or
inventory; not a new node: a replica that meets a node it does not know reloads on its own). :func:`install_generation_hooks` adds the bump to a sessionmaker: the commit's
flushes and bulk statements mark the session, and right before COMMIT one ``UPDATE ... RETURNING`` takes the
next value (the row lock is held only for the commit, so generations are ordered like the commits) and, on
PostgreSQL, ``pg_notify('kernelctl_desired', value)`` wakes every replica when the transaction commits.

Snapshot: everything the heartbeat reply depends on, loaded in one consistent read (REPEATABLE READ on
PostgreSQL) with the generation it reflects. Desired state is computed with the same pure function as the
database path (:func:`controller.assignments.build_desired`) and memoised per (stratum, CPU node, assignment
rows): the nodes of a stratum that run its stable version share one answer. :meth:`Snapshot.fast_path`
tells whether a heartbeat would write nothing but liveness (reported versions as stored, no phase to advance,
no stable version to add); only then may it be answered from memory.
"""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Text, cast, event, inspect, select, text
from sqlalchemy.orm import Session, sessionmaker

from controller.assignments import AssignmentView, build_desired, trial_shapes  # noqa: F401 - re-exported
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
from controller.plan import PlanSpec, load_plan
from kernelctl import wire

CHANNEL = "kernelctl_desired"
RELEVANT_TABLES = frozenset({"assignments", "rollout_strata", "rollouts", "stable_versions"})
NODE_FIELDS = ("state", "gpu_name", "compute_capability", "arch", "driver_version", "cuda_version",
               "triton_version", "torch_version", "memory_total_mb", "labels")
DIRTY = "kctl_desired_dirty"
GENERATION = "kctl_generation"
LAST_GENERATION = "kctl_last_generation"  # the value the last commit of this session bumped to (kept)
CPU_CUDA = frozenset({"", "none", "unknown", "cpu"})


# ------------------------------------------------------------------------------------------ generation
def read_generation(session: Session) -> int:
    """The current desired-state generation (0 before migration 0005 seeded it)."""
    return int(session.execute(text("SELECT value FROM desired_generation WHERE id = 1")).scalar() or 0)


def mark_desired_changed(session: Session) -> None:
    """This transaction changed desired state through the Core connection (the ORM hooks do not see it):
    its commit bumps the generation."""
    session.info[DIRTY] = True


def _node_changed(obj: Node) -> bool:
    st = inspect(obj)
    return any(st.attrs[f].history.has_changes() for f in NODE_FIELDS)


def install_generation_hooks(factory: sessionmaker[Session], on_commit: Callable[[int], None] | None = None) -> None:
    """Bump the generation in every transaction of ``factory`` that changes desired state (see module doc).

    ``on_commit(generation)`` is called after such a commit (in-process wake-up: the SQLite path, and the
    fast local path on PostgreSQL).
    """

    @event.listens_for(factory, "before_flush")
    def _before_flush(session: Session, _ctx: Any, _instances: Any) -> None:
        if session.info.get(DIRTY):
            return
        for obj in itertools.chain(session.new, session.dirty, session.deleted):
            table = obj.__tablename__  # every mapped class is a controller.db.models table
            if table in RELEVANT_TABLES and (obj not in session.dirty or session.is_modified(obj)):
                mark_desired_changed(session)
                return
            # a new node is not a change of desired state: the hub loads nodes it does not know on its own
            if table == "nodes" and obj not in session.new and (obj in session.deleted or _node_changed(obj)):
                mark_desired_changed(session)
                return

    @event.listens_for(factory, "do_orm_execute")
    def _orm_execute(state: Any) -> Any:
        if state.session.info.get(DIRTY) or not (state.is_update or state.is_insert or state.is_delete):
            return None
        table = getattr(getattr(state.statement, "table", None), "name", None)
        if table == "nodes":
            values = getattr(state.statement, "_values", None) or {}
            if {getattr(k, "key", k) for k in values} <= {"last_heartbeat_at"} and values:
                return None  # liveness only
        elif table not in RELEVANT_TABLES:
            return None
        result = state.invoke_statement()
        rowcount = getattr(result, "rowcount", None)
        if rowcount is None and not state.is_insert:  # UPDATE ... RETURNING: count the rows it returned
            frozen = result.freeze()
            rowcount, result = len(frozen.data), frozen()
        if state.is_insert or rowcount != 0:  # an UPDATE that matched nothing changed nothing
            mark_desired_changed(state.session)
        return result

    @event.listens_for(factory, "before_commit")
    def _before_commit(session: Session) -> None:
        if session.get_nested_transaction() is not None:
            return  # a savepoint: the outer commit bumps
        session.flush()
        if not session.info.pop(DIRTY, False):
            return
        value = session.execute(text(
            "UPDATE desired_generation SET value = value + 1 WHERE id = 1 RETURNING value")).scalar()
        if value is None:
            return
        session.info[GENERATION] = session.info[LAST_GENERATION] = int(value)
        if session.get_bind().dialect.name == "postgresql":
            session.execute(text("SELECT pg_notify(:ch, :v)"), {"ch": CHANNEL, "v": str(value)})

    @event.listens_for(factory, "after_commit")
    def _after_commit(session: Session) -> None:
        value = session.info.pop(GENERATION, None)
        if value is not None and on_commit is not None and session.get_nested_transaction() is None:
            on_commit(int(value))

    @event.listens_for(factory, "after_soft_rollback")
    def _after_rollback(session: Session, _previous: Any) -> None:
        if session.get_nested_transaction() is None:
            session.info.pop(DIRTY, None)
            session.info.pop(GENERATION, None)


# ------------------------------------------------------------------------------------------ snapshot
@dataclass(frozen=True)
class Row:
    """One assignment row as the snapshot sees it."""

    view: AssignmentView
    active_id: int | None
    staged: tuple[str, ...] | None  # None: a stored shape the heartbeat would rewrite


@dataclass
class NodeView:
    id: int
    name: str
    stratum: str
    cpu: bool
    state: str
    rows: dict[str, Row]
    needs_sync: bool = False  # a stable version of its stratum is missing from its assignments
    key: tuple[Any, ...] = ()


@dataclass
class Snapshot:
    """Desired state of the whole fleet at one generation (immutable once built)."""

    generation: int
    nodes: dict[str, NodeView] = field(default_factory=dict)
    by_ref: dict[tuple[str, str, str], int] = field(default_factory=dict)  # (name, version, digest) -> id
    refs: dict[int, wire.BundleRef] = field(default_factory=dict)
    manifests: dict[int, dict[str, Any]] = field(default_factory=dict)
    plans: dict[int, PlanSpec] = field(default_factory=dict)
    strata_state: dict[tuple[int, str], str] = field(default_factory=dict)
    stable_strata: set[str] = field(default_factory=set)  # strata with a stable version of some bundle
    _memo: dict[tuple[Any, ...], list[wire.DesiredBundle]] = field(default_factory=dict)

    def desired(self, node: NodeView) -> list[wire.DesiredBundle]:
        """The node's desired state (memoised: nodes with the same key share one list)."""
        hit = self._memo.get(node.key)
        if hit is None:
            views = [r.view for r in node.rows.values()]
            states = {rid: st for (rid, s), st in self.strata_state.items() if s == node.stratum}
            hit = build_desired(views, refs=self.refs, manifests=self.manifests, plans=self.plans,
                                strata_state=states, stratum=node.stratum, cpu=node.cpu)
            self._memo[node.key] = hit
        return hit

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

    def switch_ids(self, node: NodeView, req: wire.HeartbeatRequest) -> dict[str, int | None] | None:
        """The reported active version (bundle id, None: none) per bundle name of the node when this
        heartbeat's only news is a version switch and the phase that follows from it (written in batches by
        ``controller.switches``); None when it needs the full transaction."""
        if node.state != "active" or req.inventory is not None or node.needs_sync:
            return None
        active: dict[str, int | None] = {}
        for r in req.active:
            bid = self.by_ref.get((r.name, r.version, r.digest))
            if bid is None:
                return None  # a version this snapshot does not know: let the transaction resolve it
            active[r.name] = bid
        for name in set(active) | {r.name for r in req.staged if (r.name, r.version, r.digest) in self.by_ref}:
            row = node.rows.get(name)
            if row is None or row.staged is None:
                return None
        return {name: active.get(name) for name in node.rows}

    def fast_path(self, node: NodeView, req: wire.HeartbeatRequest) -> bool:
        """True when this heartbeat changes nothing but liveness and staged versions (mirrors
        ``registry.heartbeat``; staged versions are informational and written in batches by the hub)."""
        if node.state != "active" or req.inventory is not None or node.needs_sync:
            return False
        active: dict[str, int] = {}
        for r in req.active:
            bid = self.by_ref.get((r.name, r.version, r.digest))
            if bid is not None:
                active[r.name] = bid
        staged: dict[str, list[str]] = {}
        for r in req.staged:
            if (r.name, r.version, r.digest) in self.by_ref:
                staged.setdefault(r.name, []).append(r.version)
        for name in set(node.rows) | set(active) | set(staged):
            row = node.rows.get(name)
            if row is None or row.active_id != active.get(name) or (row.staged is None and name in staged):
                return False
            v = row.view
            if v.rollout_id is not None and v.desired_id is not None and v.desired_id != v.stable_id:
                runs = row.active_id == v.desired_id
                if runs != (v.phase == "serving"):
                    return False  # advance_phases would move the phase
        return True


def new_node_view(node_id: int, name: str, inventory: wire.Inventory, snap: Snapshot) -> NodeView:
    """The view of a node registered after ``snap`` was loaded (no assignments yet)."""
    stratum = stratum_key(inventory.arch, inventory.driver_version, inventory.triton_version)
    cpu = inventory.cuda_version.lower() in CPU_CUDA or inventory.gpu_name.lower().startswith("cpu")
    view = NodeView(node_id, name, stratum, cpu, "active", {}, needs_sync=stratum in snap.stable_strata)
    view.key = (stratum, cpu, ())
    return view


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
    with factory() as session:
        if session.get_bind().dialect.name == "postgresql":
            session.connection(execution_options={"isolation_level": "REPEATABLE READ", "postgresql_readonly": True})
        snap = Snapshot(generation=read_generation(session))
        for bid, name, version, digest in session.execute(select(Bundle.id, Bundle.name, Bundle.version,
                                                                  Bundle.digest)):
            snap.by_ref[(name, version, digest)] = bid
            snap.refs[bid] = wire.BundleRef(name=name, version=version, digest=digest)
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
                snap.manifests[bid] = {"traffic": (manifest or {}).get("traffic") or {}}
        if rollout_ids:
            for rid, plan in session.execute(select(Rollout.id, Rollout.plan).where(Rollout.id.in_(rollout_ids))):
                snap.plans[rid] = load_plan(plan)
            for rid, stratum, st in session.execute(select(RolloutStratum.rollout_id, RolloutStratum.stratum,
                                                           RolloutStratum.state)
                                                    .where(RolloutStratum.rollout_id.in_(rollout_ids))):
                snap.strata_state[(rid, stratum)] = st
        stables: dict[str, list[tuple[str, int]]] = {}
        for stratum, bname, bid in session.execute(select(StableVersion.stratum, StableVersion.bundle_name,
                                                          StableVersion.bundle_id)):
            stables.setdefault(stratum, []).append((bname, bid))
        snap.stable_strata = set(stables)
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
            cpu = str(cuda).lower() in CPU_CUDA or gpu.lower().startswith("cpu")
            mine = rows.get(nid, {})
            view = NodeView(nid, name, stratum, cpu, state, mine)
            for bname, bid in stables.get(stratum, []):
                a = mine.get(bname)
                if a is not None and (a.view.rollout_id is not None or a.view.stable_id == bid):
                    continue
                rk = (bid, arch, drv, cuda, triton, torch)
                if rk not in rejects:
                    probe = _Probe(arch, drv, cuda, triton, torch)
                    rejects[rk] = node_rejection(targets.get(bid, []), probe) is not None  # type: ignore[arg-type]
                if not rejects[rk]:
                    view.needs_sync = True
                    break
            view.key = (stratum, cpu, tuple(sorted((r.view for r in mine.values()), key=lambda v: v.bundle_name)))
            snap.nodes[name] = view
        session.rollback()
    return snap


@dataclass(frozen=True)
class _Probe:
    """The node fields the compatibility matrix reads."""

    arch: str
    driver_version: str
    cuda_version: str
    triton_version: str
    torch_version: str
