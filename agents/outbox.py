"""The agent's on-disk report outbox (stdlib sqlite3, WAL) and its small persistent state.

A report is written here first (with its idempotency key ``<node>:<uuid4>``), then sent in batches: what is
waiting, oldest first, in one request bounded by count and bytes (``kernelctl.wire.MAX_REPORT_BATCH_BYTES``, well under the
controller's ``max_report_body_bytes``); a row is marked sent only after the controller acknowledged the batch,
and a report the controller's answer refuses by key (``ReportBatchResponse.refused``: not a canary any more,
the rollout no longer live) is kept as rejected with the controller's reason, never resent. An unacknowledged
batch is resent with the same keys, so the controller counts it once; the outbox survives agent restarts and
controller outages. The
``state`` table holds what must survive a restart (last trial end, the running trial child's pid).
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kernelctl.wire import MAX_REPORT_BATCH_BYTES, ReportBatchResponse, TrialReport

SCHEMA = """
CREATE TABLE IF NOT EXISTS reports (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    idempotency_key TEXT NOT NULL UNIQUE,
    body TEXT NOT NULL,
    created_at REAL NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    sent_at REAL,
    rejected TEXT
);
CREATE INDEX IF NOT EXISTS reports_pending ON reports (sent_at, seq);
CREATE TABLE IF NOT EXISTS state (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


log = logging.getLogger("kernelctl.agent")


def new_idempotency_key(node_name: str) -> str:
    """``<node>:<uuid4 hex>`` (node part truncated so the key fits the wire limit of 128 chars)."""
    return f"{node_name[:80]}:{uuid.uuid4().hex}"


class Outbox:
    """Durable FIFO of reports; thread-safe (one connection guarded by a lock)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(self.path), timeout=30, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # ------------------------------------------------------------------------------------------ reports
    def add(self, report: TrialReport) -> None:
        """Store ``report`` durably (a key already present is left as it is)."""
        with self._lock:
            self._db.execute(
                "INSERT OR IGNORE INTO reports (idempotency_key, body, created_at) VALUES (?, ?, ?)",
                (report.idempotency_key, report.model_dump_json(), time.time()),
            )

    def pending(self, limit: int = 100, max_bytes: int | None = None) -> list[TrialReport]:
        """Oldest unacknowledged reports first: at most ``limit``, and (with ``max_bytes``) no more than fit in
        that many bytes of JSON (always at least one: a report larger than that goes alone)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT body FROM reports WHERE sent_at IS NULL ORDER BY seq LIMIT ?", (limit,)
            ).fetchall()
        out: list[TrialReport] = []
        size = 0
        for (body,) in rows:
            size += len(body)
            if out and max_bytes is not None and size > max_bytes:
                break
            out.append(TrialReport.model_validate_json(body))
        return out

    def mark_attempt(self, keys: list[str]) -> None:
        with self._lock:
            self._db.executemany(
                "UPDATE reports SET attempts = attempts + 1 WHERE idempotency_key = ?", [(k,) for k in keys]
            )

    def mark_sent(self, keys: list[str]) -> None:
        """Record the controller's acknowledgement of ``keys`` (one transaction)."""
        now = time.time()
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.executemany(
                    "UPDATE reports SET sent_at = ? WHERE idempotency_key = ? AND sent_at IS NULL",
                    [(now, k) for k in keys],
                )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def mark_rejected(self, key: str, reason: str) -> None:
        """The controller refused this report as invalid (4xx): keep it for inspection, never resend it."""
        with self._lock:
            self._db.execute(
                "UPDATE reports SET sent_at = ?, rejected = ? WHERE idempotency_key = ?",
                (time.time(), reason[:2000], key),
            )

    def rejected(self) -> list[tuple[str, str]]:
        with self._lock:
            rows = self._db.execute(
                "SELECT idempotency_key, rejected FROM reports WHERE rejected IS NOT NULL ORDER BY seq"
            ).fetchall()
        return [(r[0], r[1]) for r in rows]

    def depth(self) -> int:
        """Number of reports not yet acknowledged."""
        with self._lock:
            return int(self._db.execute("SELECT count(*) FROM reports WHERE sent_at IS NULL").fetchone()[0])

    def counts(self) -> dict[str, int]:
        with self._lock:
            total, sent = self._db.execute("SELECT count(*), count(sent_at) FROM reports").fetchone()
        return {"total": int(total), "sent": int(sent), "pending": int(total) - int(sent)}

    def prune(self, older_than_s: float = 7 * 86400) -> int:
        """Delete acknowledged reports older than ``older_than_s``; returns how many went."""
        with self._lock:
            cur = self._db.execute(
                "DELETE FROM reports WHERE sent_at IS NOT NULL AND sent_at < ?", (time.time() - older_than_s,)
            )
            return cur.rowcount

    def flush(self, send: Callable[[list[TrialReport]], ReportBatchResponse], batch_size: int = 100,
              max_bytes: int = MAX_REPORT_BATCH_BYTES, refuses: Callable[[Exception], bool] = lambda exc: False) -> int:
        """Send pending reports via ``send``, each request what is waiting (at most ``batch_size`` reports and
        ``max_bytes``), until none are left; returns how many the controller acknowledged (refused ones
        included: kept as rejected with its reason, not resent).

        ``send`` raises on failure: the batch stays pending and is resent later with the same keys. A failure
        for which ``refuses`` is true (the controller refused the request as invalid: a 4xx) sends that batch's
        reports one by one, so the report at fault is found, kept as rejected and never resent, and the
        others are acknowledged; another failure raises.
        """
        acked = 0
        while True:
            batch = self.pending(batch_size, max_bytes)
            if not batch:
                return acked
            keys = [r.idempotency_key for r in batch]
            self.mark_attempt(keys)
            try:
                self._acknowledge(keys, send(batch))
            except Exception as exc:
                if not refuses(exc):
                    raise
                if len(batch) > 1:
                    acked += self._one_by_one(send, batch, refuses)
                    continue
                log.error("controller refused report %s; it will not be resent: %s", keys[0], exc)
                self.mark_rejected(keys[0], str(exc))
            acked += len(keys)

    def _one_by_one(self, send: Callable[[list[TrialReport]], ReportBatchResponse], batch: list[TrialReport],
                    refuses: Callable[[Exception], bool]) -> int:
        for i, report in enumerate(batch):
            try:
                self._acknowledge([report.idempotency_key], send([report]))
            except Exception as exc:
                if not refuses(exc):
                    if i:
                        return i
                    raise
                log.error("controller refused report %s; it will not be resent: %s", report.idempotency_key, exc)
                self.mark_rejected(report.idempotency_key, str(exc))
        return len(batch)

    def _acknowledge(self, keys: list[str], reply: ReportBatchResponse) -> None:
        for key, reason in reply.refused.items():
            self.mark_rejected(key, f"refused by the controller: {reason}")
        self.mark_sent([k for k in keys if k not in reply.refused])

    # -------------------------------------------------------------------------------------------- state
    def get_state(self, key: str, default: Any = None) -> Any:
        with self._lock:
            row = self._db.execute("SELECT value FROM state WHERE key = ?", (key,)).fetchone()
        return default if row is None else json.loads(row[0])

    def set_state(self, key: str, value: Any) -> None:
        with self._lock:
            if value is None:
                self._db.execute("DELETE FROM state WHERE key = ?", (key,))
            else:
                self._db.execute(
                    "INSERT INTO state (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                    (key, json.dumps(value)),
                )
