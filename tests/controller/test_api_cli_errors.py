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
from tests.controller.serverutil import ControllerProcess, TestBundles, build_test_bundles
from tests.controller.test_cli_remote import kctl, ok


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> TestBundles:
    return build_test_bundles(tmp_path_factory.mktemp("bundles"), versions=("1.0.0",))


@pytest.fixture(scope="module")
def ctl(bundles: TestBundles, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControllerProcess]:
    tmp = tmp_path_factory.mktemp("cli-errors")
    with dbutil.fresh_database("sqlite", tmp) as url, \
            ControllerProcess(url, tmp, trusted_keys_dir=bundles.keys_dir) as proc:
        yield proc


def test_exit_codes_and_one_line_errors(ctl: ControllerProcess, bundles: TestBundles, tmp_path: Path) -> None:
    cases = [
        (kctl(ctl, "rollout", "status", "999999"), 4, "404 no rollout with id 999999"),
        (kctl(ctl, "promote", "1", "--from-step", "0", "--reason", "x", who="viewer"), 5,
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
    cases.append((kctl(ctl, "promote", str(rid), "--from-step", "0", "--reason", "x"), 3, "409"))  # terminal: refused
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
