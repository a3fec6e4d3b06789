"""CLI failure paths against a REAL `kernelctl serve`: exit codes (1 error, 2 usage, 3 refused, 4 not found,
5 auth) with one clear line on stderr and never a traceback; the root `kernelctl` script mounts the commands.

The exit codes do not depend on the database backend, so this runs on SQLite only (test_cli_remote.py
drives the full flow on both backends)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import dbutil
from tests.controller.serverutil import ControllerProcess, TestBundles, Zygote, build_test_bundles
from tests.controller.test_cli_remote import kctl, ok, wait_state


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> TestBundles:
    return build_test_bundles(tmp_path_factory.mktemp("bundles"), versions=("1.0.0", "1.1.0"), archs=("sm_80", "sm_90"))


@pytest.fixture(scope="module")
def ctl(bundles: TestBundles, tmp_path_factory: pytest.TempPathFactory, zygote: Zygote) -> Iterator[ControllerProcess]:
    tmp = tmp_path_factory.mktemp("cli-errors")
    with dbutil.fresh_database("sqlite", tmp) as url, \
            ControllerProcess(url, tmp, trusted_keys_dir=bundles.keys_dir, zygote=zygote) as proc:
        yield proc


def test_exit_codes_and_one_line_errors(ctl: ControllerProcess, bundles: TestBundles, tmp_path: Path) -> None:
    cases = [
        (kctl(ctl, "rollout", "status", "999999"), 4, "404 no rollout with id 999999"),
        (kctl(ctl, "promote", "1", "--from-step", "1", "--reason", "x", who="viewer"), 5,
         "403 role 'viewer' may not do this"),
        (kctl(ctl, "promote", "1", "--reason", "x"), 2, "--from-step is required"),
        (kctl(ctl, "rollout", "list", token="kctl_bogus-token-000000000000"), 5, "401 unknown token"),
        (kctl(ctl, "rollout", "start", "nope"), 2, "bad bundle reference 'nope'"),
        (kctl(ctl, "rollout", "start", "llm-fused@7.7.7"), 4, "404"),
        (kctl(ctl, "bundle", "push", str(tmp_path / "missing.kpack")), 2, "cannot read"),
        (kctl(ctl, "nodes", url="http://127.0.0.1:9"), 1, "cannot reach the controller"),
    ]
    bad = tmp_path / "bad.kpack"
    bad.write_bytes(b"not a bundle")
    cases.append((kctl(ctl, "bundle", "push", str(bad)), 3, "422 bundle refused"))
    from tests.controller.serverutil import register_node

    ok(kctl(ctl, "bundle", "push", str(bundles.files["1.0.0"])))
    register_node(ctl, "gpu-err-1").close()
    rid = json.loads(ok(kctl(ctl, "rollout", "start", "llm-fused@1.0.0", "--json")))["id"]
    ok(kctl(ctl, "rollback", str(rid), "--reason", "test"))
    cases.append((kctl(ctl, "promote", str(rid), "--from-step", "1", "--reason", "x"), 3, "409"))  # terminal: refused
    cases.append((kctl(ctl, "rollback", str(rid), "--reason", "  "), 2, "--reason must not be empty"))
    for proc, code, text in cases:
        assert proc.returncode == code, (proc.args, proc.stdout, proc.stderr)
        assert text in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr + proc.stdout
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_root_kernelctl_script_mounts_the_controller_commands(ctl: ControllerProcess) -> None:
    script = Path(sys.executable).parent / "kernelctl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNELCTL_")}
    env.update({"KERNELCTL_URL": ctl.url, "KERNELCTL_TOKEN": ctl.tokens["viewer"]})
    proc = subprocess.run([str(script), "rollout", "list", "--json"], capture_output=True, text=True,
                          timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr
    assert isinstance(json.loads(proc.stdout), list)


def _kctl_cols(ctl: ControllerProcess, columns: int, *args: str, who: str = "operator",
               url: str | None = None) -> subprocess.CompletedProcess[str]:
    from tests.controller.serverutil import cli_command

    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNELCTL_")}
    env["COLUMNS"] = str(columns)
    cmd = [*cli_command(), "--url", url or ctl.url, "--token", ctl.tokens[who], *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


def test_usage_not_found_and_a_wrong_url_are_told_apart(ctl: ControllerProcess, bundles: TestBundles) -> None:
    """Exit 2 for a bad flag value (never an empty table, never "refused"), 4 for an unknown name, one line for
    a URL that is not a kernelctl controller (never its HTML); tables fold at 120 columns, never cut."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from tests.controller.serverutil import register_node

    ok(kctl(ctl, "bundle", "push", str(bundles.files["1.0.0"])))  # idempotent when already there
    register_node(ctl, "gpu-cols-1").close()
    usage = [
        (kctl(ctl, "compat", "--bundle", "nope", who="viewer"), 4, "no bundle named 'nope'"),
        (kctl(ctl, "nodes", "--state", "bogus", who="viewer"), 2, "--state 'bogus': expected one of active, stale"),
        (kctl(ctl, "rollout", "list", "--state", "bogus", who="viewer"), 2, "--state 'bogus': expected one of"),
        (kctl(ctl, "promote", "1", "--from-step", "-2", "--reason", "x"), 2, "steps are numbered from 1"),
    ]
    for proc, code, text in usage:
        assert proc.returncode == code, (proc.args, proc.stdout, proc.stderr)
        assert text in proc.stderr and "Traceback" not in proc.stderr + proc.stdout, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and not proc.stdout.strip(), proc.stdout + proc.stderr
    for args in (("rollout", "status", "--", "-1"), ("rollout", "explain", "0"), ("rollback", "--reason", "x", "--",
                                                                                     "-1")):
        proc = kctl(ctl, *args)
        assert proc.returncode == 2 and "Invalid value for 'rollout_id'" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr

    # audit reads the database: an unknown node is not found (4); a time before the node registered prints the
    # columns of that query (what was active) and says why nothing is there
    def audit(*args: str) -> subprocess.CompletedProcess[str]:
        return _kctl_cols(ctl, 200, "audit", "--db", ctl.db_url, *args)

    proc = audit("--node", "nope")
    assert proc.returncode == 4 and "unknown node 'nope'" in proc.stderr, proc.stderr
    proc = audit("--node", "nope", "--at", "1h")
    assert proc.returncode == 4 and "unknown node 'nope'" in proc.stderr, proc.stderr
    out = ok(audit("--node", "gpu-cols-1", "--at", "2001-01-01T00:00:00Z"))
    assert "0 row(s)" in out and all(c in out for c in ("bundle", "version", "active_since", "active_until"))
    assert "actor" not in out and "gpu-cols-1 registered at" in out and "nothing ran on it before that" in out

    # 120 columns: versions fold, never "llm-fused@1.…"
    rid = json.loads(ok(kctl(ctl, "rollout", "start", "llm-fused@1.0.0", "--json", "--force")))["id"]
    ok(kctl(ctl, "promote", str(rid), "--full", "--reason", "t"))
    out = ok(_kctl_cols(ctl, 120, "nodes", who="viewer"))
    assert "…" not in out and "llm-fused@1.0.0" in out.replace("│", "").replace(" ", "").replace("\n", ""), out

    class Page(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"<!DOCTYPE html>\n<html><head><title>Welcome to nginx!</title></head><body>hi</body></html>\n"
            self.send_response(404 if "rollouts" in self.path else 200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        other = f"http://127.0.0.1:{server.server_address[1]}"
        for args in (("nodes",), ("rollout", "status", "1")):
            proc = kctl(ctl, *args, url=other, who="viewer")
            assert proc.returncode == 1, (proc.stdout, proc.stderr)
            assert f"{other} is not a kernelctl controller" in proc.stderr and "<" not in proc.stderr, proc.stderr
            assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    finally:
        server.shutdown()
        server.server_close()


def test_an_operator_rollback_of_one_stratum_reads_the_same_everywhere(ctl: ControllerProcess,
                                                                       bundles: TestBundles) -> None:
    """One stratum rolled back by an operator, the other promoted: the transition's line, `rollout status`,
    `rollout list`, `explain` and `compat` all say partly_promoted with each stratum's outcome; steps from 1."""
    from tests.controller.serverutil import register_node

    a100, h100 = "sm_80/drv550/triton3.6.0", "sm_90/drv550/triton3.6.0"
    for name, arch in (("gpu-pp-80a", "sm_80"), ("gpu-pp-80b", "sm_80"), ("gpu-pp-90a", "sm_90")):
        register_node(ctl, name, arch=arch).close()
    ok(kctl(ctl, "bundle", "push", str(bundles.files["1.1.0"])))
    plan = {"steps": [{"nodes": 1, "bake_seconds": 3600, "min_samples": 100, "deadline_seconds": 7200},
                      {"percent": 100, "bake_seconds": 3600, "min_samples": 100, "deadline_seconds": 7200}],
            "max_fleet_share": 1.0, "max_label_share": 1.0}
    with ctl.client("operator") as op:
        r = op.post("/v1/rollouts", json={"bundle": "llm-fused@1.1.0", "plan": plan, "reason": "two strata"})
        assert r.status_code == 201, r.text
        rid = r.json()["id"]
    assert wait_state(ctl, rid, "progressing")["state"] == "progressing"  # the controller begins it
    out = ok(kctl(ctl, "rollback", str(rid), "--stratum", a100, "--reason", "p99 regressed on A100"))
    assert out.split() == ["rollout", str(rid), "llm-fused@1.1.0:", "progressing", "(step", "1)"], out
    out = ok(kctl(ctl, "promote", str(rid), "--full", "--reason", "ship the rest"))
    outcome = f"(promoted on {h100}; rolled back on {a100})"
    assert " ".join(out.split()) == f"rollout {rid} llm-fused@1.1.0: partly_promoted {outcome}", out
    flat = " ".join(ok(kctl(ctl, "rollout", "status", str(rid), who="viewer")).replace("│", " ").split())
    assert f"state partly_promoted {outcome} step 1/2" in flat, flat
    assert f"{a100}: rolled_back: p99 regressed on A100" in flat and f"{h100}: promoted: ship the rest" in flat
    listed = ok(kctl(ctl, "rollout", "list", "--state", "partly_promoted", who="viewer"))
    assert "partly_promoted" in listed and "llm-fused@1.1.0" in listed
    doc = json.loads(ok(kctl(ctl, "rollout", "explain", str(rid), "--json", who="viewer")))
    assert doc["state"] == "partly_promoted"
    assert {s["stratum"]: s["state"] for s in doc["strata"]} == {a100: "rolled_back", h100: "promoted"}
    cells = {c["stratum"]: c for c in json.loads(ok(kctl(ctl, "compat", "--json", who="viewer")))
             if c["bundle"] == "llm-fused@1.1.0"}
    assert (cells[a100]["state"], cells[h100]["state"]) == ("rolled_back", "stable")
    shown = json.loads(ok(kctl(ctl, "bundle", "show", "llm-fused@1.1.0", "--json")))
    assert shown["status"] != "revoked"
    events = json.loads(ok(_kctl_cols(ctl, 200, "audit", "--db", ctl.db_url, "--bundle", "llm-fused@1.1.0",
                                      "--action", "rollout.*", "--format", "json")))
    assert events[0]["action"] == "rollout.partly_promoted"
    assert not any(e["action"] == "rollout.promoted" for e in events)
    assert {e["payload"]["step"] for e in events if e["action"] == "rollout.progressing"} == {1}  # from 1
