"""Rollouts through the HTTP API of a REAL `kernelctl serve`, SQLite and PostgreSQL: the leader's judge rolls
a rollout back on the first gate-breaking report, the status shows the verdict and its
evidence, the metrics count it; operator refusals are 409/422 and change nothing."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import httpx
import pytest

from controller.rollouts import SYSTEM_ACTOR
from tests import dbutil
from tests.controller.serverutil import (
    ControllerProcess,
    TestBundles,
    Zygote,
    build_test_bundles,
    ok_report,
    register_node,
)

TICK = 0.5
PLAN = {"steps": [{"nodes": 1, "bake_seconds": 3600, "min_samples": 1000, "deadline_seconds": 7200},
                  {"percent": 100, "bake_seconds": 3600, "min_samples": 1000, "deadline_seconds": 7200}],
        "max_fleet_share": 1.0, "max_label_share": 1.0}


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> TestBundles:
    return build_test_bundles(tmp_path_factory.mktemp("bundles"), versions=("1.0.0",))


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def ctl(request: pytest.FixtureRequest, bundles: TestBundles, tmp_path, zygote: Zygote) -> Iterator[ControllerProcess]:  # type: ignore[no-untyped-def]
    with dbutil.fresh_database(request.param, tmp_path) as url, \
            ControllerProcess(url, tmp_path, trusted_keys_dir=bundles.keys_dir, tick_seconds=TICK,
                              zygote=zygote) as proc:
        yield proc


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_judge_rolls_back_on_first_crash_report(ctl: ControllerProcess, bundles: TestBundles) -> None:
    with ctl.client("operator") as op:
        assert op.post("/v1/bundles", content=bundles.files["1.0.0"].read_bytes()).status_code == 201
        nodes = [register_node(ctl, f"gpu-rb-{i}") for i in range(2)]
        rid = op.post("/v1/rollouts", json={"bundle": "llm-fused@1.0.0", "plan": PLAN}).json()["id"]
        trial, canary = None, None
        deadline = time.monotonic() + 30
        while trial is None and time.monotonic() < deadline:
            for i, n in enumerate(nodes):
                hb = n.post("/v1/agents/heartbeat", json={"node_name": f"gpu-rb-{i}"}).json()
                t = next((d["trial"] for d in hb["desired"] if d.get("trial")), None)
                if t:
                    trial, canary = t, (n, f"gpu-rb-{i}")
            time.sleep(0.1)
        assert trial is not None and canary is not None
        n, name = canary
        assert n.post("/v1/agents/reports", json={"node_name": name, "reports": [
            ok_report("rb-ok-000001", trial)]}).json() == {"accepted": 1, "duplicates": 0}
        crash = {**ok_report("rb-crash-00001", trial), "outcome": "crash", "detail": "worker killed by SIGSEGV"}
        sent = time.monotonic()
        assert n.post("/v1/agents/reports", json={"node_name": name, "reports": [crash]}).status_code == 200
        # liveness only (the timing goal is measured by scripts/bench-controller, not asserted here)
        while (r := op.get(f"/v1/rollouts/{rid}").json())["state"] != "rolled_back":
            assert time.monotonic() - sent < 30, r
            time.sleep(0.05)
        verdict = r["strata"][0]["latest_verdict"]
        assert (verdict["decision"], verdict["gate"]) == ("rollback", "crash")
        assert verdict["evidence"]["hard_gate"]  # the evidence says which reports broke which gate
        assert r["strata"][0]["state"] == "rolled_back"
        # every canary returns to stable (none here: the first version had no stable) and the version is revoked
        assert op.get("/v1/bundles/llm-fused/1.0.0").json()["status"] == "revoked"
        events = op.get("/v1/audit", params={"action": "rollout.*"}).json()
        assert [e["actor"] for e in events if e["action"] == "rollout.rolled_back"] == [SYSTEM_ACTOR]
        # a terminal rollout refuses operator transitions with 409 and nothing changes
        before = op.get("/v1/audit", params={"limit": 1000}).json()
        for action, body in (("promote", {"reason": "x", "from_step": 0}), ("pause", {}), ("resume", {})):
            resp = op.post(f"/v1/rollouts/{rid}/{action}", json=body)
            assert resp.status_code == 409, (action, resp.text)
            assert resp.json()["detail"]
        assert op.get("/v1/audit", params={"limit": 1000}).json() == before
        # starting the revoked version again needs force
        resp = op.post("/v1/rollouts", json={"bundle": "llm-fused@1.0.0", "plan": PLAN})
        assert resp.status_code == 409 and "revoked" in resp.json()["detail"]
        for c in nodes:
            c.close()
    text = httpx.get(ctl.url + "/metrics").text
    assert _metric(text, "kernelctl_rollbacks_total") == 1.0
    assert _metric(text, "kernelctl_time_to_rollback_seconds_count") == 1.0
    assert 0 <= _metric(text, "kernelctl_time_to_rollback_seconds_sum") < 30
    assert _metric(text, 'kernelctl_verdicts_total{decision="rollback",gate="crash"}') == 1.0
    assert _metric(text, 'kernelctl_rollouts{state="rolled_back"}') == 1.0


def test_operator_rollback_of_unknown_stratum_is_refused(ctl: ControllerProcess, bundles: TestBundles) -> None:
    with ctl.client("operator") as op:
        op.post("/v1/bundles", content=bundles.files["1.0.0"].read_bytes())
        register_node(ctl, "gpu-st-0").close()
        rid = op.post("/v1/rollouts", json={"bundle": "llm-fused@1.0.0", "plan": PLAN}).json()["id"]
        r = op.post(f"/v1/rollouts/{rid}/rollback", json={"reason": "x", "strata": ["sm_80/drv1/triton0"]})
        assert r.status_code == 422 and "has no stratum sm_80/drv1/triton0" in r.json()["detail"][0]["msg"]
        assert op.get(f"/v1/rollouts/{rid}").json()["state"] in ("pending", "progressing")
        r = op.post(f"/v1/rollouts/{rid}/rollback", json={"reason": "bad numerics on H100",
                                                         "strata": ["sm_90/drv550/triton3.6.0"]})
        assert r.status_code == 200 and r.json()["state"] == "rolled_back"
        compat = op.get("/v1/compat").json()
        assert [(c["stratum"], c["state"]) for c in compat] == [("sm_90/drv550/triton3.6.0", "rolled_back")]
    assert _metric(httpx.get(ctl.url + "/metrics").text, "kernelctl_rollbacks_total") == 1.0
