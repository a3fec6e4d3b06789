"""Report ingestion: validate a batch against the changelog, then store it in one bulk statement.

Each report's judged signals (per-cell latency, traffic-weighted aggregate, end-to-end, memory and launches
per cell: :mod:`controller.signals`) are computed here once and stored in ``reports.signals``.
Idempotent by ``idempotency_key``: ``INSERT ... ON CONFLICT DO NOTHING RETURNING`` stores only keys not seen
before (safe under concurrent replays on PostgreSQL), so a replayed or partially seen batch counts each
report once. A report that breaks a hard gate sets ``rollout_strata.first_failure_at`` (when unset): the
start of the time-to-rollback clock. A newly accepted ``ok`` report verifies the node's staged canary of
that rollout (trial before serve: ``controller.assignments.mark_verified``). No per-report round trips: the
batch costs a handful of statements. :func:`screen_reports` (called first, by the API) keeps only reports
from current canaries of live rollouts.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

from sqlalchemy import and_, select, update
from sqlalchemy.dialects import sqlite
from sqlalchemy.orm import Session

from controller.assignments import mark_verified
from controller.compat import node_stratum
from controller.db.models import Assignment, Bundle, Node, Report, Rollout, RolloutStratum
from controller.errors import Invalid
from controller.gates import OUTCOME_GATE, as_utc, effective_outcome, numerics_summary
from controller.signals import report_signals
from kernelctl import wire

LIVE = ("progressing", "paused", "pending")
CANARY_LIVE = ("progressing", "paused")  # a rollout (and stratum) with canaries that may report


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


def _json_default(v: object) -> str:
    if isinstance(v, dt.datetime):
        return v.isoformat()
    raise TypeError(f"cannot encode {type(v).__name__}")


def _insert_new(session: Session, rows: list[dict[str, Any]]) -> set[str]:
    """Insert the rows whose key is new; return the inserted keys (one statement either backend)."""
    if not rows:
        return set()
    if session.get_bind().dialect.name == "postgresql":
        # the whole batch as one JSON document: one parameter, one statement, no per-row SQL or escaping
        doc = json.dumps(rows, default=_json_default, separators=(",", ":"))
        result = session.connection().exec_driver_sql(PG_INSERT, {"rows": doc})
        return {k for (k,) in result}
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
    rids = sorted({r.rollout_id for r in batch.reports})
    states = dict(session.execute(select(Rollout.id, Rollout.state).where(Rollout.id.in_(rids))).all())
    stratum = node_stratum(node)
    canary_of = set(session.scalars(
        select(Assignment.rollout_id)
        .join(Rollout, Rollout.id == Assignment.rollout_id)
        .join(RolloutStratum, and_(RolloutStratum.rollout_id == Rollout.id, RolloutStratum.stratum == stratum))
        .where(Assignment.node_id == node.id, Assignment.rollout_id.in_(rids),
               Assignment.desired_bundle_id == Rollout.bundle_id, RolloutStratum.state.in_(CANARY_LIVE))))
    keep: list[wire.TrialReport] = []
    refused: dict[str, tuple[str, str]] = {}
    for r in batch.reports:
        state = states.get(r.rollout_id)
        if state is None:
            keep.append(r)
        elif state not in CANARY_LIVE:
            refused[r.idempotency_key] = ("rollout_not_live", f"rollout {r.rollout_id} is {state}: reports count "
                                          "only while it is progressing or paused")
        elif r.rollout_id not in canary_of:
            refused[r.idempotency_key] = ("not_canary", f"node {node.name} is not a current canary of rollout "
                                          f"{r.rollout_id}")
        else:
            keep.append(r)
    return keep, refused


def ingest_reports(session: Session, node: Node, batch: wire.ReportBatch, now: dt.datetime) -> tuple[int, int]:
    """Store a batch of trial reports from ``node``; returns (accepted, duplicates).

    Refuses (Invalid, nothing stored) a batch naming another node, a report for an unknown rollout, for a
    rollout whose strata do not include this node's stratum, or whose candidate is not the rollout's bundle.
    """
    if batch.node_name != node.name:
        raise Invalid(f"batch is for node {batch.node_name} but was sent by node {node.name}")
    stratum = node_stratum(node)
    rids = sorted({r.rollout_id for r in batch.reports})
    rollouts: dict[int, tuple[int, str, str, str]] = {}
    strata: dict[tuple[int, str], str] = {}
    for rid, bid, name, version, digest, st in session.execute(
        select(Rollout.id, Bundle.id, Bundle.name, Bundle.version, Bundle.digest, RolloutStratum.state)
        .join(Bundle, Bundle.id == Rollout.bundle_id)
        .outerjoin(RolloutStratum, and_(RolloutStratum.rollout_id == Rollout.id, RolloutStratum.stratum == stratum))
        .where(Rollout.id.in_(rids))
    ):
        rollouts[rid] = (bid, name, version, digest)
        if st is not None:
            strata[(rid, stratum)] = st
    stable_refs = {(r.stable.name, r.stable.version, r.stable.digest) for r in batch.reports if r.stable}
    stable_ids: dict[tuple[str, str, str], int] = {}
    if stable_refs:
        for bid, name, version, digest in session.execute(
            select(Bundle.id, Bundle.name, Bundle.version, Bundle.digest)
            .where(Bundle.digest.in_([d for _, _, d in stable_refs]))):
            stable_ids[(name, version, digest)] = bid
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    failing: dict[int, str] = {}
    for i, r in enumerate(batch.reports):
        where = f"report {i} ({r.idempotency_key})"
        if r.rollout_id not in rollouts:
            raise Invalid(f"{where}: rollout {r.rollout_id} does not exist")
        bid, name, version, digest = rollouts[r.rollout_id]
        if (r.candidate.name, r.candidate.version, r.candidate.digest) != (name, version, digest):
            raise Invalid(f"{where}: candidate {r.candidate.name}@{r.candidate.version} is not the bundle of "
                          f"rollout {r.rollout_id} ({name}@{version}, digest {digest[:12]}…)")
        if (r.rollout_id, stratum) not in strata:
            raise Invalid(f"{where}: node {node.name} (stratum {stratum}) is not part of rollout {r.rollout_id}")
        if r.stratum != stratum:
            raise Invalid(f"{where}: stratum {r.stratum} does not match node {node.name}'s stratum {stratum}")
        if r.idempotency_key in seen:
            continue
        seen.add(r.idempotency_key)
        outcome = effective_outcome(r)
        if outcome in OUTCOME_GATE and strata[(r.rollout_id, stratum)] in LIVE:
            failing[r.rollout_id] = stratum
        signals = report_signals(r) if outcome == "ok" else None
        e2e = None
        if r.e2e_stable_s is not None and r.e2e_candidate_s is not None:
            e2e = {"stable_s": r.e2e_stable_s, "candidate_s": r.e2e_candidate_s}
        rows.append({
            "idempotency_key": r.idempotency_key, "node_id": node.id, "rollout_id": r.rollout_id,
            "stratum": stratum, "bundle_id": bid,
            "stable_bundle_id": stable_ids.get((r.stable.name, r.stable.version, r.stable.digest)) if r.stable else None,
            "outcome": outcome, "latency_log_ratio": signals.get("aggregate") if signals else None,
            "n_pairs": len(r.latency), "peak_memory_bytes": r.peak_memory_bytes,
            "measured_at": as_utc(r.measured_at), "received_at": now,
            "detail": {
                "reported_outcome": r.outcome, "numerics": numerics_summary(r), "e2e": e2e,
                "launches_per_call": r.launches_per_call, "duration_s": r.duration_s, "text": r.detail,
            },
            "signals": signals,
        })
    inserted = _insert_new(session, rows)
    accepted = len(inserted)
    if failing and inserted:
        new_fail = {(row["rollout_id"], row["stratum"]) for row in rows
                    if row["idempotency_key"] in inserted and row["outcome"] in OUTCOME_GATE}
        for rid, s in sorted(new_fail):
            session.execute(
                update(RolloutStratum)
                .where(RolloutStratum.rollout_id == rid, RolloutStratum.stratum == s,
                       RolloutStratum.first_failure_at.is_(None), RolloutStratum.state.in_(LIVE))
                .values(first_failure_at=now),
                execution_options={"synchronize_session": False})
    _verify_canaries(session, node, rows, inserted, now)
    return accepted, len(batch.reports) - accepted


def _verify_canaries(session: Session, node: Node, rows: list[dict[str, Any]], inserted: set[str],
                     now: dt.datetime) -> None:
    """Trial before serve: a newly accepted hard-gates-passed report lets this node serve the candidate."""
    new = [row for row in rows if row["idempotency_key"] in inserted]
    bad = {row["rollout_id"] for row in new if row["outcome"] != "ok"}
    mark_verified(session, node, {row["rollout_id"] for row in new if row["outcome"] == "ok"} - bad, now)
