"""Leadership: a PostgreSQL session advisory lock on a dedicated connection, at most one leader per database,
and a standby that takes over within 15 s of the leader's death (two REAL `kernelctl serve` processes)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import psycopg
import pytest

from controller.leader import LeaderElector, lock_key
from tests import dbutil
from tests.controller.serverutil import ControllerProcess, make_tokens

pytestmark = pytest.mark.postgres
TAKEOVER_LIMIT_S = 15.0


def test_sqlite_controller_always_leads(tmp_path: Path) -> None:
    e = LeaderElector(f"sqlite:///{tmp_path / 'x.db'}")
    assert e.is_leader is False  # nothing checked yet
    assert e.check() is True and e.is_leader is True


def test_one_leader_and_handover_on_release(pg_url: str) -> None:
    changes: list[tuple[str, bool]] = []
    key = lock_key(f"test-{pg_url}")
    a = LeaderElector(pg_url, key=key, on_change=lambda v: changes.append(("a", v)))
    b = LeaderElector(pg_url, key=key, on_change=lambda v: changes.append(("b", v)))
    try:
        assert a.check() is True
        assert b.check() is False and a.check() is True  # re-checked: still held, still single
        a.release()
        assert a.is_leader is False
        assert b.check() is True
        assert a.check() is False
        assert changes == [("a", True), ("a", False), ("b", True)]
    finally:
        a.release()
        b.release()


def test_lost_connection_drops_leadership_at_once(pg_url: str) -> None:
    key = lock_key(f"test-conn-{pg_url}")
    a = LeaderElector(pg_url, key=key)
    b = LeaderElector(pg_url, key=key)
    try:
        assert a.check() is True
        with psycopg.connect(dbutil._admin_conninfo(), autocommit=True) as admin:
            n = admin.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE application_name = 'kernelctl-leader' AND datname = %s", (pg_url.rsplit("/", 1)[1],)
            ).fetchone()
        assert n and n[0] >= 1
        assert eventually(b.check)  # the lock dies with a's connection (when its backend exits)
        assert a.check() is False  # a notices on its next check and does not act
        assert a.is_leader is False
    finally:
        a.release()
        b.release()


def eventually(check, timeout: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _leader_metric(ctl: ControllerProcess) -> float:
    text = httpx.get(ctl.url + "/metrics", timeout=5).text
    m = re.search(r"^kernelctl_leader (\S+)$", text, re.M)
    assert m, text[:500]
    return float(m.group(1))


def test_standby_takes_over_within_15s_of_leader_sigkill(pg_url: str, tmp_path: Path) -> None:
    tokens = make_tokens()
    a = ControllerProcess(pg_url, tmp_path, tokens=tokens, name="a", tick_seconds=1.0)
    b = ControllerProcess(pg_url, tmp_path, tokens=tokens, name="b", tick_seconds=1.0)
    try:
        a.start(wait_leader=True)
        b.start()
        time.sleep(2.5)  # several leadership checks by both
        assert a.readyz()["leader"] is True and b.readyz()["leader"] is False  # type: ignore[index]
        assert (_leader_metric(a), _leader_metric(b)) == (1.0, 0.0)
        a.kill()  # SIGKILL: no graceful release, the lock goes with the dead connection
        killed_at = time.monotonic()
        b.wait_ready(timeout=TAKEOVER_LIMIT_S, leader=True)
        took = time.monotonic() - killed_at
        assert took < TAKEOVER_LIMIT_S
        assert _leader_metric(b) == 1.0
        print(f"standby took over {took:.2f}s after the leader's SIGKILL")
        a.start()  # the old leader comes back as a standby
        time.sleep(2.5)
        assert a.readyz()["leader"] is False and b.readyz()["leader"] is True  # type: ignore[index]
        assert (_leader_metric(a), _leader_metric(b)) == (0.0, 1.0)
        # graceful stop releases at once: the other replica leads within a couple of checks
        assert b.stop() == 0  # SIGTERM: graceful exit
        a.wait_ready(timeout=TAKEOVER_LIMIT_S, leader=True)
        assert "leadership acquired" in a.log_text()
    finally:
        a.kill()
        b.kill()
