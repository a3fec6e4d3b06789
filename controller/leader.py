"""Leader election: a PostgreSQL session advisory lock held on a dedicated connection.

``LeaderElector.check()`` is called before every tick and on a short period: it verifies that the
dedicated connection is alive and still holds the lock (``pg_locks``), and otherwise drops leadership at
once and tries to take it again with ``pg_try_advisory_lock``. When a leader dies its connection closes,
PostgreSQL releases the lock, and a standby's next check takes it. With SQLite (one controller by design)
the process is always the leader.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time

import psycopg
from sqlalchemy.engine import make_url

from controller.db.engine import is_sqlite, parse_url
from controller.errors import first_line

log = logging.getLogger(__name__)


def lock_key(name: str = "kernelctl-leader") -> int:
    """A stable signed 64-bit advisory lock key derived from ``name``."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big", signed=True)


def _conninfo(database_url: str) -> str:
    url = parse_url(database_url).set(drivername="postgresql")
    return make_url(url).render_as_string(hide_password=False)


class LeaderElector:
    """Holds (or waits for) leadership; thread-safe; ``is_leader`` is the last checked state."""

    def __init__(self, database_url: str, *, key: int | None = None, on_change=None) -> None:  # type: ignore[no-untyped-def]
        self._url = database_url
        self._sqlite = is_sqlite(parse_url(database_url))
        self._key = lock_key() if key is None else key
        self._conn: psycopg.Connection | None = None
        self._lock = threading.Lock()
        self._leader = False
        self._on_change = on_change
        self.leading_since: float | None = None  # time.monotonic() when this replica last became leader

    @property
    def is_leader(self) -> bool:
        return self._leader

    def _set(self, leader: bool, why: str) -> None:
        if leader != self._leader:
            log.warning("leadership %s: %s", "acquired" if leader else "lost", why)
            self._leader = leader
            self.leading_since = time.monotonic() if leader else None
            if self._on_change is not None:
                self._on_change(leader)

    def _close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):  # closing a broken connection
                self._conn.close()
            self._conn = None

    def _still_held(self) -> bool:
        assert self._conn is not None
        row = self._conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted "
            "AND objsubid = 1 AND ((classid::bigint << 32) | objid::bigint) = %s",
            (self._key,),
        ).fetchone()
        return bool(row and row[0])

    def check(self) -> bool:
        """Verify or try to take leadership now; return whether this replica leads."""
        if self._sqlite:
            if not self._leader:
                self._set(True, "SQLite: single controller")
            return True
        with self._lock:
            if self._conn is not None and self._leader:
                try:
                    if self._still_held():
                        return True
                    self._set(False, "advisory lock no longer held")
                except Exception as exc:
                    self._set(False, f"leader connection lost: {first_line(exc)}")
                self._close()
            try:
                if self._conn is None or self._conn.closed:
                    self._conn = psycopg.connect(
                        _conninfo(self._url),
                        autocommit=True,
                        connect_timeout=5,
                        application_name="kernelctl-leader",
                        keepalives=1,
                        keepalives_idle=5,
                        keepalives_interval=2,
                        keepalives_count=2,
                    )
                    self._conn.execute("SET statement_timeout = '5s'")
                got = self._conn.execute("SELECT pg_try_advisory_lock(%s)", (self._key,)).fetchone()
                if got and got[0]:
                    self._set(True, "advisory lock taken")
                    return True
                return False
            except Exception as exc:
                self._set(False, f"cannot reach the database: {first_line(exc)}")
                self._close()
                return False

    def release(self) -> None:
        """Give leadership up (on shutdown): closing the connection releases the lock."""
        with self._lock:
            if not self._sqlite:
                if self._conn is not None and self._leader:
                    with contextlib.suppress(Exception):  # unlock now rather than when the backend exits
                        self._conn.execute("SELECT pg_advisory_unlock(%s)", (self._key,))
                self._close()
                self._set(False, "shutting down")
