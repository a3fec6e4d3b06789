"""Report ingestion: validate a batch against the changelog, then store it in one bulk statement.

Idempotent by ``idempotency_key``: ``INSERT ... ON CONFLICT DO NOTHING RETURNING`` stores only keys not seen
before (safe under concurrent replays on PostgreSQL), so a replayed or partially seen batch counts each
report once. A report that breaks a hard gate sets ``rollout_strata.first_failure_at`` (when unset): the
start of the time-to-rollback clock. No per-report round trips: the batch costs a handful of statements.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

from sqlalchemy import and_, select, update
from sqlalchemy.dialects import sqlite
from sqlalchemy.orm import Session

from controller.compat import node_stratum
from controller.db.models import Bundle, Node, Report, Rollout, RolloutStratum
from controller.errors import Invalid
from controller.gates import OUTCOME_GATE, as_utc, effective_outcome, log_ratio, numerics_summary
from kernelctl import wire

LIVE = ("progressing", "paused", "pending")


COLUMNS = ("idempotency_key", "node_id", "rollout_id", "stratum", "bundle_id", "stable_bundle_id", "outcome",
           "latency_log_ratio", "n_pairs", "peak_memory_bytes", "measured_at", "received_at", "detail")
PG_TYPES = ("varchar", "bigint", "bigint", "varchar", "bigint", "bigint", "varchar", "float8", "integer", "bigint",
            "timestamptz", "timestamptz", "json")
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
        e2e = None
        if r.e2e_stable_s is not None and r.e2e_candidate_s is not None:
            e2e = {"stable_s": r.e2e_stable_s, "candidate_s": r.e2e_candidate_s}
        rows.append({
            "idempotency_key": r.idempotency_key, "node_id": node.id, "rollout_id": r.rollout_id,
            "stratum": stratum, "bundle_id": bid,
            "stable_bundle_id": stable_ids.get((r.stable.name, r.stable.version, r.stable.digest)) if r.stable else None,
            "outcome": outcome, "latency_log_ratio": log_ratio(r) if outcome == "ok" else None,
            "n_pairs": len(r.latency), "peak_memory_bytes": r.peak_memory_bytes,
            "measured_at": as_utc(r.measured_at), "received_at": now,
            "detail": {
                "reported_outcome": r.outcome, "numerics": numerics_summary(r), "e2e": e2e,
                "launches_per_call": r.launches_per_call, "duration_s": r.duration_s, "text": r.detail,
            },
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
    return accepted, len(batch.reports) - accepted
