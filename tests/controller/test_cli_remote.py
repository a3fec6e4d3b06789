"""The operator CLI (`kernelctl --url ... <command>`) against a REAL `kernelctl serve`, SQLite and PostgreSQL:
a whole rollout driven from the command line, and the exit codes with one clear line on stderr."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from tests.controller.serverutil import (
    ControllerProcess,
    TestBundles,
    cli_command,
    controller_fixtures,
    register_node,
)

PLAN = {"steps": [{"nodes": 1, "bake_seconds": 3600, "min_samples": 100, "deadline_seconds": 7200},
                  {"percent": 100, "bake_seconds": 3600, "min_samples": 100, "deadline_seconds": 7200}],
        "max_fleet_share": 1.0, "max_label_share": 1.0}


bundles, ctl = controller_fixtures("cli", versions=("1.0.0", "1.1.0"))


def kctl(ctl: ControllerProcess, *args: str, who: str = "operator", token: str | None = None,
         url: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNELCTL_")}
    env["COLUMNS"] = "200"
    tok = token if token is not None else ctl.tokens[who]
    cmd = [*cli_command(), "--url", url or ctl.url, *(["--token", tok] if tok else []), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


def ok(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, f"rc={proc.returncode}\nstdout={proc.stdout}\nstderr={proc.stderr}"
    return proc.stdout


def wait_state(ctl: ControllerProcess, rid: int, want: str, timeout: float = 30) -> dict:
    with ctl.client("viewer") as v:
        deadline = time.monotonic() + timeout
        while True:
            r = v.get(f"/v1/rollouts/{rid}").json()
            if r["state"] == want or time.monotonic() > deadline:
                return r
            time.sleep(0.2)


def test_rollout_driven_from_the_cli(ctl: ControllerProcess, bundles: TestBundles, tmp_path: Path) -> None:
    out = ok(kctl(ctl, "bundle", "push", str(bundles.files["1.0.0"])))
    assert "registered llm-fused@1.0.0" in out
    listed = json.loads(ok(kctl(ctl, "bundle", "list", "--json", who="viewer")))
    assert [b["ref"] for b in listed] == ["llm-fused@1.0.0"]
    for i in range(3):
        register_node(ctl, f"gpu-cli-{i}").close()
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(PLAN))
    started = json.loads(ok(kctl(ctl, "rollout", "start", "llm-fused@1.0.0", "--plan", str(plan),
                                 "--reason", "first kernels", "--json")))
    rid = started["id"]
    assert [s["stratum"] for s in started["strata"]] == ["sm_90/drv550/triton3.6.0"]
    assert wait_state(ctl, rid, "progressing")["state"] == "progressing"
    status = json.loads(ok(kctl(ctl, "rollout", "status", str(rid), "--json", who="viewer")))
    assert status["strata"][0]["nodes"]["assigned"] == 1 and status["strata"][0]["nodes"]["fleet"] == 3
    table = ok(kctl(ctl, "rollout", "status", str(rid), who="viewer"))
    assert "sm_90/drv550/triton3.6.0" in table and "progressing" in table
    # operator steps it: to 100%, then full promotion
    ok(kctl(ctl, "promote", str(rid), "--from-step", "1", "--reason", "canary looks fine"))
    status = json.loads(ok(kctl(ctl, "rollout", "status", str(rid), "--json")))
    assert status["strata"][0]["step_index"] == 1 and status["strata"][0]["nodes"]["assigned"] == 3
    # the same command again is a duplicate: refused (exit 3), one line, nothing changes
    dup = kctl(ctl, "promote", str(rid), "--from-step", "1", "--reason", "canary looks fine")
    assert dup.returncode == 3 and "not at step 1" in dup.stderr and "Traceback" not in dup.stderr, dup.stderr
    assert json.loads(ok(kctl(ctl, "rollout", "status", str(rid), "--json")))["step_index"] == 1
    ok(kctl(ctl, "promote", str(rid), "--full", "--reason", "ship it"))
    assert wait_state(ctl, rid, "promoted")["state"] == "promoted"
    compat = json.loads(ok(kctl(ctl, "compat", "--json", who="viewer")))
    assert {(c["bundle"], c["state"]) for c in compat} == {("llm-fused@1.0.0", "stable")}
    assert "stable" in ok(kctl(ctl, "compat", who="viewer"))

    # second version: start, pause, resume, roll back
    ok(kctl(ctl, "bundle", "push", str(bundles.files["1.1.0"])))
    rid2 = json.loads(ok(kctl(ctl, "rollout", "start", "llm-fused@1.1.0", "--plan", str(plan), "--json")))["id"]
    assert wait_state(ctl, rid2, "progressing")["state"] == "progressing"
    ok(kctl(ctl, "pause", str(rid2), "--reason", "holiday"))
    assert wait_state(ctl, rid2, "paused")["state"] == "paused"
    ok(kctl(ctl, "resume", str(rid2)))
    ok(kctl(ctl, "rollback", str(rid2), "--reason", "p99 regression seen in serving"))
    final = json.loads(ok(kctl(ctl, "rollout", "status", str(rid2), "--watch", "--json", who="viewer")))
    assert final["state"] == "rolled_back"
    shown = json.loads(ok(kctl(ctl, "bundle", "show", "llm-fused@1.1.0", "--json")))
    assert shown["status"] == "revoked"
    nodes = json.loads(ok(kctl(ctl, "nodes", "--json", who="viewer")))
    assert {n["active"].get("llm-fused") for n in nodes} <= {None, "1.0.0"}
    assert all(n["desired"].get("llm-fused") == "1.0.0" for n in nodes)
    rollouts = json.loads(ok(kctl(ctl, "rollout", "list", "--json", who="viewer")))
    assert [(r["id"], r["state"]) for r in rollouts] == [(rid2, "rolled_back"), (rid, "promoted")]
    # the changelog says who did what and why
    with ctl.client("viewer") as v:
        events = v.get("/v1/audit", params={"action": "rollout.*", "limit": 100}).json()
    by_action = {(e["action"], e["rollout_id"]): e for e in events}
    assert by_action[("rollout.rolled_back", rid2)]["actor"] == "operator:test-operator"
    assert by_action[("rollout.rolled_back", rid2)]["reason"] == "p99 regression seen in serving"
    assert by_action[("rollout.paused", rid2)]["reason"] == "holiday"
    assert by_action[("rollout.promoted", rid)]["reason"] == "ship it"
