"""kernelctl keys/bundle commands: exit codes 0/1/2/3 and one-line errors without tracebacks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from cli.bundle import bundle_app
from cli.keys import keys_app
from kernelpack.archive import read_archive, write_archive
from kernelpack.build import BuildResult
from tests.kernelpack.bundle_fixtures import *  # noqa: F403
from tests.kernelpack.bundle_fixtures import Keys, write_tiny_src

app = typer.Typer()
app.add_typer(keys_app, name="keys")
app.add_typer(bundle_app, name="bundle")


@pytest.fixture
def cli() -> CliRunner:
    return CliRunner()


def one_line_error(result) -> str:
    err = result.stderr.strip()
    assert "Traceback" not in result.output + err
    assert err.startswith("error: ") and "\n" not in err, err
    return err


def test_keys_generate(cli: CliRunner, tmp_path: Path) -> None:
    r = cli.invoke(app, ["keys", "generate", str(tmp_path / "k")])
    assert r.exit_code == 0, r.output
    kid = r.stdout.split()[2]
    assert (tmp_path / "k" / f"{kid}.key").exists() and (tmp_path / "k" / f"{kid}.pub").exists()


def test_build_verify_inspect(cli: CliRunner, keys: Keys, tmp_path: Path, aot_cache: Path,
                              tiny_bundle: BuildResult) -> None:
    src = write_tiny_src(tmp_path / "src")
    out = tmp_path / "t.kpack"
    r = cli.invoke(app, ["bundle", "build", str(src), "-o", str(out), "--key", str(keys.pair.private_path),
                         "--cache-dir", str(aot_cache)])
    assert r.exit_code == 0, r.output
    assert f"digest sha256:{tiny_bundle.digest}" in r.stdout
    assert out.read_bytes() == tiny_bundle.path.read_bytes()

    r = cli.invoke(app, ["bundle", "verify", str(out), "--trusted-keys", str(keys.trusted)])
    assert r.exit_code == 0 and f"signed by {keys.pair.key_id}" in r.stdout

    r = cli.invoke(app, ["bundle", "inspect", str(out)])
    assert r.exit_code == 0, r.output
    assert "tiny 0.1.0" in r.stdout and "bias_gelu" in r.stdout and "not verified" in r.stdout

    r = cli.invoke(app, ["bundle", "inspect", str(out), "--json", "--trusted-keys", str(keys.trusted)])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["verified"] and doc["digest"] == tiny_bundle.digest and doc["key_id"] == keys.pair.key_id
    assert doc["manifest"]["kernels"][0]["configs"]["sm_90"] == {"BLOCK_M": 2, "BLOCK_N": 64}


def test_verification_failures_exit_3(cli: CliRunner, keys: Keys, other_keys: Keys, tmp_path: Path,
                                      tiny_bundle: BuildResult) -> None:
    members = read_archive(tiny_bundle.path.read_bytes())
    members["kernels/bias_gelu.py"] += b"#"
    write_archive(tmp_path / "bad.kpack", members)
    r = cli.invoke(app, ["bundle", "verify", str(tmp_path / "bad.kpack"), "--trusted-keys", str(keys.trusted)])
    assert r.exit_code == 3
    assert "kernels/bias_gelu.py" in one_line_error(r)
    r = cli.invoke(app, ["bundle", "verify", str(tiny_bundle.path), "--trusted-keys", str(other_keys.trusted)])
    assert r.exit_code == 3 and keys.pair.key_id in one_line_error(r)
    r = cli.invoke(app, ["bundle", "verify", str(tiny_bundle.path), "--trusted-keys", str(keys.trusted),
                         "--max-member-mib", "1", "--max-total-mib", "1"])
    assert r.exit_code in (0, 3)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "bundle.toml").write_text('schema_version = 1\nname = "x"\n')
    r = cli.invoke(app, ["bundle", "build", str(tmp_path / "src"), "-o", str(tmp_path / "o.kpack"),
                         "--key", str(keys.pair.private_path)])
    assert r.exit_code == 3 and "version: Field required" in one_line_error(r)


def test_other_errors_exit_1_and_usage_exit_2(cli: CliRunner, keys: Keys, tmp_path: Path) -> None:
    src = write_tiny_src(tmp_path / "src")
    r = cli.invoke(app, ["bundle", "build", str(src), "-o", str(tmp_path / "o.kpack"), "--key",
                         str(tmp_path / "missing.key")])
    assert r.exit_code == 1 and "cannot read private key" in one_line_error(r)
    r = cli.invoke(app, ["bundle", "verify", str(tmp_path / "x.kpack"), "--trusted-keys", str(tmp_path / "nokeys")])
    assert r.exit_code == 1 and "trusted-keys directory" in one_line_error(r)
    r = cli.invoke(app, ["bundle", "verify", str(tmp_path / "x.kpack")])
    assert r.exit_code == 2
    r = cli.invoke(app, ["bundle", "frobnicate"])
    assert r.exit_code == 2
    r = cli.invoke(app, ["keys", "generate", str(keys.pair.private_path.parent)])
    assert r.exit_code in (0, 1)


def test_build_no_aot_and_aot_arch(cli: CliRunner, keys: Keys, tmp_path: Path, aot_cache: Path) -> None:
    src = write_tiny_src(tmp_path / "src")
    key = str(keys.pair.private_path)
    r = cli.invoke(app, ["bundle", "build", str(src), "-o", str(tmp_path / "s.kpack"), "--key", key, "--no-aot",
                         "--cache-dir", str(tmp_path / "empty-cache")])
    assert r.exit_code == 0 and "0 artifacts" in r.output, r.output
    r = cli.invoke(app, ["bundle", "verify", str(tmp_path / "s.kpack"), "--trusted-keys", str(keys.trusted)])
    assert r.exit_code == 0, r.output
    r = cli.invoke(app, ["bundle", "build", str(src), "-o", str(tmp_path / "a.kpack"), "--key", key,
                         "--aot-arch", "sm_90", "--cache-dir", str(aot_cache)])
    assert r.exit_code == 0 and "3 artifacts" in r.output, r.output
    r = cli.invoke(app, ["bundle", "build", str(src), "-o", str(tmp_path / "b.kpack"), "--key", key,
                         "--aot-arch", "sm_75"])
    assert r.exit_code == 1 and "cannot compile ahead of time for sm_75" in one_line_error(r)
    assert not (tmp_path / "b.kpack").exists()
