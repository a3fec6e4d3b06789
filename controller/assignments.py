"""Which version each node should run: canary selection per step, rollback/promotion switches, desired state.

Canaries are chosen deterministically: eligible, non-stale nodes of a stratum ordered by
``sha256("{rollout_id}:{node_name}")``; a step keeps the canaries it already has and adds the next nodes in
that order. The blast radius is honoured across ALL active rollouts: at most ``max_fleet_share`` of the active
fleet, and ``max_label_share`` of the nodes carrying any one value of each ``blast_radius_labels`` key, run a
non-stable kernel at once (at least one node per group, so tiny groups are not blocked forever). A step that
asks for more is clamped and the clamp is returned for the verdict evidence. Switches are set-based UPDATEs.

Trial before serve: a new canary's assignment starts in phase ``staged`` (the heartbeat reply keeps the
stable version active and asks for a trial of the candidate); :func:`mark_verified` (called by report
ingestion) moves it to ``verified`` once a hard-gates-passed report of this node is accepted and its stratum
has no hard failure; the next reply makes the candidate active, and the node reporting it active makes it
``serving`` (the heartbeat rule, ``controller.desired.effects.heartbeat_effects``, applied here by
:func:`advance_phases`, which also tags the node's activation with the rollout and the time its trial was
accepted). A node reporting an unverified candidate active is refused (a security event; the phase stays). A
plan with ``serve_before_trial`` serves the candidate at once (staged -> serving). Rollback and promotion clear
the phase. Every write here that changes desired state declares it (``controller.desired.generation.changed``).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
import math
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from sqlalchemy import and_, bindparam, func, insert, or_, select, update
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import set_committed_value

from controller.changelog import event_row, record_event
from controller.compat import (
    NodeInfo,
    bundle_targets,
    cached_fleet,
    eligible_by_stratum,
    node_rejection,
    node_stratum,
)
from controller.db.models import (
    Activation,
    Assignment,
    Bundle,
    Event,
    Node,
    Rollout,
    RolloutStratum,
    StableVersion,
    utcnow,
)
from controller.desired.effects import UNVERIFIED_SERVE, AssignmentView, RowFacts, heartbeat_effects
from controller.desired.generation import PatchRow, changed
from controller.plan import PlanSpec, load_plan
from kernelctl import wire
from kernelctl.vocab import CANARY_PHASES, stratum_key

CPU_CUDA = frozenset({"", "none", "unknown", "cpu"})
log = logging.getLogger(__name__)


def canary_rank(rollout_id: int, node_name: str) -> str:
    """Deterministic, rollout-specific order of nodes (different rollouts pick different first canaries)."""
    return hashlib.sha256(f"{rollout_id}:{node_name}".encode()).hexdigest()


@dataclass
class StepAssignment:
    """Outcome of sizing one stratum's step: requested vs assigned canaries and any blast-radius clamp."""

    stratum: str
    step_index: int
    eligible: int
    requested: int
    assigned: int
    added: list[str] = field(default_factory=list)
    clamp: dict[str, Any] | None = None

    def as_evidence(self) -> dict[str, Any]:
        d = asdict(self)
        d["added"] = len(self.added)
        return d


def nonstable_node_ids(session: Session) -> set[int]:
    """Nodes currently asked to run a candidate of any active rollout."""
    return set(session.scalars(
        select(Assignment.node_id).where(Assignment.rollout_id.is_not(None)).distinct()))


def rollout_canaries(session: Session, rollout_id: int) -> dict[int, str]:
    """node_id -> stratum of every current canary of a rollout."""
    rows = session.execute(
        select(Node.id, Node.arch, Node.driver_version, Node.triton_version)
        .join(Assignment, Assignment.node_id == Node.id)
        .where(Assignment.rollout_id == rollout_id)
    )
    return {r[0]: stratum_key(r[1], r[2], r[3]) for r in rows}


def assign_step(
    session: Session, rollout: Rollout, strata: list[RolloutStratum], plan: PlanSpec, *, now: dt.datetime,
    fleet: list[NodeInfo] | None = None,
) -> dict[str, StepAssignment]:
    """Bring each given stratum to its step's canary count (never shrinks), honouring the blast radius."""
    fleet = cached_fleet(session) if fleet is None else fleet
    by_id = {n.id: n for n in fleet}
    active = [n for n in fleet if n.state == "active"]
    eligible = eligible_by_stratum(rollout.bundle, active)
    nonstable = nonstable_node_ids(session)
    mine = rollout_canaries(session, rollout.id)
    fleet_cap = max(1, math.floor(plan.max_fleet_share * len(active)))
    label_total: Counter[tuple[str, str]] = Counter()
    for n in active:
        for key in plan.blast_radius_labels:
            if key in n.labels:
                label_total[(key, str(n.labels[key]))] += 1
    label_used: Counter[tuple[str, str]] = Counter()
    for nid in nonstable:
        n = by_id.get(nid)
        if n is not None:
            for key in plan.blast_radius_labels:
                if key in n.labels:
                    label_used[(key, str(n.labels[key]))] += 1

    def label_cap(k: tuple[str, str]) -> int:
        return max(1, math.floor(plan.max_label_share * label_total[k]))

    out: dict[str, StepAssignment] = {}
    for row in strata:
        step = plan.steps[min(row.step_index, len(plan.steps) - 1)]
        pool = eligible.get(row.stratum, [])
        requested = step.target(len(pool))
        current = [nid for nid, s in mine.items() if s == row.stratum and by_id[nid].state == "active"]
        result = StepAssignment(row.stratum, row.step_index, len(pool), requested, len(current))
        limited: list[str] = []
        added: list[NodeInfo] = []
        if len(current) < requested:
            have = set(mine)
            for n in sorted(pool, key=lambda n: canary_rank(rollout.id, n.name)):
                if len(current) + len(added) >= requested:
                    break
                if n.id in have:
                    continue
                new_to_fleet = n.id not in nonstable
                if new_to_fleet and len(nonstable) + 1 > fleet_cap:
                    limited.append(f"max_fleet_share {plan.max_fleet_share:g} (cap {fleet_cap} of "
                                   f"{len(active)} active nodes)")
                    break
                keys = [(k, str(n.labels[k])) for k in plan.blast_radius_labels if k in n.labels]
                over = [k for k in keys if new_to_fleet and label_used[k] + 1 > label_cap(k)]
                if over:
                    k = over[0]
                    msg = (f"max_label_share {plan.max_label_share:g} on {k[0]}={k[1]} "
                           f"(cap {label_cap(k)} of {label_total[k]})")
                    if msg not in limited:
                        limited.append(msg)
                    continue
                added.append(n)
                if new_to_fleet:
                    nonstable.add(n.id)
                    for k in keys:
                        label_used[k] += 1
        result.added = [n.name for n in added]
        result.assigned = len(current) + len(added)
        if result.assigned < requested:
            result.clamp = {"requested": requested, "assigned": result.assigned, "limited_by": limited}
        for n in added:
            mine[n.id] = row.stratum
        _set_candidate(session, [n.id for n in added], rollout, row.baseline_bundle_id, now)
        out[row.stratum] = result
    return out


def _set_candidate(session: Session, node_ids: list[int], rollout: Rollout, baseline_id: int | None,
                   now: dt.datetime) -> None:
    if not node_ids:
        return
    # in node id order: the INSERT's foreign-key checks lock each node row (FOR KEY SHARE) in the order given, and
    # the liveness flush locks node rows in id order (a 10,000-node baseline rollout deadlocked with it)
    node_ids = sorted(node_ids)
    changed(session)
    name = rollout.bundle.name
    existing = set(session.scalars(select(Assignment.node_id).where(
        Assignment.bundle_name == name, Assignment.node_id.in_(node_ids))))
    values = {"desired_bundle_id": rollout.bundle_id, "rollout_id": rollout.id,
              "stable_bundle_id": baseline_id, "phase": "staged", "phase_at": now, "updated_at": now}
    if existing:
        session.execute(update(Assignment).where(Assignment.bundle_name == name,
                                                 Assignment.node_id.in_(existing)).values(**values),
                        execution_options={"synchronize_session": False})
    missing = [nid for nid in node_ids if nid not in existing]
    if missing:
        session.execute(insert(Assignment), [
            {"node_id": nid, "bundle_name": name, "staged": {"versions": []}, **values} for nid in missing])


def revert_to_stable(session: Session, rollout_id: int, strata: set[str] | None, *, now: dt.datetime) -> int:
    """Switch canaries of a rollout (all, or those in ``strata``) back to their stable version at once.

    Declares the rows it switched (``controller.desired.generation.changed``): replicas patch them into their
    snapshot, so a rollback wakes its canaries' watches without a reload."""
    where = [Assignment.rollout_id == rollout_id]
    if strata is not None:
        ids = [nid for nid, s in rollout_canaries(session, rollout_id).items() if s in strata]
        if not ids:
            return 0
        where.append(Assignment.node_id.in_(ids))
    # Lock the rows in (node_id, bundle_name) order first, the order every other writer of many assignments
    # takes (switch batches, the liveness flush): an UPDATE alone locks them in scan order and deadlocks with a
    # switch batch of the same canaries. Every canary of the rollout, not only these strata's: the tick rolls
    # strata back one call at a time in one transaction, and strata's ids interleave (locking each stratum's in
    # order still deadlocked with the liveness flush, three times in one 10,000-node run).
    session.execute(select(Assignment.node_id).where(Assignment.rollout_id == rollout_id)
                    .order_by(Assignment.node_id, Assignment.bundle_name).with_for_update(key_share=True)).all()
    stmt = update(Assignment).where(*where)
    reverted = session.execute(
        stmt.values(desired_bundle_id=Assignment.stable_bundle_id, rollout_id=None, phase=None, phase_at=now,
                    updated_at=now).returning(Assignment.node_id, Assignment.bundle_name, Assignment.stable_bundle_id),
        execution_options={"synchronize_session": False}).all()
    rows: dict[int, dict[str, PatchRow]] = {}
    for nid, name, stable in reverted:
        rows.setdefault(nid, {})[name] = PatchRow(AssignmentView(name, stable, stable, None, None))
    changed(session, rows=rows)
    return len(reverted)


def make_stable(session: Session, rollout: Rollout, stratum: str, *, now: dt.datetime,
                fleet: list[NodeInfo] | None = None) -> int:
    """Candidate becomes the stable version of ``stratum``: stable_versions row, every eligible node's assignment."""
    bundle = rollout.bundle
    sv = session.scalar(select(StableVersion).where(StableVersion.bundle_name == bundle.name,
                                                    StableVersion.stratum == stratum))
    if sv is None:
        session.add(StableVersion(bundle_name=bundle.name, stratum=stratum, bundle_id=bundle.id, since=now,
                                  rollout_id=rollout.id))
    else:
        sv.bundle_id, sv.since, sv.rollout_id = bundle.id, now, rollout.id
    ids = [nid for nid, s in rollout_canaries(session, rollout.id).items() if s == stratum]
    targets = bundle_targets(bundle)
    fleet = cached_fleet(session) if fleet is None else fleet
    ids += [n.id for n in fleet if n.stratum == stratum and node_rejection(targets, n) is None]
    ids = sorted(set(ids))
    changed(session)
    if not ids:
        return 0
    values = {"stable_bundle_id": bundle.id, "desired_bundle_id": bundle.id, "rollout_id": None, "phase": None,
              "updated_at": now}
    existing = set(session.scalars(select(Assignment.node_id).where(
        Assignment.bundle_name == bundle.name, Assignment.node_id.in_(ids))))
    if existing:
        session.execute(update(Assignment).where(Assignment.bundle_name == bundle.name,
                                                 Assignment.node_id.in_(existing))
                        .where((Assignment.rollout_id.is_(None)) | (Assignment.rollout_id == rollout.id))
                        .values(**values), execution_options={"synchronize_session": False})
    missing = [nid for nid in ids if nid not in existing]
    if missing:
        session.execute(insert(Assignment), [
            {"node_id": nid, "bundle_name": bundle.name, "staged": {"versions": []}, **values} for nid in missing])
    return len(ids)


# ------------------------------------------------------------------------------------------ desired state
def _ref(b: Bundle) -> wire.BundleRef:
    return wire.BundleRef(name=b.name, version=b.version, digest=b.digest)


def is_cpu(cuda_version: str | None, gpu_name: str) -> bool:
    """A node without a GPU (the one rule: the stored node, the snapshot and a new node's view use it)."""
    return str(cuda_version).lower() in CPU_CUDA or gpu_name.lower().startswith("cpu")


def is_cpu_node(node: Node) -> bool:
    return is_cpu(node.cuda_version, node.gpu_name)


def trial_shapes(manifest: dict[str, Any], plan: PlanSpec, *, cpu: bool) -> tuple[list[int], list[int]]:
    """Batch sizes and prefill tokens from the bundle's traffic profile (capped by the plan on CPU nodes)."""
    traffic = manifest.get("traffic") or {}
    batches = [int(x) for x in traffic.get("decode_batch_sizes", [])]
    prefill = [int(x) for x in traffic.get("prefill_tokens", [])]
    if cpu:
        batches = [x for x in batches if x <= plan.cpu_max_batch] or batches[:1]
        prefill = [x for x in prefill if x <= plan.cpu_max_prefill] or prefill[:1]
    return batches, prefill


def _sync_stable(session: Session, node: Node, rows: dict[str, Assignment], now: dt.datetime) -> None:
    """Give the node its stratum's stable versions (new nodes, promotions that happened while it was away)."""
    stratum = node_stratum(node)
    stables = session.execute(select(StableVersion.bundle_name, StableVersion.bundle_id)
                              .where(StableVersion.stratum == stratum)).all()
    if not stables:
        return
    bundles = {b.id: b for b in session.scalars(select(Bundle).where(Bundle.id.in_([s[1] for s in stables])))}
    for name, bid in stables:
        a = rows.get(name)
        if a is not None and (a.rollout_id is not None or a.stable_bundle_id == bid):
            continue
        if node_rejection(bundle_targets(bundles[bid]), node) is not None:
            continue
        if a is None:
            a = Assignment(node_id=node.id, bundle_name=name, staged={"versions": []}, updated_at=now)
            session.add(a)
            rows[name] = a
        a.stable_bundle_id = bid
        a.desired_bundle_id = bid
        a.updated_at = now
        changed(session)


def trial_first(session: Session, rollout_ids: set[int]) -> dict[int, bool]:
    """rollout id -> whether its plan needs a verified trial before a canary serves (not ``serve_before_trial``)."""
    if not rollout_ids:
        return {}
    return {rid: not load_plan(plan).serve_before_trial
            for rid, plan in session.execute(select(Rollout.id, Rollout.plan).where(Rollout.id.in_(rollout_ids)))}


def advance_phases(session: Session, node: Node, rows: dict[str, Assignment], reported: Mapping[str, int | None],
                   now: dt.datetime) -> None:
    """The single-row writer of :func:`controller.desired.effects.heartbeat_effects`: store what the node
    reports active (``reported``: bundle name -> bundle id) and the canary phase that follows from it.

    A switch closes the open ``activations`` row and opens one (event ``assignment.activated`` or
    ``deactivated``); a candidate that becomes serving tags its activation with the rollout and the time its
    pre-serve trial was accepted (None when the plan served it before its trial), so the audit tells a
    verified serve from an unverified one. A claim the rule refuses (an unverified candidate reported active)
    is written as a ``security.unverified_serve`` event and logged; the phase stays.
    """
    plans = trial_first(session, {a.rollout_id for a in rows.values() if a.rollout_id is not None})
    facts = {name: RowFacts(name, a.active_bundle_id, a.desired_bundle_id, a.stable_bundle_id, a.rollout_id, a.phase,
                            a.phase_at, plans.get(a.rollout_id, True) if a.rollout_id is not None else True)
             for name, a in rows.items()}
    effects = heartbeat_effects(facts, reported, now)
    refs: dict[int, str] = {}

    def ref(bid: int | None) -> str | None:
        if bid is None:
            return None
        if bid not in refs:
            b = session.get(Bundle, bid)
            refs[bid] = b.ref if b is not None else str(bid)
        return refs[bid]

    actor = f"node:{node.name}"
    for name, e in effects.rows.items():
        a = rows[name]
        if e.refused:
            log.warning("security: %s: %s", actor, e.refused)
            record_event(session, actor=actor, action=UNVERIFIED_SERVE, subject=actor, node=node.name,
                         bundle=ref(e.row.active_id), rollout_id=a.rollout_id, reason=e.refused)
        if not e.changed:
            continue
        # declared as the batch writer declares it (controller.switches): replicas patch, no reload
        changed(session, rows={node.id: {name: PatchRow(e.row.view, e.row.active_id)}})
        a.phase, a.phase_at = e.row.phase, e.row.phase_at
        if e.switched:
            a.active_bundle_id, a.updated_at = e.row.active_id, now
            session.execute(update(Activation).where(Activation.node_id == node.id, Activation.bundle_name == name,
                                                     Activation.ended_at.is_(None)).values(ended_at=now),
                            execution_options={"synchronize_session": False})
            if e.row.active_id is not None:
                rid, vat = e.tag if e.tag is not None else (None, None)
                session.add(Activation(node_id=node.id, bundle_id=e.row.active_id, bundle_name=name, started_at=now,
                                       rollout_id=rid, verified_at=vat))
                record_event(session, actor=actor, action="assignment.activated", subject=actor,
                             bundle=ref(e.row.active_id), node=node.name, payload={"previous": ref(e.previous_id)})
            else:
                record_event(session, actor=actor, action="assignment.deactivated", subject=actor,
                             bundle=ref(e.previous_id), node=node.name, payload={})
        elif e.tag is not None:
            session.execute(
                update(Activation).where(Activation.node_id == node.id, Activation.bundle_name == name,
                                         Activation.bundle_id == e.row.active_id, Activation.ended_at.is_(None))
                .values(rollout_id=e.tag[0], verified_at=e.tag[1]), execution_options={"synchronize_session": False})


def mark_verified(session: Session, node: Node, rollout_ids: set[int], now: dt.datetime) -> list[int]:
    """Trial before serve: the node's ``staged`` canaries of ``rollout_ids`` become ``verified``.

    ``rollout_ids``: rollouts for which report ingestion just accepted a hard-gates-passed (``ok``) report
    from ``node``. A stratum with a hard failure (``first_failure_at`` set, by any node) is never verified:
    it is being rolled back. Returns the rollouts whose canary on this node was verified.
    """
    return mark_verified_many(session, [(node, rollout_ids)], now).get(node.id, [])


def mark_verified_many(session: Session, wanted: Sequence[tuple[Node, set[int]]], now: dt.datetime
                       ) -> dict[int, list[int]]:
    """:func:`mark_verified` for many nodes at once (report intake's group commit): one read of the canaries
    to verify, one UPDATE of their rows (executemany, in (node id, bundle) order: the order every writer of many
    nodes' assignments locks them in, ``controller.desired.liveness``), one INSERT of their events. Returns node
    id -> the rollouts whose canary on that node was verified."""
    rids_of = {node.id: set(rids) for node, rids in wanted if rids}
    if not rids_of:
        return {}
    nodes = {node.id: node for node, _rids in wanted}
    stratum_of = {nid: node_stratum(nodes[nid]) for nid in rids_of}
    rows = session.execute(
        select(Assignment, RolloutStratum.stratum, Bundle.name, Bundle.version)
        .join(Bundle, Bundle.id == Assignment.desired_bundle_id)
        .join(RolloutStratum, and_(RolloutStratum.rollout_id == Assignment.rollout_id,
                                   RolloutStratum.stratum.in_(sorted(set(stratum_of.values())))))
        .where(Assignment.node_id.in_(sorted(rids_of)),
               Assignment.rollout_id.in_(sorted(set().union(*rids_of.values()))),
               or_(Assignment.phase == "staged", Assignment.phase.is_(None)), RolloutStratum.first_failure_at.is_(None),
               RolloutStratum.state.in_(("progressing", "paused")))
        .order_by(Assignment.node_id, Assignment.bundle_name)
    ).all()
    done: dict[int, list[int]] = {}
    updates: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    patch: dict[int, dict[str, PatchRow]] = {}
    for a, stratum, name, version in rows:
        nid = a.node_id
        if stratum != stratum_of[nid] or a.rollout_id not in rids_of[nid]:
            continue  # another node's stratum, or a rollout this node's reports did not verify
        for key, value in (("phase", "verified"), ("phase_at", now), ("updated_at", now)):
            set_committed_value(a, key, value)  # the session's object as the UPDATE below leaves the row
        updates.append({"a_id": a.id, "phase": "verified", "phase_at": now, "updated_at": now})
        done.setdefault(nid, []).append(int(a.rollout_id))  # type: ignore[arg-type]
        patch.setdefault(nid, {})[a.bundle_name] = PatchRow(AssignmentView(
            a.bundle_name, a.desired_bundle_id, a.stable_bundle_id, a.rollout_id, "verified"))
        node = nodes[nid].name
        events.append(event_row(at=utcnow(), actor=f"node:{node}", action="assignment.verified",
                                subject=f"node:{node}", bundle=f"{name}@{version}", node=node, rollout_id=a.rollout_id,
                                reason="pre-serve trial passed the hard gates on this node: it may serve the candidate"))
    if updates:
        conn = session.connection()
        conn.execute(update(Assignment).where(Assignment.id == bindparam("a_id")).values(
            phase=bindparam("phase"), phase_at=bindparam("phase_at"), updated_at=bindparam("updated_at")), updates)
        conn.execute(insert(Event), events)
        changed(session, rows=patch)
    return done


def build_desired(rows: list[AssignmentView], *, refs: Mapping[int, wire.BundleRef],
                  manifests: Mapping[int, dict[str, Any]], plans: Mapping[int, PlanSpec],
                  strata_state: Mapping[int, str], stratum: str,
                  cpu: bool) -> list[wire.DesiredBundle]:
    """The heartbeat reply's desired state from a node's assignment rows (pure: no database).

    ``refs``/``manifests``: bundle id -> reference / manifest; ``plans``: rollout id -> plan of a live rollout;
    ``strata_state``: rollout id -> state of the node's stratum in that rollout. Shared by the database path
    (:func:`desired_state`) and the per-generation snapshot of ``controller.desired``, so both answer the same.
    """
    out: list[wire.DesiredBundle] = []
    for a in sorted(rows, key=lambda r: r.bundle_name):
        if a.desired_id is None:
            continue  # first rollout rolled back: nothing to run, serving code uses its fallback
        desired = refs[a.desired_id]
        stable = refs.get(a.stable_id) if a.stable_id is not None else None
        candidate = a.rollout_id is not None and a.desired_id != a.stable_id
        trial = None
        plan = plans.get(a.rollout_id) if candidate and a.rollout_id is not None else None
        if plan is not None and strata_state.get(a.rollout_id) in ("progressing", "paused"):  # type: ignore[arg-type]
            batches, prefill = trial_shapes(manifests[a.desired_id], plan, cpu=cpu)
            trial = wire.TrialSpec(
                rollout_id=a.rollout_id, stratum=stratum, candidate=desired, stable=stable,  # type: ignore[arg-type]
                batch_sizes=batches, prefill_tokens=prefill, rounds=plan.trial_rounds,
                interval_seconds=plan.trial_interval_seconds, memory_margin=plan.memory_margin,
                launch_gate=plan.launch_gate)
        serve = not candidate or plan is None or plan.serve_before_trial or a.phase in ("verified", "serving")
        active = desired if serve else stable
        out.append(wire.DesiredBundle(
            name=a.bundle_name, active=active, stable=stable, role="candidate" if candidate else "stable",
            trial=trial,
            phase=a.phase if candidate and a.phase in CANARY_PHASES else None))  # type: ignore[arg-type]
    return out


def desired_state(session: Session, node: Node, *, now: dt.datetime | None = None,
                  rows: dict[str, Assignment] | None = None) -> list[wire.DesiredBundle]:
    """What the node should run for each bundle name (the heartbeat reply).

    A canary's candidate is the active version only once it is ``verified`` or ``serving`` on this node (or
    the plan says ``serve_before_trial``); until then the stable version stays active (none when the bundle
    has no stable version) and the candidate is staged for its trial. ``rows`` (the node's assignments by
    bundle name) saves a query when the caller already loaded them.
    """
    now = now or dt.datetime.now(dt.timezone.utc)
    if rows is None:
        rows = {a.bundle_name: a for a in session.scalars(select(Assignment).where(Assignment.node_id == node.id))}
    _sync_stable(session, node, rows, now)
    ids = {i for a in rows.values() for i in (a.desired_bundle_id, a.stable_bundle_id) if i is not None}
    bundles = {i: b for i in ids if (b := session.get(Bundle, i)) is not None}  # identity map first
    rollout_ids = {a.rollout_id for a in rows.values() if a.rollout_id is not None}
    rollouts = {r.id: r for r in session.scalars(select(Rollout).where(Rollout.id.in_(rollout_ids)))} \
        if rollout_ids else {}
    stratum = node_stratum(node)
    strata_state: dict[int, str] = {}
    if rollout_ids:
        strata_state = dict(session.execute(
            select(RolloutStratum.rollout_id, RolloutStratum.state)
            .where(RolloutStratum.rollout_id.in_(rollout_ids), RolloutStratum.stratum == stratum)).all())
    views = [AssignmentView(a.bundle_name, a.desired_bundle_id, a.stable_bundle_id, a.rollout_id, a.phase)
             for a in rows.values()]
    return build_desired(views, refs={i: _ref(b) for i, b in bundles.items()},
                         manifests={i: b.manifest for i, b in bundles.items()},
                         plans={rid: load_plan(r.plan) for rid, r in rollouts.items()}, strata_state=strata_state,
                         stratum=stratum, cpu=is_cpu_node(node))


def canary_counts(session: Session, rollout_ids: list[int]) -> dict[tuple[int, str], int]:
    """(rollout_id, stratum) -> number of current non-stale canaries (one GROUP BY query)."""
    if not rollout_ids:
        return {}
    counts: dict[tuple[int, str], int] = defaultdict(int)
    for rid, arch, drv, tri, n in session.execute(
        select(Assignment.rollout_id, Node.arch, Node.driver_version, Node.triton_version, func.count())
        .join(Node, Node.id == Assignment.node_id)
        .where(Assignment.rollout_id.in_(rollout_ids), Node.state == "active")
        .group_by(Assignment.rollout_id, Node.arch, Node.driver_version, Node.triton_version)
    ):
        counts[(rid, stratum_key(arch, drv, tri))] += n
    return dict(counts)
