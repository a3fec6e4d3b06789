"""Liveness and staged versions of the heartbeats a replica answered from memory, written in batches.

One buffer, one lock, one flusher: request handlers (in the event loop) note a node's heartbeat time and
staged versions under the lock; :meth:`LivenessBuffer.flush` swaps the buffers under the same lock and writes
them (one statement each on PostgreSQL, one executemany each on SQLite, in one transaction). Flushes are
serialised by a second lock, so the hub's periodic flush and the leader's flush before judging staleness
never interleave; a failed flush puts its rows back (newer times that arrived meanwhile win).
"""

from __future__ import annotations

import datetime as dt
import json
import threading
from typing import Any

from sqlalchemy import bindparam, text
from sqlalchemy.orm import Session, sessionmaker

from controller.db.engine import retry_lock_cycles

# Every writer that locks many rows takes them in one order (nodes by id; assignments by node id, bundle name:
# ``controller.switches``, the stale sweep, registration), so two replicas or API workers never lock in a cycle.
# Every row lock in the controller is FOR NO KEY UPDATE (SQLAlchemy ``with_for_update(key_share=True)``): no
# writer changes a key, and a plain FOR UPDATE also blocks the KEY SHARE lock that an insert's foreign-key check
# takes on the row it points to (a report or an activation naming the node), which deadlocked report intake
# and switch batches with the liveness flush in a 10,000-node run.
PG_LOCK_NODES = text("SELECT id FROM nodes WHERE id = ANY(CAST(:ids AS bigint[])) ORDER BY id FOR NO KEY UPDATE")
PG_LOCK_ASSIGNMENTS = text("SELECT 1 FROM assignments WHERE node_id = ANY(CAST(:ids AS bigint[])) "
                           "ORDER BY node_id, bundle_name FOR NO KEY UPDATE")
PG_STAGED = text(
    "UPDATE assignments SET staged = CAST(v.doc AS json) FROM unnest(CAST(:ids AS bigint[]), CAST(:names AS text[]), "
    "CAST(:docs AS text[])) AS v(id, name, doc) WHERE assignments.node_id = v.id AND assignments.bundle_name = v.name")
SQLITE_STAGED = text("UPDATE assignments SET staged = :doc WHERE node_id = :id AND bundle_name = :name")
PG_LIVENESS = text(
    "UPDATE nodes SET last_heartbeat_at = GREATEST(nodes.last_heartbeat_at, v.at) "
    "FROM unnest(CAST(:ids AS bigint[]), CAST(:ats AS timestamptz[])) AS v(id, at) WHERE nodes.id = v.id")
SQLITE_LIVENESS = text("UPDATE nodes SET last_heartbeat_at = :at WHERE id = :id AND last_heartbeat_at < :at")


class LivenessBuffer:
    def __init__(self, factory: sessionmaker[Session], metrics: Any = None) -> None:
        self.factory = factory
        self.metrics = metrics
        self._postgres = factory.kw["bind"].dialect.name == "postgresql"
        self._lock = threading.Lock()  # the buffers
        self._flushing = threading.Lock()  # one flush at a time
        self._liveness: dict[int, dt.datetime] = {}
        self._staged: dict[tuple[int, str], tuple[str, ...]] = {}  # (node id, bundle) -> staged versions
        self._staged_written: dict[tuple[int, str], tuple[str, ...]] = {}

    def note(self, node_id: int, at: dt.datetime, staged: dict[str, tuple[str, ...]] | None = None) -> None:
        """A heartbeat of ``node_id`` at ``at``, with the staged versions that differ from the snapshot."""
        with self._lock:
            self._liveness[node_id] = at
            for name, versions in (staged or {}).items():
                key = (node_id, name)
                if self._staged_written.get(key) != versions:
                    self._staged[key] = versions

    @retry_lock_cycles  # aborted to break a lock cycle (with the leader's stale marking): written again
    def flush(self) -> int:
        """Write what is buffered (see the module docstring); returns the heartbeat times written."""
        with self._flushing:
            with self._lock:
                batch, self._liveness = self._liveness, {}
                staged, self._staged = self._staged, {}
            if not batch and not staged:
                return 0
            try:
                self._write(batch, staged)
            except Exception:
                with self._lock:
                    for k, v in batch.items():  # newer times that arrived meanwhile win
                        self._liveness.setdefault(k, v)
                    for k2, v2 in staged.items():
                        self._staged.setdefault(k2, v2)
                raise
            with self._lock:
                self._staged_written.update(staged)
        if self.metrics is not None:
            self.metrics.liveness_flushed.inc(len(batch))
        return len(batch)

    def _write(self, batch: dict[int, dt.datetime], staged: dict[tuple[int, str], tuple[str, ...]]) -> None:
        docs = {k: json.dumps({"versions": list(v)}) for k, v in staged.items()}
        with self.factory() as session:
            if self._postgres:
                if batch:
                    ids = sorted(batch)
                    session.execute(PG_LOCK_NODES, {"ids": ids})
                    session.execute(PG_LIVENESS, {"ids": ids, "ats": [batch[i] for i in ids]})
                if staged:
                    session.execute(PG_LOCK_ASSIGNMENTS, {"ids": sorted({k[0] for k in docs})})
                    session.execute(PG_STAGED, {"ids": [k[0] for k in docs], "names": [k[1] for k in docs],
                                                "docs": list(docs.values())})
            else:
                if batch:
                    session.execute(SQLITE_LIVENESS.bindparams(bindparam("at"), bindparam("id")),
                                    [{"id": k, "at": v} for k, v in batch.items()])
                if staged:
                    session.execute(SQLITE_STAGED, [{"id": k[0], "name": k[1], "doc": d} for k, d in docs.items()])
            session.commit()
