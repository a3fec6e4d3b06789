"""The fleet simulator end to end at small scale: a REAL ``kernelctl serve`` on a fresh PostgreSQL database,
50 simulated agents speaking the real protocol. A clean candidate must be promoted with no report lost and no
node stale; a candidate 10% slower must be rolled back everywhere and every canary must be back on the stable
version within 5 s of the rollback decision (pushed through the watch).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import dbutil

pytestmark = [pytest.mark.postgres, pytest.mark.slow]
REPO_ROOT = Path(__file__).resolve().parents[2]


def _fleet_cmd() -> list[str]:
    """``kernelctl sim fleet`` (the root CLI mounts sim/fleet/cli.py)."""
    return [sys.executable, "-m", "cli.app", "sim", "fleet"]


@pytest.fixture(scope="module")
def bundle_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from sim.fleet.bundles import prepare_bundles

    cache = tmp_path_factory.mktemp("sim-bundles")
    prepare_bundles(cache)  # build the signed bundles once for the module (kernelpack.build)
    return cache


def run_fleet(scenario: str, bundle_cache: Path, tmp_path: Path) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1", "TMPDIR": str(tmp_path)}
    cmd = [*_fleet_cmd(), "--nodes", "50", "--scenario", scenario, "--json", "--fresh",
           "--db", dbutil.PG_ADMIN_URL, "--heartbeat-seconds", "2", "--tick-seconds", "0.5", "--trial-interval", "0.4",
           "--duration-limit", "100", "--bundle-cache", str(bundle_cache)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=150)
    assert proc.stdout.strip(), f"no output (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    res = json.loads(proc.stdout)
    res["_rc"] = proc.returncode
    return res


def test_healthy_rollout_is_promoted_with_no_report_lost(bundle_cache: Path, tmp_path: Path) -> None:
    res = run_fleet("healthy", bundle_cache, tmp_path)
    assert res["outcome"] == "promoted", res["rollout"]
    assert set(res["rollout"]["strata"].values()) == {"promoted"}
    assert len(res["rollout"]["strata"]) == 3  # heterogeneous fleet: three strata
    assert res["false_rollbacks"] == []
    rep = res["reports"]
    assert rep["sent"] > 0 and rep["lost"] == 0 and rep["stored"] + rep["refused"] == rep["sent"], rep
    assert res["http"]["heartbeat"]["count"] >= 50
    assert res["tick"]["count"] > 0  # scraped from the controller's /metrics
    assert res["http"]["heartbeat"]["server_fast"]["count"] > 0  # heartbeats answered from the snapshot
    assert res["stale"]["nodes_stale"] == 0
    assert res["passed"] and res["_rc"] == 0, res["checks"]


def test_latency_regression_rolls_back_every_stratum(bundle_cache: Path, tmp_path: Path) -> None:
    res = run_fleet("latency-regression", bundle_cache, tmp_path)
    assert res["outcome"] == "rolled_back", res["rollout"]
    assert set(res["rollout"]["strata"].values()) == {"rolled_back"}
    assert res["reports"]["lost"] == 0
    ttr = res["time_to_rollback_s"]
    assert ttr["canaries"] > 0 and ttr["max"] is not None and ttr["max"] > 0
    pushed = res["decision_to_stable_s"]  # the rollback reaches the waiting canaries through their watch
    assert pushed["canaries"] > 0 and pushed["max"] is not None and pushed["max"] < 5.0, pushed
    assert res["checks"]["rolled_back_canaries_back_on_stable"]
    assert res["checks"]["no_node_stale_but_the_stopped"]
    assert res["passed"] and res["_rc"] == 0, res["checks"]
