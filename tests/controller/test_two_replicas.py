"""Two controller replicas on one PostgreSQL database: what one replica decides, the other sees.

A rollback wins over a promote on every replica (``controller.rollouts.request_rollback``: a rollback intent
committed before the rollback waits for the rollout's lock): a full promote sent to replica B, queued on the
rollout's lock ahead of a rollback sent to replica A, is refused, and the rollout ends rolled back.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import psycopg
import pytest

from controller.leader import _conninfo
from tests.controller.serverutil import ControllerProcess, TestBundles, make_tokens
from tests.controller.test_redteam import PLAN, node_token, push

pytestmark = pytest.mark.postgres


def _wait(cond, what: str, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _waiting_on_locks(conn: psycopg.Connection) -> int:
    return conn.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                        "AND datname = current_database()").fetchone()[0]


def test_rollback_on_one_replica_wins_over_a_promote_queued_first_on_another(
        pg_url: str, tmp_path: Path, stable_bundle: TestBundles) -> None:
    tokens = make_tokens()
    kw = {"tokens": tokens, "trusted_keys_dir": stable_bundle.keys_dir}
    with ControllerProcess(pg_url, tmp_path, name="a", **kw) as a, \
            ControllerProcess(pg_url, tmp_path, name="b", **kw) as b:
        node_token(a, "gpu-a")
        push(a, stable_bundle, "1.0.0")
        with a.client("operator") as op:
            r = op.post("/v1/rollouts", json={"bundle": "llm-fused@1.0.0", "plan": PLAN, "reason": "two replicas"})
            assert r.status_code == 201, r.text
            rid = r.json()["id"]
            _wait(lambda: op.get(f"/v1/rollouts/{rid}").json()["state"] == "progressing", "the rollout to begin")
        with b.client("operator") as warm:  # replica B has served this token once (its first lookup is no part
            assert warm.get(f"/v1/rollouts/{rid}").status_code == 200  # of the race under test)
        answers: dict[str, httpx.Response] = {}

        def call(ctl: ControllerProcess, who: str, path: str, body: dict) -> None:
            with ctl.client("operator", timeout=60) as c:
                answers[who] = c.post(f"/v1/rollouts/{rid}/{path}", json=body)

        with psycopg.connect(_conninfo(pg_url)) as watcher, psycopg.connect(_conninfo(pg_url)) as holder:
            holder.execute("SELECT id FROM rollouts WHERE id = %s FOR UPDATE", (rid,))  # every writer queues
            base = _waiting_on_locks(watcher)
            promote = threading.Thread(target=call, args=(b, "promote", "promote",
                                                           {"full": True, "reason": "looks fine"}))
            promote.start()
            _wait(lambda: _waiting_on_locks(watcher) > base, "replica B's promote to queue on the rollout's lock")
            rollback = threading.Thread(target=call, args=(a, "rollback", "rollback", {"reason": "numerics wrong"}))
            rollback.start()
            _wait(lambda: _waiting_on_locks(watcher) > base + 1, "replica A's rollback to queue behind it")
            holder.commit()  # the promote, first in the queue, takes the lock first
            promote.join(60)
            rollback.join(60)
        assert answers["promote"].status_code == 409, answers["promote"].text
        assert "rollback" in answers["promote"].json()["detail"]
        assert answers["rollback"].status_code == 200, answers["rollback"].text
        for ctl in (a, b):  # both replicas tell the same
            with ctl.client("viewer") as v:
                assert v.get(f"/v1/rollouts/{rid}").json()["state"] == "rolled_back"
        with psycopg.connect(_conninfo(pg_url)) as c:  # the intent is gone once the rollback is over
            assert c.execute("SELECT count(*) FROM rollback_intents").fetchone()[0] == 0
