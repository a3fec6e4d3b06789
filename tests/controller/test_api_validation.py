"""Validation against a REAL `kernelctl serve` on SQLite and PostgreSQL: NaN/negative figures 422 naming the
field, unknown node 404, a replayed batch counted once, oversized uploads 413 before being read, health,
readiness, metrics and OpenAPI."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.controller.serverutil import (
    ControllerProcess,
    TestBundles,
    controller_fixtures,
    ok_report,
    register_node,
)

MAX_BUNDLE = 1024 * 1024
PLAN = {"steps": [{"nodes": 1, "bake_seconds": 3600, "min_samples": 1000, "deadline_seconds": 7200}]}


bundles, ctl = controller_fixtures("validation", max_bundle_bytes=MAX_BUNDLE,
                                    extra_env={"KERNELCTL_API_DOCS": "true"})


@pytest.fixture(scope="module")
def trial(ctl: ControllerProcess, bundles: TestBundles) -> dict:
    """A running rollout with one canary node; returns the node's trial spec (and its client in 'node')."""
    with ctl.client("operator") as op:
        r = op.post("/v1/bundles", content=bundles.files["1.0.0"].read_bytes())
        assert r.status_code == 201, r.text
        node = register_node(ctl, "gpu-val-1")
        r = op.post("/v1/rollouts", json={"bundle": "llm-fused@1.0.0", "plan": PLAN, "reason": "validation"})
        assert r.status_code == 201, r.text
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the leader's tick begins the rollout and picks the canary
        hb = node.post("/v1/agents/heartbeat", json={"node_name": "gpu-val-1"}).json()
        trials = [d["trial"] for d in hb["desired"] if d.get("trial")]
        if trials:
            return {**trials[0], "node": node}
        time.sleep(0.2)
    raise AssertionError(f"no trial assigned: {hb}")


def _post_batch(node: httpx.Client, reports: list[dict], *, raw: str | None = None) -> httpx.Response:
    if raw is not None:
        return node.post("/v1/agents/reports", content=raw, headers={"Content-Type": "application/json"})
    return node.post("/v1/agents/reports", json={"node_name": "gpu-val-1", "reports": reports})


def _fields(r: httpx.Response) -> list[str]:
    assert r.status_code == 422, r.text
    return [".".join(str(x) for x in e["loc"]) for e in r.json()["detail"]]


def test_nan_and_negative_latency_refused_with_field(ctl: ControllerProcess, trial: dict) -> None:
    node = trial["node"]
    good = ok_report("val-nan-000001", trial)
    nan = json.loads(json.dumps(good))
    nan["latency"][0]["candidate_s"] = "__NAN__"
    raw = json.dumps({"node_name": "gpu-val-1", "reports": [nan]}).replace('"__NAN__"', "NaN")
    r = _post_batch(node, [], raw=raw)
    assert _fields(r) == ["body.reports.0.latency.0.candidate_s"]
    assert "finite" in r.json()["detail"][0]["msg"]
    neg = json.loads(json.dumps(good))
    neg["latency"][0]["stable_s"] = -0.001
    assert _fields(_post_batch(node, [neg])) == ["body.reports.0.latency.0.stable_s"]
    absurd = json.loads(json.dumps(good))
    absurd["peak_memory_bytes"] = 2**60
    assert _fields(_post_batch(node, [absurd])) == ["body.reports.0.peak_memory_bytes"]
    inf = json.loads(json.dumps(good))
    inf["numerics"][0]["max_abs_err"] = "__INF__"
    raw = json.dumps({"node_name": "gpu-val-1", "reports": [inf]}).replace('"__INF__"', "Infinity")
    assert _fields(_post_batch(node, [], raw=raw)) == ["body.reports.0.numerics.0.max_abs_err"]
    # nothing was stored by the refused batches: the good report is still new
    r = _post_batch(node, [good])
    assert r.json() == {"accepted": 1, "duplicates": 0}


def test_replayed_batch_counted_once(ctl: ControllerProcess, trial: dict) -> None:
    node = trial["node"]
    batch = [ok_report(f"val-replay-{i:04d}", trial) for i in range(5)]
    assert _post_batch(node, batch).json() == {"accepted": 5, "duplicates": 0}
    assert _post_batch(node, batch).json() == {"accepted": 0, "duplicates": 5}
    more = [*batch[:2], ok_report("val-replay-new1", trial)]
    assert _post_batch(node, more).json() == {"accepted": 1, "duplicates": 2}
    metrics = httpx.get(ctl.url + "/metrics").text
    assert 'kernelctl_reports_ingested_total{outcome="duplicate"} 7.0' in metrics


def test_report_for_unknown_rollout_refused_whole_batch(ctl: ControllerProcess, trial: dict) -> None:
    node = trial["node"]
    bad = {**ok_report("val-bad-000002", trial), "rollout_id": 999999}
    good = ok_report("val-bad-000001", trial)
    r = _post_batch(node, [good, bad])
    assert r.status_code == 422 and "rollout 999999 does not exist" in r.json()["detail"][0]["msg"]
    assert _post_batch(node, [good]).json() == {"accepted": 1, "duplicates": 0}  # nothing partially written


def test_unknown_node_404(ctl: ControllerProcess, trial: dict) -> None:
    # a valid node token whose node row does not exist: issue one with `kernelctl token create`
    import subprocess

    from tests.controller.serverutil import cli_command

    out = subprocess.run([*cli_command(), "token", "create", "--role", "agent", "--node", "ghost-1",
                          "--db", ctl.db_url], capture_output=True, text=True, timeout=120, check=True)
    ghost = out.stdout.strip().splitlines()[-1]
    with ctl.client(token=ghost) as c:
        r = c.post("/v1/agents/heartbeat", json={"node_name": "ghost-1"})
        assert r.status_code == 404 and "node ghost-1 is not registered" in r.json()["detail"]
        r = c.post("/v1/agents/reports", json={"node_name": "ghost-1", "reports": [ok_report("ghost-00001", trial)]})
        assert r.status_code == 404
    with ctl.client("operator") as op:
        assert op.get("/v1/bundles/llm-fused/9.9.9").status_code == 404
        r = op.get("/v1/rollouts/424242")
        assert r.status_code == 404 and r.json() == {"detail": "no rollout with id 424242"}
        assert op.post("/v1/rollouts/424242/pause", json={}).status_code == 404


def test_oversized_bundle_413(ctl: ControllerProcess) -> None:
    with ctl.client("operator") as op:
        big = b"\0" * (MAX_BUNDLE + 1)
        r = op.post("/v1/bundles", content=big)
        assert r.status_code == 413 and "over the limit" in r.json()["detail"]

        def chunks() -> Iterator[bytes]:  # no Content-Length: refused while streaming
            for _ in range(64):
                yield b"\0" * 65536

        r = op.post("/v1/bundles", content=chunks())
        assert r.status_code == 413
        assert op.get("/v1/audit", params={"action": "bundle.*"}).json()[-1]["bundle"] == "llm-fused@1.0.0"


def test_bad_bundle_and_body_refused(ctl: ControllerProcess, bundles: TestBundles) -> None:
    with ctl.client("operator") as op:
        data = bytearray(bundles.files["1.0.0"].read_bytes())
        data[len(data) // 2] ^= 0xFF
        r = op.post("/v1/bundles", content=bytes(data))
        assert r.status_code == 422 and r.json()["detail"][0]["msg"].startswith("bundle refused")
        assert op.post("/v1/bundles", content=b"").status_code == 422
        r = op.post("/v1/rollouts", json={"bundle": "not a ref"})
        assert _fields(r) == ["body.bundle"]
        r = op.post("/v1/rollouts", json={"bundle": "llm-fused@1.0.0", "plan": {"steps": [{"percent": 150}]}})
        assert _fields(r) == ["body.plan.steps.0.percent"]
        r = op.post("/v1/rollouts/1/rollback", json={})
        assert _fields(r) == ["body.reason"]
        r = op.post("/v1/rollouts", content=b"{not json", headers={"Content-Type": "application/json"})
        assert r.status_code == 422


def test_health_ready_metrics_openapi(ctl: ControllerProcess) -> None:
    assert httpx.get(ctl.url + "/healthz").json() == {"status": "ok"}
    ready = httpx.get(ctl.url + "/readyz").json()
    assert ready["ready"] is True and ready["leader"] is True
    text = httpx.get(ctl.url + "/metrics").text
    for name in ("kernelctl_leader 1.0", "kernelctl_rollouts{state=", "kernelctl_nodes{arch=",
                 "kernelctl_rollout_step_age_seconds", "kernelctl_tick_duration_seconds_count",
                 'kernelctl_http_request_duration_seconds_count{method="GET",route="/v1/rollouts/{rollout_id}"'):
        assert name in text, name
    assert "gpu-val-1" not in text  # no per-node labels
    spec = httpx.get(ctl.url + "/openapi.json").json()
    for path in ("/v1/agents/register", "/v1/agents/heartbeat", "/v1/agents/reports", "/v1/bundles",
                 "/v1/bundles/{name}/{version}/content", "/v1/rollouts/{rollout_id}/rollback", "/v1/audit"):
        assert path in spec["paths"], path


def test_malformed_per_cell_data_refused_with_field(ctl: ControllerProcess, trial: dict) -> None:
    node = trial["node"]
    good = ok_report("val-cell-000001", trial)
    good["resources"] = [{"op": "bias_gelu", "tokens": 16, "stable_peak_bytes": 100, "candidate_peak_bytes": 100,
                          "stable_launches": 1, "candidate_launches": 1}]
    good["weights"] = [{"op": "bias_gelu", "tokens": 16, "weight": 2.0}]
    good["e2e_pairs"] = [{"stable_s": 1e-3, "candidate_s": 1e-3}]
    dup = json.loads(json.dumps(good))
    dup["resources"] = dup["resources"] * 2
    r = _post_batch(node, [dup])
    assert _fields(r) == ["body.reports.0.resources"] and "bias_gelu@16 appears twice" in r.json()["detail"][0]["msg"]
    neg = json.loads(json.dumps(good))
    neg["resources"][0]["candidate_launches"] = -1
    assert _fields(_post_batch(node, [neg])) == ["body.reports.0.resources.0.candidate_launches"]
    nan = json.loads(json.dumps(good))
    nan["weights"][0]["weight"] = "__NAN__"
    raw = json.dumps({"node_name": "gpu-val-1", "reports": [nan]}).replace('"__NAN__"', "NaN")
    assert _fields(_post_batch(node, [], raw=raw)) == ["body.reports.0.weights.0.weight"]
    zero = json.loads(json.dumps(good))
    zero["e2e_pairs"][0]["stable_s"] = 0
    assert _fields(_post_batch(node, [zero])) == ["body.reports.0.e2e_pairs.0.stable_s"]
    extra = json.loads(json.dumps(good))
    extra["resources"][0]["bogus"] = 1
    assert _fields(_post_batch(node, [extra])) == ["body.reports.0.resources.0.bogus"]
    # nothing was stored by the refused batches: the good report is still new
    assert _post_batch(node, [good]).json() == {"accepted": 1, "duplicates": 0}


def _real(key: str, trial: dict, kb: float = 8.0, **changes: object) -> dict:
    import random

    from sim.fleet.realreport import real_report

    spec = {k: v for k, v in trial.items() if k != "node"}
    return {**real_report(key, spec, kb=kb, rng=random.Random(key)), **changes}


def test_agent_outbox_keeps_the_good_reports_of_a_refused_request(ctl: ControllerProcess, trial: dict,
                                                                   tmp_path) -> None:
    """The agent's outbox sends what is waiting in one request, its cell tables as columns (the real client);
    the controller refuses that request for one bad report (422, nothing stored); the outbox then finds the bad
    one, keeps it as rejected with the controller's reason (never resent) and the good ones are stored."""
    from agents.client import ControllerClient
    from agents.daemon import _refused
    from agents.outbox import Outbox
    from kernelctl import wire

    node = trial["node"]
    token = node.headers["Authorization"].removeprefix("Bearer ")
    good = [wire.TrialReport.model_validate(_real(f"val-box-good-{i}", trial)) for i in range(3)]
    bad = wire.TrialReport.model_validate({**_real("val-box-bad-00", trial), "rollout_id": 999999})
    box = Outbox(tmp_path / "outbox.db")
    client = ControllerClient(ctl.url, token, max_attempts=1)
    requests: list[int] = []

    def send(batch: list[wire.TrialReport]) -> wire.ReportBatchResponse:
        requests.append(len(batch))
        return client.send_reports("gpu-val-1", batch)

    try:
        for r in (good[0], bad, *good[1:]):
            box.add(r)
        assert box.flush(send, refuses=_refused) == 4
        assert requests == [4, 1, 1, 1, 1] and client.report_columns  # one request, then one by one
        ((key, reason),) = box.rejected()
        assert key == bad.idempotency_key and "rollout 999999 does not exist" in reason
        assert box.depth() == 0 and box.flush(send, refuses=_refused) == 0 and requests == [4, 1, 1, 1, 1]
    finally:
        client.close()
        box.close()
    # stored once each, as columns: the same reports sent again as lists are duplicates
    assert _post_batch(node, [r.model_dump(mode="json") for r in good]).json() == {"accepted": 0, "duplicates": 3}


def test_malformed_columns_refused_with_what_is_wrong(ctl: ControllerProcess, trial: dict) -> None:
    """A compact report (encoding 2) whose columns do not make a table is refused (422) naming the table and
    what is wrong; nothing of the batch is stored."""
    from kernelctl import wire

    node = trial["node"]
    good = wire.TrialReport.model_validate(_real("val-col-000001", trial)).compact().model_dump(mode="json")
    cols = good["columns"]

    def bad(path: str, value: object) -> dict:
        doc = json.loads(json.dumps(good))
        *parents, last = path.split(".")
        target = doc["columns"]
        for p in parents:
            target = target[p]
        target[last] = value
        return doc

    cases = [
        (bad("cells.stable.mean_s", cols["cells"]["stable"]["mean_s"][:-1]), "body.reports.1.columns.cells.stable",
         "column mean_s has"),
        (bad("cells.candidate.p50_s", [1.0] * len(cols["cells"]["op"])), "body.reports.1.columns.cells.candidate",
         "row 0: p50_s 1.0 is above p99_s"),
        (bad("cells.tokens", [1] * len(cols["cells"]["op"])), "body.reports.1.columns.cells",
         "appears twice"),
        (bad("weights.weight", [-1.0, *cols["weights"]["weight"][1:]]), "body.reports.1.columns.weights.weight.0",
         "greater than or equal to 0"),
        (bad("resources.stable_launches", [1]), "body.reports.1.columns.resources", "column stable_launches has 1"),
        ({**good, "cells": _real("x-000001", trial)["cells"]}, "body.reports.1", "not both"),
    ]
    for doc, loc, msg in cases:
        r = _post_batch(node, [_real("val-col-000002", trial), doc])
        assert _fields(r) == [loc], (loc, r.text)
        assert msg in r.json()["detail"][0]["msg"], (msg, r.text)
    assert _post_batch(node, [good]).json() == {"accepted": 1, "duplicates": 0}  # nothing partially written
