"""The agent registers whatever the controller answers on the way (issues 26 item 4, 28): a controller that is
down (502), refuses the inventory (422: reported, the inventory collected again) or loses the reply is retried
with backoff and jitter, never fatal; the node is registered once and the agent goes on with its node token.
Real controller (SQLite) behind a loopback proxy that plays the failures."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from agents.daemon import Agent, AgentConfig
from tests.agents.proxy import Proxy
from tests.controller.serverutil import ControllerProcess


def test_registration_survives_an_outage_a_refused_inventory_and_a_lost_reply(tmp_path: Path,
                                                                             sm90_overrides: Path) -> None:
    with ControllerProcess(f"sqlite:///{tmp_path / 'ctl.db'}", tmp_path) as ctl, Proxy(None) as proxy:
        ctl_url = ctl.url
        plays: list[str] = []

        def answer(path: str) -> tuple[int, bytes] | None:
            if path.endswith("/agents/register") and plays.count("422") < 2 and "502" in plays:
                plays.append("422")
                return 422, b'{"detail": "inventory.memory_total_mb: out of range"}'
            return None

        def lose(path: str) -> bool:
            answered = proxy.requests[-1][2] if proxy.requests else None  # this request's status
            if path.endswith("/agents/register") and answered == 200 and "lost" not in plays:
                plays.append("lost")
                return True
            return False

        proxy.answer, proxy.lose = answer, lose
        cfg = AgentConfig(controller_url=proxy.url, token=ctl.tokens["enroll"], node_name="gpu-reg",
                          cache_dir=tmp_path / "cache", runtime_dir=tmp_path / "run", trusted_keys_dir=tmp_path,
                          inventory_overrides=sm90_overrides, http_timeout_s=5.0)
        agent = Agent(cfg)
        agent.setup()
        errors: list[BaseException] = []

        def register() -> None:
            try:
                agent._register()
            except BaseException as exc:  # the test reports whatever ended it
                errors.append(exc)

        th = threading.Thread(target=register)
        th.start()
        time.sleep(1.0)  # the controller is "down" meanwhile: 502s, retried
        plays.append("502")
        proxy.upstream = ctl_url
        th.join(90)
        try:
            assert not th.is_alive() and not errors, errors
            assert agent.client is not None and agent.client.token != ctl.tokens["enroll"]
            assert plays[-3:] == ["422", "422", "lost"]
            statuses = [s for _m, p, s in proxy.requests if p.endswith("/agents/register")]
            assert statuses[0] == 502 and statuses.count(422) == 2 and statuses[-2:] == [200, 200], statuses
            with ctl.client("operator") as op:
                assert [n["name"] for n in op.get("/v1/nodes").json()] == ["gpu-reg"]
            with ctl.client(token=agent.client.token) as c:  # the token of the retry works
                assert c.post("/v1/agents/heartbeat", json={"node_name": "gpu-reg"}).status_code == 200
        finally:
            agent.request_stop()
            agent.shutdown()
