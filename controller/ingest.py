"""Report ingestion: validate a batch against the changelog, then store it in one bulk statement.

Each report's judged signals (per-cell latency, traffic-weighted aggregate, end-to-end, memory and launches
per cell: :mod:`controller.signals`) are computed here once and stored in ``reports.signals``.
Idempotent by ``idempotency_key``: ``INSERT ... ON CONFLICT DO NOTHING RETURNING`` stores only keys not seen
before (safe under concurrent replays on PostgreSQL), so a replayed or partially seen batch counts each
report once. A report that breaks a hard gate sets ``rollout_strata.first_failure_at`` (when unset): the
start of the time-to-rollback clock. A newly accepted ``ok`` report verifies the node's staged canary of
that rollout (trial before serve: ``controller.assignments.mark_verified``).

No per-report round trips: one statement reads what the batch's rollouts are for this node (state, bundle,
the node's stratum there, its assignment), one inserts the batch; ``mark_verified`` runs only while the
node's canary is still unverified, the stable-bundle lookup only for a stable version other than the one the
node's assignment names. :func:`ingest_batch` (the API's path) screens and stores with that one lookup;
:func:`screen_reports` keeps only reports from current canaries of live rollouts, :func:`ingest_reports`
stores a batch without screening.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any, NamedTuple

from pydantic_core import to_json
from sqlalchemy import and_, bindparam, select, update
from sqlalchemy.dialects import sqlite
from sqlalchemy.orm import Session, aliased

from controller.assignments import mark_verified
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


# built once (building a select costs more than running it): the batch's rollouts as one node sees them
FACTS = (
    select(Rollout.id, Rollout.state, Bundle.id, Bundle.name, Bundle.version, Bundle.digest, RolloutStratum.state,
           Assignment.id, Assignment.desired_bundle_id, Assignment.phase,
           STABLE.id, STABLE.name, STABLE.version, STABLE.digest)
    .join(Bundle, Bundle.id == Rollout.bundle_id)
    .outerjoin(RolloutStratum, and_(RolloutStratum.rollout_id == Rollout.id,
                                    RolloutStratum.stratum == bindparam("stratum")))
    .outerjoin(Assignment, and_(Assignment.rollout_id == Rollout.id, Assignment.node_id == bindparam("node_id")))
    .outerjoin(STABLE, STABLE.id == Assignment.stable_bundle_id)
    .where(Rollout.id.in_(bindparam("rids", expanding=True)))
)


def rollout_facts(session: Session, node: Node, rids: Sequence[int]) -> dict[int, RolloutFacts]:
    """What ``node`` is in each of the rollouts ``rids`` (absent: the rollout does not exist)."""
    out: dict[int, RolloutFacts] = {}
    session.flush()  # (a Core execution does not autoflush)
    rows = session.connection().execute(FACTS, {"stratum": node_stratum(node), "node_id": node.id,
                                                "rids": sorted(set(rids))})
    for rid, state, bid, name, version, digest, st, aid, desired, phase, sid, sname, sversion, sdigest in rows:
        out[rid] = RolloutFacts(
            state=state, bundle_id=bid, bundle=(name, version, digest), stratum_state=st,
            canary=aid is not None and desired == bid, phase=phase, assigned=aid is not None,
            stable=(sid, (sname, sversion, sdigest)) if sid is not None else None)
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


def ingest_batch(session: Session, node: Node, batch: wire.ReportBatch, now: dt.datetime
                 ) -> tuple[int, int, dict[str, tuple[str, str]]]:
    """:func:`screen_reports` then :func:`ingest_reports` of what it keeps, on one read of the rollouts;
    returns (accepted, duplicates, refused). Nothing is stored when every report is refused."""
    if batch.node_name != node.name:
        raise Invalid(f"batch is for node {batch.node_name} but was sent by node {node.name}")
    facts = rollout_facts(session, node, [r.rollout_id for r in batch.reports])
    keep, refused = _screen(node, batch.reports, facts)
    if not keep:
        return 0, 0, refused
    accepted, duplicates = _store(session, node, keep, facts, now)
    return accepted, duplicates, refused


def ingest_reports(session: Session, node: Node, batch: wire.ReportBatch, now: dt.datetime) -> tuple[int, int]:
    """Store a batch of trial reports from ``node``; returns (accepted, duplicates).

    Refuses (Invalid, nothing stored) a batch naming another node, a report for an unknown rollout, for a
    rollout whose strata do not include this node's stratum, or whose candidate is not the rollout's bundle.
    """
    if batch.node_name != node.name:
        raise Invalid(f"batch is for node {batch.node_name} but was sent by node {node.name}")
    facts = rollout_facts(session, node, [r.rollout_id for r in batch.reports])
    return _store(session, node, batch.reports, facts, now)


def _stable_ids(session: Session, reports: Sequence[wire.TrialReport], facts: dict[int, RolloutFacts]
                ) -> dict[BundleKey, int]:
    """Bundle ids of the reports' stable versions: the node's assignments name them; a lookup for others."""
    known = {key: bid for f in facts.values() if f.stable is not None for bid, key in [f.stable]}
    refs = {(r.stable.name, r.stable.version, r.stable.digest) for r in reports if r.stable} - known.keys()
    if refs:
        for bid, name, version, digest in session.execute(
            select(Bundle.id, Bundle.name, Bundle.version, Bundle.digest)
            .where(Bundle.digest.in_(sorted({d for _, _, d in refs})))):
            known[(name, version, digest)] = bid
    return known


def _store(session: Session, node: Node, reports: Sequence[wire.TrialReport], facts: dict[int, RolloutFacts],
           now: dt.datetime) -> tuple[int, int]:
    stratum = node_stratum(node)
    for i, r in enumerate(reports):  # every report is checked before anything is stored
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
    stable_ids = _stable_ids(session, reports, facts)
    unique: list[wire.TrialReport] = []
    seen: set[str] = set()
    for r in reports:
        if r.idempotency_key not in seen:
            seen.add(r.idempotency_key)
            unique.append(r)
    outcomes = [effective_outcome(r) for r in unique]
    signals = iter(batch_signals([r for r, o in zip(unique, outcomes, strict=True) if o == "ok"]))
    rows: list[dict[str, Any]] = []
    failing = False
    for r, outcome in zip(unique, outcomes, strict=True):
        f = facts[r.rollout_id]
        if outcome in OUTCOME_GATE and f.stratum_state in LIVE:
            failing = True
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
    inserted = _insert_new(session, rows)
    accepted = len(inserted)
    new = [row for row in rows if row["idempotency_key"] in inserted]
    if failing and inserted:
        new_fail = {(row["rollout_id"], row["stratum"]) for row in new if row["outcome"] in OUTCOME_GATE}
        for rid, s in sorted(new_fail):
            session.execute(
                update(RolloutStratum)
                .where(RolloutStratum.rollout_id == rid, RolloutStratum.stratum == s,
                       RolloutStratum.first_failure_at.is_(None), RolloutStratum.state.in_(LIVE))
                .values(first_failure_at=now),
                execution_options={"synchronize_session": False})
    _verify_canaries(session, node, new, facts, now)
    return accepted, len(reports) - accepted


def _pairs(r: wire.TrialReport) -> int:
    """Timed calls of the stable arm (or older agents' per-round pairs), either encoding."""
    cells = r.columns.cells if r.columns is not None else None
    return len(r.latency) + sum(c.stable.n for c in r.cells) + (sum(cells.stable.n) if cells is not None else 0)


def _verify_canaries(session: Session, node: Node, new: list[dict[str, Any]], facts: dict[int, RolloutFacts],
                     now: dt.datetime) -> None:
    """Trial before serve: a newly accepted hard-gates-passed report lets this node serve the candidate.
    Skipped for rollouts where the node's assignment (as read with the batch) is already past ``staged``."""
    bad = {row["rollout_id"] for row in new if row["outcome"] != "ok"}
    ok = {row["rollout_id"] for row in new if row["outcome"] == "ok"} - bad
    # mark_verified declares the rows it verified: replicas patch them in (the node's watch answers at once)
    mark_verified(session, node, {rid for rid in ok if facts[rid].assigned and facts[rid].phase in UNVERIFIED}, now)
