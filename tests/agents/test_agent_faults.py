"""A real agent process against a real controller: crash, OOM and drift fault fixtures each come back as
their report outcome (and the controller rolls them back) while the agent keeps running; a download
tampered with in transit is refused, reported as load_error and never published or loaded. None of them is
ever published for serving (trial before serve)."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import create_engine, select

from controller.db.models import Report
from tests import dbutil
from tests.agents.agentutil import FAST_PROFILE, AgentProcess, push_bundle, start_rollout, wait_for
from tests.agents.bundles import BuiltBundles
from tests.agents.proxy import Proxy
from tests.controller.serverutil import ControllerProcess, Zygote

CASES = [("1.2.0-fault.crash", "crash", "crash"), ("1.2.0-fault.drift", "numeric_error", "numeric"),
         ("1.2.0-fault.oom", "oom", "oom"),
         ("1.1.0", "load_error", "load")]  # 1.1.0 is fine, but its download gets tampered with below


def test_fault_fixtures_and_tampered_download(bundles: BuiltBundles, sm90_overrides: Path, tmp_path: Path,
                                              zygote: Zygote) -> None:
    with dbutil.fresh_database("sqlite", tmp_path) as url, \
            ControllerProcess(url, tmp_path, trusted_keys_dir=bundles.trusted_dir, zygote=zygote) as ctl, \
            Proxy(ctl.url) as proxy:
        op = ctl.client("operator")
        for v, _, _ in CASES:
            push_bundle(op, bundles.paths[v])
        proxy.tamper = lambda path: path.endswith("/llm-fused/1.1.0/content")
        agent = AgentProcess(tmp_path, controller_url=proxy.url, token=ctl.tokens["enroll"],
                             trusted_keys=bundles.trusted_dir, node_name="canary-1", overrides=sm90_overrides,
                             profile=FAST_PROFILE).start()
        engine = create_engine(url)
        try:
            wait_for(lambda: op.get("/v1/nodes").json(), 90, "the agent to register", on_timeout=agent.log_text)
            pid = agent.proc.pid if agent.proc else None
            for version, outcome, gate in CASES:
                rid = start_rollout(op, f"llm-fused@{version}")["id"]

                def rolled_back(rid: int = rid) -> bool:
                    return op.get(f"/v1/rollouts/{rid}").json()["state"] == "rolled_back"

                wait_for(rolled_back, 90, f"rollback of {version}",
                         on_timeout=lambda: agent.log_text()[-4000:] + ctl.log_tail())
                with engine.connect() as c:
                    rows = c.execute(select(Report.outcome, Report.detail).where(Report.rollout_id == rid)).all()
                assert [r.outcome for r in rows] == [outcome], (version, rows)
                verdict = op.get(f"/v1/rollouts/{rid}").json()["strata"][0]["latest_verdict"]
                assert verdict["decision"] == "rollback" and verdict["gate"] == gate
                assert agent.running and agent.proc is not None and agent.proc.pid == pid  # survived
            log = agent.log_text()
            assert "SIGSEGV" in log and "can't allocate memory" in log
            # the tampered candidate never reached the cache, the runtime or a trial
            assert "refused" in log and "trial of llm-fused@1.1.0" not in log
            assert not (agent.cache_dir / "bundles" / f"{bundles.digests['1.1.0']}.kpack").exists()
            # trial before serve: none of these candidates passed its pre-serve trial and there is no stable
            # version, so nothing was ever published for serving code (no active.json at all)
            assert not (agent.runtime_dir / "active.json").exists()
            with engine.connect() as c:
                detail = c.execute(select(Report.detail).where(Report.outcome == "load_error")).scalar_one()
            assert "sha256" in str(detail)
        finally:
            assert agent.stop() == 0, agent.log_text()[-3000:]
            engine.dispose()
