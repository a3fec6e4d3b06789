"""``GET /v1/rollouts/{id}/explain`` and ``kernelctl rollout explain`` against a REAL `kernelctl serve`: reports
with per-cell launches reach the judge through HTTP, the launch gate rolls the stratum back, and explain shows
every metric with which one decided, plus the verdict history; ``rollout status`` shows the deciding metric."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

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


def test_a_numeric_rollback_names_what_failed_everywhere(tmp_path: Path, bundles: TestBundles) -> None:
    """Two canaries report the same golden check over tolerance: the verdict's reason (hence explain, the CLI,
    the page and the audit trail) and the webhook name op, dtype, shape, check, error, tolerance and the nodes;
    the verdict's samples are the failing reports (not 0)."""
    from tests import dbutil
    from tests.controller.webhook import WebhookReceiver

    plan = {"steps": [{"nodes": 2, "bake_seconds": 0, "min_samples": 3, "deadline_seconds": 600}],
            "hold_verdict_seconds": 0, "max_fleet_share": 1.0}
    with WebhookReceiver() as hook, dbutil.fresh_database("sqlite", tmp_path) as url, ControllerProcess(
            url, tmp_path, trusted_keys_dir=bundles.keys_dir,
            extra_env={"KERNELCTL_NOTIFY_URLS": hook.url, "KERNELCTL_PUBLIC_URL": "https://kctl.example"}) as ctl:
        nodes = {n: register_node(ctl, n) for n in ("gpu-num-a", "gpu-num-b", "gpu-num-c")}
        with ctl.client("operator") as op:
            for v in ("1.0.0", "1.1.0"):
                assert op.post("/v1/bundles", content=bundles.files[v].read_bytes()).status_code == 201
            r = op.post("/v1/rollouts", json={"bundle": "llm-fused@1.0.0", "reason": "baseline"}).json()
            assert op.post(f"/v1/rollouts/{r['id']}/promote", json={"full": True, "reason": "t"}).status_code == 200
            rid = op.post("/v1/rollouts", json={"bundle": "llm-fused@1.1.0", "plan": plan, "reason": "t"}).json()["id"]
        def trials() -> dict[str, dict] | None:  # the two canaries (a canary never takes a whole stratum)
            out = {}
            for name, node in nodes.items():
                hb = node.post("/v1/agents/heartbeat", json={"node_name": name}).json()
                mine = [d["trial"] for d in hb["desired"] if d.get("trial") and d["trial"]["rollout_id"] == rid]
                if mine:
                    out[name] = mine[0]
            return out if len(out) == 2 else None

        reports = {}
        for name, spec in wait_for(trials, 30, "two canaries' trial specs").items():
            rep = ok_report(f"{name}-numeric-1", spec)
            rep["outcome"] = "numeric_error"
            rep["numerics"] = [
                {"op": "bias_gelu", "dtype": "fp32", "shape": {"M": 8, "N": 64}, "max_abs_err": 1e-7,
                 "max_rel_err": 1e-6, "within_tolerance": True, "kind": "fuzz"},
                {"op": "bias_gelu", "dtype": "fp32", "shape": {"M": 8, "N": 1032}, "max_abs_err": 0.317,
                 "max_rel_err": 0.05, "within_tolerance": False, "kind": "golden"}]
            reports[name] = rep
        for name, rep in reports.items():  # both in before the tick judges: one batch each, back to back
            assert nodes[name].post("/v1/agents/reports", json={"node_name": name, "reports": [rep]}).status_code == 200
        with ctl.client("viewer") as viewer:
            wait_for(lambda: viewer.get(f"/v1/rollouts/{rid}").json()["state"] == "rolled_back", 30, "the rollback")
            (s,) = viewer.get(f"/v1/rollouts/{rid}/explain").json()["strata"]
            audit = viewer.get("/v1/audit", params={"action": "rollout.stratum_rolled_back"}).json()
        what = re.compile(r"bias_gelu fp32 M=8 N=1032, golden check: max_abs_err 0\.317 > atol \S+ \+ rtol \S+\*\|ref\|"
                          r" \(max_rel_err 0\.05\) \(2 numeric_error report\(s\) from 2 node\(s\): "
                          + re.escape(", ".join(sorted(reports))) + r"\)")
        assert s["gate"] == "numeric" and what.search(s["reason"]), s["reason"]
        f = s["failure"]
        assert f["check"]["op"] == "bias_gelu" and f["check"]["shape"] == {"M": 8, "N": 1032}
        assert f["check"]["check"] == "golden" and f["check"]["max_abs_err"] == 0.317
        assert f["nodes"] == sorted(reports) and f["reports"] == {"numeric_error": 2}
        assert set(f["tolerance"]) == {"atol", "rtol"} and f["tolerance"]["atol"] < 0.317
        assert any(what.search(e["reason"] or "") for e in audit if e["rollout_id"] == rid)

        def cli(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "cli.app", *args, "--url", ctl.url, "--token",
                                   ctl.tokens["viewer"]], capture_output=True, text=True, timeout=60,
                                  env={**ctl.env(), "COLUMNS": "120"})

        for args in (("rollout", "explain", str(rid)), ("rollout", "status", str(rid))):
            out = cli(*args)
            assert out.returncode == 0, out.stderr
            flat = " ".join(out.stdout.replace("│", " ").split())
            assert "bias_gelu fp32 M=8 N=1032" in flat and "golden" in flat and "0.317" in flat, out.stdout
            assert all(n in flat for n in reports), out.stdout
        body = wait_for(lambda: next((b for b in hook.bodies if b["kind"] == "rolled_back"), None), 30, "the webhook")
        assert what.search(body["text"]) and body["failure"]["check"]["op"] == "bias_gelu"
        assert body["evidence"]["samples"] == 2 and body["url"] == f"https://kctl.example/ui/#/rollouts/{rid}"


def test_numeric_detail_of_stored_reports_old_and_new(db_url: str, tmp_path: Path) -> None:
    """The failing check is read from reports stored before ``failed_checks`` existed (their numerics summary and
    the trial's text) as well as after; its tolerance is the stricter of the candidate's and stable's manifests;
    failing checks are ordered over-tolerance first."""
    from controller import numeric_detail
    from controller.db.models import Report
    from controller.rollouts import promote, start_rollout
    from kernelctl import wire
    from tests.controller.enginekit import T0, Kit

    kit = Kit(db_url, tmp_path)
    try:
        names = kit.nodes(2, prefix="h")
        b0 = kit.push("1.0.0", tolerances={"fp32": (1e-5, 1e-6)})
        b1 = kit.push("1.1.0", tolerances={"fp32": (1e-6, 1e-5)})
        with kit.tx() as s:
            promote(s, start_rollout(s, "llm-fused@1.0.0", actor="t").id, actor="t", full=True)
        with kit.tx() as s:
            rid = start_rollout(s, "llm-fused@1.1.0", actor="t", accept_contract_change="test").id
        checks = [wire.NumericCheck(op="bias_gelu", dtype="fp32", shape={"tokens": 8}, max_abs_err=1e-7,
                                    max_rel_err=1e-7, within_tolerance=True, kind="fuzz"),
                  wire.NumericCheck(op="bias_gelu", dtype="fp32", shape={"tokens": 8}, max_abs_err=1e-7,
                                    max_rel_err=1e-7, within_tolerance=True, vs_stable_max_abs=0.5,
                                    vs_stable_within=False, kind="production"),
                  wire.NumericCheck(op="bias_gelu", dtype="fp32", shape={"tokens": 4096}, max_abs_err=0.02,
                                    max_rel_err=0.1, within_tolerance=False, kind="golden", nonfinite=3)]
        cand, stable = kit.ref(b1), kit.ref(b0)
        with kit.tx() as s:
            new = numeric_detail.failed_checks(kit.report(kit.node(s, names[0]), rid, cand, stable,
                                                          outcome="numeric_error", numerics=checks))
        assert [(c["check"], c["failed"]) for c in new] == [("golden", "tolerance"), ("production", "vs_stable")]
        legacy = {"numerics": {"worst": {"op": "bias_gelu", "dtype": "fp32", "shape": {"tokens": 16},
                                         "max_abs_err": 0.25}},
                  "text": "1 numeric check(s) over tolerance; first: edge/zero_rows bias_gelu fp32 {'tokens': 16} "
                          "max_abs_err=0.25 nonfinite=0 unwritten=0"}
        stratum = "sm_90/drv550/triton3.6.0"
        with kit.tx() as s:
            for i, (name, detail) in enumerate(((names[0], legacy), (names[1], {"failed_checks": new}))):
                s.add(Report(idempotency_key=f"k{i}", node_id=kit.node(s, name).id, rollout_id=rid, stratum=stratum,
                             bundle_id=b1, stable_bundle_id=b0, outcome="numeric_error", measured_at=T0,
                             received_at=T0, detail=detail))
        with kit.tx() as s:
            (f,) = numeric_detail.numeric_failures(s, {(rid, stratum)}).values()
        assert f["check"]["check"] == "edge" and f["check"]["case"] == "zero_rows" and f["check"]["max_abs_err"] == 0.25
        assert f["tolerance"] == {"atol": 1e-6, "rtol": 1e-6} and f["nodes"] == sorted(names)
        assert numeric_detail.describe(f) == (
            "bias_gelu fp32 tokens=16, edge/zero_rows check: max_abs_err 0.25 > atol 1e-06 + rtol 1e-06*|ref| "
            f"(2 numeric_error report(s) from 2 node(s): {', '.join(sorted(names))})")
        assert numeric_detail.error_and_tolerance(f) == (0.25, 1e-6)
    finally:
        kit.close()
