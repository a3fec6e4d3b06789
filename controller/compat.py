"""The compatibility matrix: which nodes (arch x driver x CUDA x Triton x torch) can run which bundle version.

A node is compatible with a bundle when one of the bundle's targets accepts it: arch equal; driver major >=
the target's minimum driver major; Triton exactly the target's; torch inside the target's range
(``packaging`` specifiers, local build tags like ``+cpu`` ignored); CUDA major among the target's when the
node reports a CUDA version at all (CPU nodes report ``none``). Nodes are grouped in strata
``"{arch}/drv{driver_major}/triton{triton}"``; :func:`compat_matrix` gives the state of every bundle version
in every stratum (stable, candidate at step k (from 1), rolled_back, revoked, eligible, ineligible); a candidate
cell counts its canaries per phase (trial before serve: staged, verified, serving).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version
from sqlalchemy import select
from sqlalchemy.orm import Session

from controller.db.models import (
    Assignment,
    Bundle,
    BundleTarget,
    Incompatibility,
    Node,
    Rollout,
    RolloutStratum,
    StableVersion,
)
from controller.errors import NotFound
from controller.paging import after
from kernelctl.vocab import (
    ACTIVE_STATES,
    CANARY_PHASES,
    PARTLY_PROMOTED,
    PROMOTED,
    ROLLED_BACK,
    step_number,
    stratum_key,
)

NO_CUDA = frozenset({"", "none", "unknown", "cpu", "n/a"})


_MAJOR_RE = re.compile(r"([0-9]{1,9})(?:\.|$)")


def driver_major(driver_version: object) -> int:
    """Major of a driver version string (``"550.54.15"`` -> 550); -1 when it has no leading ASCII number.

    Never raises, whatever is stored (``"²"``, ``"unknown"``, a 10-digit number, None): stored values came
    from nodes, and one node's bad string must not break the matrix for everybody.
    """
    m = _MAJOR_RE.match(str(driver_version).strip())
    return int(m.group(1)) if m else -1


def node_stratum(node: Node | NodeInfo) -> str:
    return stratum_key(node.arch, node.driver_version, node.triton_version)


@dataclass(frozen=True)
class TargetInfo:
    """A bundle target as plain values (cacheable)."""

    arch: str
    min_driver: str
    cuda: str  # comma-separated list, e.g. "12.x,13.x"
    triton: str
    torch: str

    @classmethod
    def of(cls, t: BundleTarget) -> TargetInfo:
        return cls(t.arch, t.min_driver, t.cuda, t.triton, t.torch)


@dataclass(frozen=True)
class NodeInfo:
    """The columns of a node the engine needs, loaded in one query for the whole fleet."""

    id: int
    name: str
    arch: str
    driver_version: str
    cuda_version: str
    triton_version: str
    torch_version: str
    state: str
    labels: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)

    @property
    def stratum(self) -> str:
        return stratum_key(self.arch, self.driver_version, self.triton_version)


@lru_cache(maxsize=4096)
def _torch_in(spec: str, version: str) -> bool:
    try:
        return SpecifierSet(spec).contains(Version(version.split("+")[0]), prereleases=True)
    except (InvalidSpecifier, InvalidVersion):
        return False


def _cuda_ok(target_cuda: str, node_cuda: str) -> bool:
    node_cuda = str(node_cuda).strip().lower()
    if node_cuda in NO_CUDA:
        return True  # CPU / interpreter node: nothing to check
    node_major = node_cuda.split(".")[0]
    wanted = [c.strip() for c in target_cuda.split(",") if c.strip()]
    return not wanted or any(c.split(".")[0] == node_major for c in wanted)


@lru_cache(maxsize=16384)
def target_rejects(target: TargetInfo, arch: str, driver_version: str, cuda_version: str, triton_version: str,
                   torch_version: str) -> str | None:
    """Why ``target`` does not accept a node with these versions, or None when it does."""
    if arch != target.arch:
        return f"arch {arch} is not {target.arch}"
    need = driver_major(target.min_driver)
    have = driver_major(driver_version)
    if have < need:
        return f"driver {driver_version} is older than the minimum {target.min_driver}"
    if triton_version != target.triton:
        return f"Triton {triton_version} is not {target.triton}"
    if not _torch_in(target.torch, torch_version):
        return f"torch {torch_version} is outside {target.torch}"
    if not _cuda_ok(target.cuda, cuda_version):
        return f"CUDA {cuda_version} is not among {target.cuda}"
    return None


def node_rejection(targets: Sequence[TargetInfo], node: NodeInfo | Node) -> str | None:
    """None when some target accepts the node, else the reason the closest target (same arch) refuses it."""
    if not targets:
        return "the bundle declares no targets"
    reasons = []
    for t in targets:
        why = target_rejects(t, node.arch, node.driver_version, node.cuda_version, node.triton_version,
                             node.torch_version)
        if why is None:
            return None
        reasons.append((t.arch == node.arch, why))
    reasons.sort(key=lambda r: not r[0])
    return reasons[0][1]


def bundle_targets(bundle: Bundle) -> list[TargetInfo]:
    return [TargetInfo.of(t) for t in bundle.targets]


def load_fleet(session: Session, *, include_stale: bool = True) -> list[NodeInfo]:
    """Every node as :class:`NodeInfo` (one query), ordered by name."""
    stmt = select(Node.id, Node.name, Node.arch, Node.driver_version, Node.cuda_version, Node.triton_version,
                  Node.torch_version, Node.state, Node.labels).order_by(Node.name)
    if not include_stale:
        stmt = stmt.where(Node.state == "active")
    return [NodeInfo(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8] or {}) for r in session.execute(stmt)]


def cached_fleet(session: Session) -> list[NodeInfo]:
    """:func:`load_fleet` once per transaction (a snapshot: a multi-stratum promotion reads the fleet once)."""
    tx = session.get_transaction()
    hit = session.info.get("kernelctl.fleet")
    if tx is not None and hit is not None and hit[0] is tx:
        return hit[1]
    fleet = load_fleet(session)
    if tx is not None:
        session.info["kernelctl.fleet"] = (tx, fleet)
    return fleet


def eligible_by_stratum(bundle: Bundle, fleet: Iterable[NodeInfo]) -> dict[str, list[NodeInfo]]:
    """Nodes of ``fleet`` the bundle accepts, grouped by stratum (order of ``fleet`` kept)."""
    targets = bundle_targets(bundle)
    out: dict[str, list[NodeInfo]] = defaultdict(list)
    for n in fleet:
        if node_rejection(targets, n) is None:
            out[n.stratum].append(n)
    return dict(out)


@dataclass(frozen=True)
class CompatRow:
    """One cell of the matrix: a bundle version in a stratum."""

    bundle: str  # name@version
    stratum: str
    state: str  # stable | candidate | rolled_back | revoked | eligible | ineligible
    nodes: int  # nodes in the stratum (active and stale)
    eligible_nodes: int
    step: int | None = None  # for candidate: the stratum's step, numbered from 1 (vocab.step_number)
    rollout_id: int | None = None
    reason: str | None = None
    phases: dict[str, int] | None = None  # for candidate: canaries per phase (staged / verified / serving)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def compat_page(session: Session, *, bundle_name: str | None, after_key: tuple[str, int] | None, limit: int
                ) -> tuple[list[CompatRow], tuple[str, int] | None]:
    """One page of the matrix: the rows of at most ``limit`` bundle versions after ``after_key`` (name, id), and
    the key of its last version when more follow (``controller.paging``)."""
    stmt = select(Bundle.name, Bundle.id).order_by(Bundle.name, Bundle.id).limit(limit + 1)
    if bundle_name is not None:
        stmt = stmt.where(Bundle.name == bundle_name)
    if after_key is not None:
        stmt = stmt.where(after((Bundle.name, Bundle.id), after_key))
    keys = [(name, bid) for name, bid in session.execute(stmt)]
    if not keys:
        if bundle_name is not None and after_key is None:
            raise NotFound(f"no bundle named {bundle_name!r} is registered (kernelctl bundle list)")
        return [], None
    rows = compat_matrix(session, bundle_name=bundle_name, bundle_ids=[bid for _n, bid in keys[:limit]])
    return rows, keys[limit - 1] if len(keys) > limit else None


def compat_matrix(session: Session, *, bundle_name: str | None = None, bundle_ids: list[int] | None = None
                  ) -> list[CompatRow]:
    """The state of every registered bundle version (optionally of one name, or these ids) in every stratum
    with nodes."""
    fleet = load_fleet(session)
    strata: dict[str, list[NodeInfo]] = defaultdict(list)
    for n in fleet:
        strata[n.stratum].append(n)
    stmt = select(Bundle).order_by(Bundle.name, Bundle.created_at, Bundle.id)
    if bundle_name is not None:
        stmt = stmt.where(Bundle.name == bundle_name)
    if bundle_ids is not None:
        stmt = stmt.where(Bundle.id.in_(bundle_ids))
    bundles = list(session.scalars(stmt))
    if not bundles:
        if bundle_name is not None and bundle_ids is None:
            raise NotFound(f"no bundle named {bundle_name!r} is registered (kernelctl bundle list)")
        return []
    ids = [b.id for b in bundles]
    stable = {(s.bundle_id, s.stratum) for s in session.scalars(
        select(StableVersion).where(StableVersion.bundle_id.in_(ids)))}
    incompatible = {(i.bundle_id, i.stratum): i.reason for i in session.scalars(
        select(Incompatibility).where(Incompatibility.bundle_id.in_(ids)))}
    # a stratum rolled back in a rollout that ended (partly) promoted: the version is not revoked, and rollouts
    # stored before such strata were marked incompatible are read here (never "eligible" where rolled back)
    for bid, stratum, reason in session.execute(
        select(Rollout.bundle_id, RolloutStratum.stratum, RolloutStratum.reason)
        .join(RolloutStratum, RolloutStratum.rollout_id == Rollout.id)
        .where(Rollout.bundle_id.in_(ids), Rollout.state.in_((PROMOTED, PARTLY_PROMOTED)),
               RolloutStratum.state == ROLLED_BACK)
    ):
        incompatible.setdefault((bid, stratum), reason or "rolled back")
    candidate: dict[tuple[int, str], tuple[int, int]] = {}
    for rid, bid, stratum, step in session.execute(
        select(Rollout.id, Rollout.bundle_id, RolloutStratum.stratum, RolloutStratum.step_index)
        .join(RolloutStratum, RolloutStratum.rollout_id == Rollout.id)
        .where(Rollout.bundle_id.in_(ids), Rollout.state.in_(ACTIVE_STATES),
               RolloutStratum.state.in_(ACTIVE_STATES))
    ):
        candidate[(bid, stratum)] = (rid, step)
    phases = _canary_phases(session, {rid for rid, _ in candidate.values()}, {n.id: n.stratum for n in fleet})
    rows: list[CompatRow] = []
    for b in bundles:
        targets = bundle_targets(b)
        for stratum in sorted(strata):
            members = strata[stratum]
            rejections = [node_rejection(targets, n) for n in members]
            n_ok = sum(r is None for r in rejections)
            common = {"bundle": b.ref, "stratum": stratum, "nodes": len(members), "eligible_nodes": n_ok}
            key = (b.id, stratum)
            if key in stable:
                rows.append(CompatRow(state="stable", **common))
            elif key in candidate:
                rid, step = candidate[key]
                rows.append(CompatRow(state="candidate", step=step_number(step), rollout_id=rid,
                                      phases=phases.get((rid, stratum), dict.fromkeys(CANARY_PHASES, 0)), **common))
            elif key in incompatible:
                rows.append(CompatRow(state="rolled_back", reason=incompatible[key], **common))
            elif b.status == "revoked":
                rows.append(CompatRow(state="revoked", reason=b.status_reason, **common))
            elif n_ok:
                rows.append(CompatRow(state="eligible", **common))
            else:
                why = next((r for r in rejections if r), None)
                rows.append(CompatRow(state="ineligible", reason=why, **common))
    return rows




def _canary_phases(session: Session, rollout_ids: set[int], stratum_of: dict[int, str]
                   ) -> dict[tuple[int, str], dict[str, int]]:
    """(rollout_id, stratum) -> canaries per phase (one query over the rollouts' assignments)."""
    out: dict[tuple[int, str], dict[str, int]] = {}
    if not rollout_ids:
        return out
    for rid, node_id, phase in session.execute(
        select(Assignment.rollout_id, Assignment.node_id, Assignment.phase)
        .where(Assignment.rollout_id.in_(sorted(rollout_ids)))
    ):
        stratum = stratum_of.get(node_id)
        if stratum is not None and phase in CANARY_PHASES:
            out.setdefault((rid, stratum), dict.fromkeys(CANARY_PHASES, 0))[phase] += 1
    return out
