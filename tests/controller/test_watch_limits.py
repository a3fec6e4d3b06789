"""A held watch is still its node's (issue 26 items 6b, 8b), over real HTTP on SQLite and PostgreSQL.

* A watch whose token is revoked while it waits is answered 401, never with desired state (the token is checked
  again when the watch wakes: ``controller.api.heartbeat_lane.answer``).
* One node holds at most ``max_watches_per_node`` open watches per replica; one more is answered 429 at once.
"""

from __future__ import annotations

import concurrent.futures as cf
import time

import httpx
from sqlalchemy import select

from controller.auth import revoke_token
from controller.db.engine import make_engine, session_factory, session_scope
from controller.db.models import ApiToken
from tests.controller.serverutil import ControllerProcess, Zygote, register_node


def _gen(c: httpx.Client, name: str) -> int:
    r = c.post("/v1/agents/heartbeat", json={"node_name": name})
    assert r.status_code == 200, r.text
    return r.json()["generation"]


def test_a_watch_whose_token_is_revoked_meanwhile_gets_401(db_url: str, tmp_path, zygote: Zygote) -> None:
    with ControllerProcess(db_url, tmp_path, zygote=zygote) as ctl:
        node = register_node(ctl, "gpu-w")
        gen = _gen(node, "gpu-w")
        with cf.ThreadPoolExecutor(1) as pool:
            held = pool.submit(node.post, "/v1/agents/heartbeat", timeout=60,
                               json={"node_name": "gpu-w", "generation": gen, "wait_seconds": 12})
            time.sleep(1.0)
            engine = make_engine(db_url)
            try:
                with session_scope(session_factory(engine)) as s:  # `kernelctl token revoke`, from elsewhere
                    tid = s.scalar(select(ApiToken.id).where(ApiToken.node_name == "gpu-w",
                                                             ApiToken.revoked_at.is_(None)))
                    revoke_token(s, tid, actor="op", reason="node decommissioned")
            finally:
                engine.dispose()
            reply = held.result(60)
        assert reply.status_code == 401, reply.text
        assert "desired" not in reply.text
        node.close()


def test_one_node_holds_a_bounded_number_of_watches(db_url: str, tmp_path, zygote: Zygote) -> None:
    with ControllerProcess(db_url, tmp_path, extra_env={"KERNELCTL_MAX_WATCHES_PER_NODE": "2"},
                           zygote=zygote) as ctl:
        node = register_node(ctl, "gpu-c")
        gen = _gen(node, "gpu-c")
        body = {"node_name": "gpu-c", "generation": gen, "wait_seconds": 6}
        with cf.ThreadPoolExecutor(2) as pool:
            held = [pool.submit(node.post, "/v1/agents/heartbeat", json=body, timeout=60) for _ in range(2)]
            time.sleep(1.5)
            with ctl.client(token=node.headers["authorization"].split()[1]) as other:
                third = other.post("/v1/agents/heartbeat", json=body, timeout=60)
            replies = [h.result(60) for h in held]
        assert third.status_code == 429, third.text
        assert "open watches" in third.json()["detail"]
        assert [r.status_code for r in replies] == [200, 200]
        node.close()
