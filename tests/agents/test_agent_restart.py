"""An agent SIGKILLed mid-trial (real processes, real controller) leaves no orphan trial child and, restarted
on the same cache dir, resumes: saved node token, staged bundle reused, the trial run again and reported."""

from __future__ import annotations

from pathlib import Path

from tests import dbutil
from tests.agents.agentutil import (
    OPEN_PLAN,
    PROFILE,
    AgentProcess,
    db_keys,
    push_bundle,
    start_rollout,
    wait_for,
)
from tests.agents.bundles import BuiltBundles
from tests.controller.serverutil import ControllerProcess, Zygote


def test_sigkill_mid_trial_then_restart_resumes(bundles: BuiltBundles, sm90_overrides: Path, tmp_path: Path,
                                                zygote: Zygote) -> None:
    with dbutil.fresh_database("sqlite", tmp_path) as url, \
            ControllerProcess(url, tmp_path, trusted_keys_dir=bundles.trusted_dir, zygote=zygote) as ctl:
        op = ctl.client("operator")
        push_bundle(op, bundles.paths["1.1.0"])
        agent = AgentProcess(tmp_path, controller_url=ctl.url, token=ctl.tokens["enroll"],
                             trusted_keys=bundles.trusted_dir, node_name="n-kill", overrides=sm90_overrides,
                             profile=PROFILE).start()
        try:
            wait_for(lambda: op.get("/v1/nodes").json(), 90, "registration", on_timeout=agent.log_text)
            rid = start_rollout(op, "llm-fused@1.1.0", OPEN_PLAN)["id"]
            children = wait_for(agent.trial_child_pids, 60, "a trial child", interval=0.1,
                                on_timeout=agent.log_text)
            agent.kill()  # SIGKILL the agent mid-trial
            # the child dies with its parent (PR_SET_PDEATHSIG): no orphan keeps burning the GPU
            wait_for(lambda: not agent.trial_child_pids(), 15, f"trial child {children} to die")
            assert db_keys(url, rid) == []  # the interrupted trial produced no report
            token_file = agent.cache_dir / "node-token.json"
            assert token_file.stat().st_mode & 0o777 == 0o600
            agent.start()  # same cache dir: node token, outbox, staged bundles
            wait_for(lambda: db_keys(url, rid), 120, "a report after the restart",
                     on_timeout=lambda: agent.log_text()[-4000:])
            log = agent.log_text()
            assert "interrupted mid-trial" in log
            assert log.count("/v1/bundles/llm-fused/1.1.0/content") == 1  # staged once, reused after restart
        finally:
            assert agent.stop() == 0
