"""``kernelctl agent`` refuses bad flags and files with one clear line and a meaningful exit code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from cli.agent import agent_command
from kernelpack.signing import generate_keypair

app = typer.Typer()
app.command()(agent_command)


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    kp = generate_keypair(tmp_path / "k")
    d = tmp_path / "trusted"
    d.mkdir()
    (d / kp.public_path.name).write_bytes(kp.public_path.read_bytes())
    return d


def invoke(*args: str) -> tuple[int, str]:
    r = CliRunner().invoke(app, list(args), env={"KERNELCTL_AGENT_TOKEN": ""})
    return r.exit_code, r.output


def test_missing_token(keys: Path, tmp_path: Path) -> None:
    code, out = invoke("--controller", "http://127.0.0.1:1", "--trusted-keys", str(keys),
                       "--cache-dir", str(tmp_path / "c"))
    assert code == 5 and "no agent token" in out


def test_bad_url_and_node_name(keys: Path) -> None:
    code, out = invoke("--controller", "ftp://x", "--token", "t", "--trusted-keys", str(keys))
    assert code == 2 and "invalid controller URL" in out
    code, out = invoke("--controller", "http://x", "--token", "t", "--trusted-keys", str(keys),
                       "--node-name", "bad name!")
    assert code == 2 and "invalid node name" in out


def test_trusted_keys_must_exist_and_hold_keys(tmp_path: Path) -> None:
    code, out = invoke("--controller", "http://x", "--token", "t", "--trusted-keys", str(tmp_path / "none"))
    assert code == 2 and "does not exist" in out
    (tmp_path / "empty").mkdir()
    code, out = invoke("--controller", "http://x", "--token", "t", "--trusted-keys", str(tmp_path / "empty"))
    assert code == 2 and "holds no *.pub key" in out


def test_bad_profile_and_overrides(keys: Path, tmp_path: Path) -> None:
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"batch_sizes": [-1]}))
    code, out = invoke("--controller", "http://x", "--token", "t", "--trusted-keys", str(keys), "--profile", str(prof))
    assert code == 2 and "batch_sizes" in out
    ov = tmp_path / "o.json"
    ov.write_text(json.dumps({"arch": "sm_90", "bogus": 1}))
    code, out = invoke("--controller", "http://x", "--token", "t", "--trusted-keys", str(keys),
                       "--inventory-overrides", str(ov))
    assert code == 2 and "bogus" in out
