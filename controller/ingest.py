"""Report ingestion: validate batches against the changelog, then store them in one bulk statement.

Each report's judged signals (per-cell latency, traffic-weighted aggregate, end-to-end, memory and launches
per cell: :mod:`controller.signals`) are computed here once and stored in ``reports.signals``.
Idempotent by ``idempotency_key``: ``INSERT ... ON CONFLICT DO NOTHING RETURNING`` stores only keys not seen
before (safe under concurrent replays on PostgreSQL), so a replayed or partially seen batch counts each
report once. A report that breaks a hard gate sets ``rollout_strata.first_failure_at`` (when unset): the
start of the time-to-rollback clock. A newly accepted ``ok`` report verifies the node's staged canary of
that rollout (trial before serve: ``controller.assignments.mark_verified_many``).

Set-based: :func:`ingest_many` stores the batches of many requests (many nodes: the report group commit,
``controller.intake.store_many``) with the statements of one: one read per stratum of what the batches'
rollouts are for their nodes (state, bundle, the node's stratum there, its assignment), one insert of every
batch's new rows; ``mark_verified_many`` only while a node's canary is still unverified, the stable-bundle
lookup only for stable versions other than the ones the nodes' assignments name. Each batch is screened and
checked on its own (a batch refused with ``Invalid`` stores nothing, the others are stored) and answered on
its own; a key sent in two batches of one call counts for the first (the second sees a duplicate, as it would
one request later). Within one call the hard failures are applied before the verifications (as within one
batch): a canary whose stratum fails in the same call is not verified. :func:`ingest_batch` (one request) and
:func:`ingest_reports` (a batch without screening) are calls of one batch; :func:`screen_reports` keeps only
reports from current canaries of live rollouts.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any, NamedTuple

from pydantic_core import to_json
from sqlalchemy import and_, bindparam, select, update
from sqlalchemy.dialects import sqlite
from sqlalchemy.orm import Session, aliased

from controller.assignments import mark_verified_many
from controller.compat import node_stratum
from controller.db.models import Assignment, Bundle, Node, Report, Rollout, RolloutStratum, as_utc
from controller.errors import Invalid
from controller.gates import OUTCOME_GATE, effective_outcome, numerics_summary
from controller.numeric_detail import failed_checks
from controller.signals import batch_signals
from kernelctl import wire

LIVE = ("progressing", "paused", "pending")
CANARY_LIVE = ("progressing", "paused")  # a rollout (and stratum) with canaries that may report
UNVERIFIED = ("staged", None)  # assignment phases mark_verified moves on


COLUMNS = ("idempotency_key", "node_id", "rollout_id", "stratum", "bundle_id", "stable_bundle_id", "outcome",
           "latency_log_ratio", "n_pairs", "peak_memory_bytes", "measured_at", "received_at", "detail", "signals")
PG_TYPES = ("varchar", "bigint", "bigint", "varchar", "bigint", "bigint", "varchar", "float8", "integer", "bigint",
            "timestamptz", "timestamptz", "json", "json")
PG_INSERT = (
    f"INSERT INTO reports ({', '.join(COLUMNS)}) SELECT {', '.join(COLUMNS)} "
    f"FROM json_to_recordset(CAST(%(rows)s AS json)) AS x("
    f"{', '.join(f'{c} {t}' for c, t in zip(COLUMNS, PG_TYPES, strict=True))}) "
    "ON CONFLICT (idempotency_key) DO NOTHING RETURNING idempotency_key"
)

BundleKey = tuple[str, str, str]  # name, version, digest
STABLE = aliased(Bundle, name="stable_bundle")  # built once: an alias costs more to build than the query


class RolloutFacts(NamedTuple):
    """One rollout of a batch as this node's reports see it (read in one statement)."""

    state: str
    bundle_id: int
    bundle: BundleKey
    stratum_state: str | None  # the node's stratum in the rollout; None: the stratum is not part of it
    canary: bool  # the node's assignment of this rollout desires the rollout's bundle
    phase: str | None  # that assignment's trial-before-serve phase
    assigned: bool  # the node has an assignment of this rollout
    stable: tuple[int, BundleKey] | None  # that assignment's stable bundle


# built once (building a select costs more than running it): the batches' rollouts as the nodes of one stratum
# see them; a row per (rollout, assignment of one of the nodes), one with no assignment when none has one
FACTS = (
    select(Rollout.id, Rollout.state, Bundle.id, Bundle.name, Bundle.version, Bundle.digest, RolloutStratum.state,
           Assignment.node_id, Assignment.desired_bundle_id, Assignment.phase,
           STABLE.id, STABLE.name, STABLE.version, STABLE.digest)
    .join(Bundle, Bundle.id == Rollout.bundle_id)
    .outerjoin(RolloutStratum, and_(RolloutStratum.rollout_id == Rollout.id,
                                    RolloutStratum.stratum == bindparam("stratum")))
    .outerjoin(Assignment, and_(Assignment.rollout_id == Rollout.id,
                                Assignment.node_id.in_(bindparam("node_ids", expanding=True))))
    .outerjoin(STABLE, STABLE.id == Assignment.stable_bundle_id)
    .where(Rollout.id.in_(bindparam("rids", expanding=True)))
)


def rollout_facts(session: Session, node: Node, rids: Sequence[int]) -> dict[int, RolloutFacts]:
    """What ``node`` is in each of the rollouts ``rids`` (absent: the rollout does not exist)."""
    return rollout_facts_many(session, [(node, rids)])[node.id]


def rollout_facts_many(session: Session, wanted: Sequence[tuple[Node, Sequence[int]]]
                       ) -> dict[int, dict[int, RolloutFacts]]:
    """:func:`rollout_facts` of many nodes: node id -> rollout id -> facts, one statement per stratum."""
    rids_of: dict[int, set[int]] = {}
    strata: dict[str, list[Node]] = {}
    for node, rids in wanted:
        if node.id not in rids_of:
            rids_of[node.id] = set()
            strata.setdefault(node_stratum(node), []).append(node)
        rids_of[node.id].update(rids)
    out: dict[int, dict[int, RolloutFacts]] = {nid: {} for nid in rids_of}
    session.flush()  # (a Core execution does not autoflush)
    for stratum, nodes in sorted(strata.items()):
        rids = sorted(set().union(*(rids_of[n.id] for n in nodes)))
        if not rids:
            continue
        rollouts: dict[int, tuple[str, int, BundleKey, str | None]] = {}
        assigned: dict[tuple[int, int], tuple[bool, str | None, tuple[int, BundleKey] | None]] = {}
        for rid, state, bid, name, version, digest, st, nid, desired, phase, sid, sname, sversion, sdigest in (
                session.connection().execute(FACTS, {"stratum": stratum, "node_ids": [n.id for n in nodes],
                                                     "rids": rids})):
            rollouts[rid] = (state, bid, (name, version, digest), st)
            if nid is not None:
                stable = (sid, (sname, sversion, sdigest)) if sid is not None else None
                assigned[(nid, rid)] = (desired == bid, phase, stable)
        for n in nodes:
            for rid in rids_of[n.id] & rollouts.keys():
                state, bid, bundle, st = rollouts[rid]
                a = assigned.get((n.id, rid))
                out[n.id][rid] = RolloutFacts(
                    state=state, bundle_id=bid, bundle=bundle, stratum_state=st, canary=a is not None and a[0],
                    phase=a[1] if a else None, assigned=a is not None, stable=a[2] if a else None)
    return out


def _insert_new(session: Session, rows: list[dict[str, Any]]) -> set[str]:
    """Insert the rows whose key is new; return the inserted keys (one statement either backend)."""
    if not rows:
        return set()
    if session.get_bind().dialect.name == "postgresql":
        # the whole batch as one JSON document: one parameter, one statement, no per-row SQL or escaping
        # (pydantic's encoder: the wire's strings are valid Unicode, pydantic refuses a lone surrogate)
        result = session.connection().exec_driver_sql(PG_INSERT, {"rows": to_json(rows).decode()})
        return set(result.scalars().all())
    stmt = sqlite.insert(Report).on_conflict_do_nothing(index_elements=["idempotency_key"]).returning(
        Report.idempotency_key)
    return set(session.execute(stmt, rows).scalars().all())


REFUSAL_REASONS = ("rollout_not_live", "not_canary")


def screen_reports(session: Session, node: Node, batch: wire.ReportBatch
                   ) -> tuple[list[wire.TrialReport], dict[str, tuple[str, str]]]:
    """Which reports of a batch count: only from a current canary of the report's rollout, while it is live.

    Returns the reports that may be ingested and, for the others, ``idempotency_key -> (reason, message)``
    with ``reason`` one of :data:`REFUSAL_REASONS` (a bounded metric label). Reports naming a rollout that
    does not exist pass through: :func:`ingest_reports` refuses the batch for them (422).
    """
    return _screen(node, batch.reports, rollout_facts(session, node, [r.rollout_id for r in batch.reports]))


def _screen(node: Node, reports: Sequence[wire.TrialReport], facts: dict[int, RolloutFacts]
            ) -> tuple[list[wire.TrialReport], dict[str, tuple[str, str]]]:
    keep: list[wire.TrialReport] = []
    refused: dict[str, tuple[str, str]] = {}
    for r in reports:
        f = facts.get(r.rollout_id)
        if f is None:
            keep.append(r)
        elif f.state not in CANARY_LIVE:
            refused[r.idempotency_key] = ("rollout_not_live", f"rollout {r.rollout_id} is {f.state}: reports count "
                                          "only while it is progressing or paused")
        elif not (f.canary and f.stratum_state in CANARY_LIVE):
            refused[r.idempotency_key] = ("not_canary", f"node {node.name} is not a current canary of rollout "
                                          f"{r.rollout_id}")
        else:
            keep.append(r)
    return keep, refused


Result = tuple[int, int, dict[str, tuple[str, str]]]  # accepted, duplicates, refused (key -> (reason, message))


def ingest_batch(session: Session, node: Node, batch: wire.ReportBatch, now: dt.datetime) -> Result:
    """:func:`screen_reports` then :func:`ingest_reports` of what it keeps, on one read of the rollouts;
    returns (accepted, duplicates, refused). Nothing is stored when every report is refused."""
    out = ingest_many(session, [(node, batch)], now)[0]
    if isinstance(out, Invalid):
        raise out
    return out


def ingest_reports(session: Session, node: Node, batch: wire.ReportBatch, now: dt.datetime) -> tuple[int, int]:
    """Store a batch of trial reports from ``node``; returns (accepted, duplicates).

    Refuses (Invalid, nothing stored) a batch naming another node, a report for an unknown rollout, for a
    rollout whose strata do not include this node's stratum, or whose candidate is not the rollout's bundle.
    """
    out = ingest_many(session, [(node, batch)], now, screen=False)[0]
    if isinstance(out, Invalid):
        raise out
    return out[0], out[1]


class _Batch(NamedTuple):
    """One batch of an :func:`ingest_many` call past its screening and checks."""

    node: Node
    reports: list[wire.TrialReport]  # the reports screening kept (a key twice in the batch: twice)
    refused: dict[str, tuple[str, str]]


def ingest_many(session: Session, batches: Sequence[tuple[Node, wire.ReportBatch]], now: dt.datetime, *,
                screen: bool = True) -> list[Result | Invalid]:
    """Many batches (each from its node) screened (``screen``: :func:`screen_reports`'s rule) and stored with
    set-based statements (see the module docstring); one answer per batch: its (accepted, duplicates, refused),
    or the ``Invalid`` that refused it whole (nothing of it stored)."""
    facts = rollout_facts_many(session, [(node, [r.rollout_id for r in b.reports]) for node, b in batches])
    out: list[Result | Invalid | None] = [None] * len(batches)
    kept: dict[int, _Batch] = {}
    for i, (node, batch) in enumerate(batches):
        try:
            if batch.node_name != node.name:
                raise Invalid(f"batch is for node {batch.node_name} but was sent by node {node.name}")
            keep, refused = _screen(node, batch.reports, facts[node.id]) if screen else (list(batch.reports), {})
            _check(node, keep, facts[node.id])
        except Invalid as exc:
            out[i] = exc
            continue
        if keep:
            kept[i] = _Batch(node, keep, refused)
        else:
            out[i] = (0, 0, refused)
    stable_ids = _stable_ids(session, [r for b in kept.values() for r in b.reports],
                             [f for b in kept.values() for f in facts[b.node.id].values()])
    rows: dict[int, list[dict[str, Any]]] = {}
    claimed: set[str] = set()  # a key in two batches: the first one's row (the second sees a duplicate)
    for i, b in kept.items():
        rows[i] = [row for row in _rows(b.node, b.reports, facts[b.node.id], stable_ids, now)
                   if row["idempotency_key"] not in claimed]
        claimed.update(row["idempotency_key"] for row in rows[i])
    inserted = _insert_new(session, [row for i in kept for row in rows[i]])
    new: list[tuple[Node, dict[str, Any]]] = []
    for i, b in kept.items():
        mine = [row for row in rows[i] if row["idempotency_key"] in inserted]
        new.extend((b.node, row) for row in mine)
        out[i] = (len(mine), len(b.reports) - len(mine), b.refused)
    _first_failures(session, [row for node, row in new if facts[node.id][row["rollout_id"]].stratum_state in LIVE],
                    now)
    _verify_canaries(session, new, facts, now)
    done = [o for o in out if o is not None]
    assert len(done) == len(batches)  # each batch answered
    return done


def _check(node: Node, reports: Sequence[wire.TrialReport], facts: dict[int, RolloutFacts]) -> None:
    """Every report of a batch is checked before anything of it is stored (raises ``Invalid``)."""
    stratum = node_stratum(node)
    for i, r in enumerate(reports):
        where = f"report {i} ({r.idempotency_key})"
        f = facts.get(r.rollout_id)
        if f is None:
            raise Invalid(f"{where}: rollout {r.rollout_id} does not exist")
        if (r.candidate.name, r.candidate.version, r.candidate.digest) != f.bundle:
            name, version, digest = f.bundle
            raise Invalid(f"{where}: candidate {r.candidate.name}@{r.candidate.version} is not the bundle of "
                          f"rollout {r.rollout_id} ({name}@{version}, digest {digest[:12]}…)")
        if f.stratum_state is None:
            raise Invalid(f"{where}: node {node.name} (stratum {stratum}) is not part of rollout {r.rollout_id}")
        if r.stratum != stratum:
            raise Invalid(f"{where}: stratum {r.stratum} does not match node {node.name}'s stratum {stratum}")


def _stable_ids(session: Session, reports: Sequence[wire.TrialReport], facts: Sequence[RolloutFacts]
                ) -> dict[BundleKey, int]:
    """Bundle ids of the reports' stable versions: the nodes' assignments name them; a lookup for others."""
    known = {key: bid for f in facts if f.stable is not None for bid, key in [f.stable]}
    refs = {(r.stable.name, r.stable.version, r.stable.digest) for r in reports if r.stable} - known.keys()
    if refs:
        for bid, name, version, digest in session.execute(
            select(Bundle.id, Bundle.name, Bundle.version, Bundle.digest)
            .where(Bundle.digest.in_(sorted({d for _, _, d in refs})))):
            known[(name, version, digest)] = bid
    return known


def _rows(node: Node, reports: Sequence[wire.TrialReport], facts: dict[int, RolloutFacts],
          stable_ids: dict[BundleKey, int], now: dt.datetime) -> list[dict[str, Any]]:
    """The ``reports`` rows of a checked batch, one per key (the first report of a key sent twice)."""
    stratum = node_stratum(node)
    unique: list[wire.TrialReport] = []
    seen: set[str] = set()
    for r in reports:
        if r.idempotency_key not in seen:
            seen.add(r.idempotency_key)
            unique.append(r)
    outcomes = [effective_outcome(r) for r in unique]
    signals = iter(batch_signals([r for r, o in zip(unique, outcomes, strict=True) if o == "ok"]))
    rows: list[dict[str, Any]] = []
    for r, outcome in zip(unique, outcomes, strict=True):
        f = facts[r.rollout_id]
        sig = next(signals) if outcome == "ok" else None
        e2e = None
        if r.e2e is not None:
            e2e = {"stable_s": r.e2e.stable.mean_s, "candidate_s": r.e2e.candidate.mean_s}
        elif r.e2e_stable_s is not None and r.e2e_candidate_s is not None:
            e2e = {"stable_s": r.e2e_stable_s, "candidate_s": r.e2e_candidate_s}
        rows.append({
            "idempotency_key": r.idempotency_key, "node_id": node.id, "rollout_id": r.rollout_id,
            "stratum": stratum, "bundle_id": f.bundle_id,
            "stable_bundle_id": stable_ids.get((r.stable.name, r.stable.version, r.stable.digest)) if r.stable else None,
            "outcome": outcome, "latency_log_ratio": sig["aggregate"]["mean"] if sig and sig["aggregate"] else None,
            "n_pairs": _pairs(r), "peak_memory_bytes": r.peak_memory_bytes,
            "measured_at": as_utc(r.measured_at), "received_at": now,
            "detail": {
                "reported_outcome": r.outcome, "numerics": numerics_summary(r), "e2e": e2e,
                **({"failed_checks": failed} if (failed := failed_checks(r)) else {}),
                "launches_per_call": r.launches_per_call, "duration_s": r.duration_s, "text": r.detail,
            },
            "signals": sig,
        })
    return rows


def _first_failures(session: Session, new: list[dict[str, Any]], now: dt.datetime) -> None:
    """Start the time-to-rollback clock of each live stratum with a newly accepted hard-gate failure."""
    for rid, s in sorted({(row["rollout_id"], row["stratum"]) for row in new if row["outcome"] in OUTCOME_GATE}):
        session.execute(
            update(RolloutStratum)
            .where(RolloutStratum.rollout_id == rid, RolloutStratum.stratum == s,
                   RolloutStratum.first_failure_at.is_(None), RolloutStratum.state.in_(LIVE))
            .values(first_failure_at=now),
            execution_options={"synchronize_session": False})


def _pairs(r: wire.TrialReport) -> int:
    """Timed calls of the stable arm (or older agents' per-round pairs), either encoding."""
    cells = r.columns.cells if r.columns is not None else None
    return len(r.latency) + sum(c.stable.n for c in r.cells) + (sum(cells.stable.n) if cells is not None else 0)


def _verify_canaries(session: Session, new: list[tuple[Node, dict[str, Any]]],
                     facts: dict[int, dict[int, RolloutFacts]], now: dt.datetime) -> None:
    """Trial before serve: a newly accepted hard-gates-passed report lets its node serve the candidate (unless
    the same call brought a new report of another outcome from that node for that rollout). Skipped for
    rollouts where the node's assignment (as read with the batch) is already past ``staged``."""
    nodes = {node.id: node for node, _row in new}
    bad = {(node.id, row["rollout_id"]) for node, row in new if row["outcome"] != "ok"}
    ok = {(node.id, row["rollout_id"]) for node, row in new if row["outcome"] == "ok"} - bad
    wanted: dict[int, set[int]] = {}
    for nid, rid in sorted(ok):
        if facts[nid][rid].assigned and facts[nid][rid].phase in UNVERIFIED:
            wanted.setdefault(nid, set()).add(rid)
    # mark_verified_many declares the rows it verified: replicas patch them in (the node's watch answers at once)
    mark_verified_many(session, [(nodes[nid], rids) for nid, rids in wanted.items()], now)
