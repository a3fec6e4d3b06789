"""``GET /v1/rollouts/{id}/explain`` and ``kernelctl rollout explain`` against a REAL `kernelctl serve`: reports
with per-cell launches reach the judge through HTTP, the launch gate rolls the stratum back, and explain shows
every metric with which one decided, plus the verdict history; ``rollout status`` shows the deciding metric."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.agents.agentutil import wait_for
from tests.controller.serverutil import (
    ControllerProcess,
    TestBundles,
    controller_fixtures,
    ok_report,
    register_node,
)

PLAN = {"steps": [{"nodes": 1, "bake_seconds": 0, "min_samples": 3, "deadline_seconds": 600}],
        "hold_verdict_seconds": 0}


bundles, ctl = controller_fixtures("explain", versions=("1.0.0", "1.1.0"))


def test_explain_shows_every_metric_and_the_deciding_one(ctl: ControllerProcess, bundles: TestBundles) -> None:
    node = register_node(ctl, "gpu-explain-1")
    with ctl.client("operator") as op:
        for v in ("1.0.0", "1.1.0"):
            assert op.post("/v1/bundles", content=bundles.files[v].read_bytes()).status_code == 201
        r = op.post("/v1/rollouts", json={"bundle": "llm-fused@1.0.0", "reason": "baseline"}).json()
        assert op.post(f"/v1/rollouts/{r['id']}/promote", json={"full": True, "reason": "t"}).status_code == 200
        rid = op.post("/v1/rollouts", json={"bundle": "llm-fused@1.1.0", "plan": PLAN, "reason": "t"}).json()["id"]

    def trial() -> dict | None:
        hb = node.post("/v1/agents/heartbeat", json={"node_name": "gpu-explain-1"}).json()
        return next((d["trial"] for d in hb["desired"] if d.get("trial") and d["trial"]["rollout_id"] == rid), None)

    spec = wait_for(trial, 30, "the canary's trial spec")
    rep = ok_report("explain-000001", spec)
    rep["resources"] = [{"op": "bias_gelu", "tokens": 1, "stable_peak_bytes": 100, "candidate_peak_bytes": 100,
                         "stable_launches": 1, "candidate_launches": 2},
                        {"op": "bias_gelu", "tokens": 8, "stable_peak_bytes": 800, "candidate_peak_bytes": 800,
                         "stable_launches": 1, "candidate_launches": 1}]
    assert node.post("/v1/agents/reports", json={"node_name": "gpu-explain-1", "reports": [rep]}).status_code == 200
    with ctl.client("viewer") as viewer:
        detail = wait_for(lambda: (d := viewer.get(f"/v1/rollouts/{rid}").json())["state"] == "rolled_back" and d,
                          30, "the rollback")
        assert detail["strata"][0]["latest_verdict"]["gate"] == "launches"
        r = viewer.get(f"/v1/rollouts/{rid}/explain")
        assert r.status_code == 200, r.text
        doc = r.json()
        assert (doc["rollout_id"], doc["state"], doc["bundle"]) == (rid, "rolled_back", "llm-fused@1.1.0")
        (s,) = doc["strata"]
        assert (s["decision"], s["gate"], s["deciding_metric"]) == ("rollback", "launches", "launches:bias_gelu@1")
        assert s["at"] and "launches per call bias_gelu@1: 2 vs stable 1" in s["reason"]
        m = {x["metric"]: x for x in s["metrics"]}
        assert set(m) >= {"latency:bias_gelu@8:mean", "latency:bias_gelu@8:p99", "latency:aggregate:mean",
                          "latency:aggregate:p99", "memory:bias_gelu@1", "launches:bias_gelu@1",
                          "launches:bias_gelu@8", "numeric"}
        assert m["launches:bias_gelu@1"] == {"metric": "launches:bias_gelu@1", "kind": "launches", "unit": "count",
                                             "value": 2.0, "lower": None, "upper": 1.0, "margin": 0.0, "n": 1,
                                             "decision": "regress", "deciding": True, "statistic": None,
                                             "bound": None, "bound_side": None, "arms": None}
        cell = m["latency:bias_gelu@8:p99"]
        assert cell["statistic"] == "p99" and cell["bound_side"] == "upper" and cell["arms"]["stable"]["n"] >= 1
        assert m["memory:bias_gelu@1"]["decision"] == "pass" and m["memory:bias_gelu@1"]["unit"] == "ratio"
        assert m["latency:aggregate:mean"]["kind"] == "latency_aggregate" and m["latency:aggregate:mean"]["n"] == 1
        assert [x["deciding"] for x in s["metrics"]].count(True) == 1
        assert s["history"] and s["history"][-1]["decision"] == "rollback"
        assert s["history"][-1]["metrics"]["launches:bias_gelu@1"] == {
            "value": 2.0, "lower": None, "upper": 1.0, "margin": 0.0, "n": 1, "bound": None, "bound_side": None}
        one = viewer.get(f"/v1/rollouts/{rid}/explain", params={"stratum": s["stratum"]}).json()
        assert one == doc
        r = viewer.get(f"/v1/rollouts/{rid}/explain", params={"stratum": "sm_00/none"})
        assert r.status_code == 404 and "has no stratum 'sm_00/none'" in r.text
        assert viewer.get("/v1/rollouts/999999/explain").status_code == 404
        assert 'kernelctl_verdicts_total{decision="rollback",gate="launches"} 1.0' in viewer.get("/metrics").text

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "cli.app", *args, "--url", ctl.url, "--token",
                               ctl.tokens["viewer"]], capture_output=True, text=True, timeout=60,
                              env={**ctl.env(), "COLUMNS": "250"})

    out = cli("rollout", "explain", str(rid), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["strata"][0]["deciding_metric"] == "launches:bias_gelu@1"
    out = cli("rollout", "explain", str(rid), "--stratum", s["stratum"])
    assert out.returncode == 0, out.stderr
    line = next(ln for ln in out.stdout.splitlines() if "launches:bias_gelu@1" in ln and "deciding:" not in ln)
    assert "regress" in line and "yes" in line and "1 (stable)" in line
    out = cli("rollout", "status", str(rid))
    assert out.returncode == 0 and "launches:bias_gelu@1" in out.stdout, out.stdout + out.stderr
