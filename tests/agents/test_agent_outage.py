"""A controller outage with real processes (on SQLite and PostgreSQL): reports made while the controller is
down wait in the agent's outbox and arrive exactly once after it comes back (rows counted in the database);
SIGTERM exits 0 and keeps the outbox."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import create_engine, func, select

from controller.db.models import Report
from tests.agents.agentutil import (
    OPEN_PLAN,
    PROFILE,
    AgentProcess,
    db_keys,
    outbox_counts,
    push_bundle,
    start_rollout,
    wait_for,
)
from tests.agents.bundles import BuiltBundles
from tests.agents.proxy import Proxy
from tests.controller.serverutil import ControllerProcess, Zygote


def test_controller_outage_every_report_arrives_once(bundles: BuiltBundles, sm90_overrides: Path,
                                                     db_url: str, tmp_path: Path, zygote: Zygote) -> None:
    ctl = ControllerProcess(db_url, tmp_path, trusted_keys_dir=bundles.trusted_dir, zygote=zygote).start()
    with Proxy(ctl.url) as proxy:
        op = ctl.client("operator")
        push_bundle(op, bundles.paths["1.1.0"])
        agent = AgentProcess(tmp_path, controller_url=proxy.url, token=ctl.tokens["enroll"],
                             trusted_keys=bundles.trusted_dir, node_name="n-outage", overrides=sm90_overrides,
                             profile=PROFILE).start()
        try:
            wait_for(lambda: op.get("/v1/nodes").json(), 90, "registration", on_timeout=agent.log_text)
            rid = start_rollout(op, "llm-fused@1.1.0", OPEN_PLAN)["id"]
            wait_for(lambda: db_keys(db_url, rid), 90, "a first report", on_timeout=agent.log_text)
            ctl.stop()  # controller down: the proxy answers 502 like a load balancer with no backend
            proxy.upstream = None
            down_at = outbox_counts(agent)[0]
            wait_for(lambda: outbox_counts(agent)[1] >= 1, 120, "a report queued while the controller is down",
                     on_timeout=lambda: agent.log_text()[-4000:])
            assert agent.running
            ctl.start()  # same database, new port
            proxy.upstream = ctl.url
            wait_for(lambda: outbox_counts(agent)[1] == 0, 60, "the outbox to drain",
                     on_timeout=lambda: agent.log_text()[-4000:])
            # SIGTERM (possibly mid-trial): clean exit 0, child group gone, outbox kept
            rc = agent.stop()
            assert rc == 0
            assert not agent.trial_child_pids()
            total, pending, keys = outbox_counts(agent)
            assert total > down_at and pending == 0
            rows = db_keys(db_url, rid)
            assert sorted(rows) == sorted(keys)  # every report arrived, none twice
            engine = create_engine(db_url)
            with engine.connect() as c:
                assert c.execute(select(func.count()).select_from(Report)).scalar_one() == total
            engine.dispose()
        finally:
            agent.stop()
            ctl.stop()
