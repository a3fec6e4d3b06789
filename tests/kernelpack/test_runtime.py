"""kernelpack.runtime: atomic publication of active versions, switching, and stable/reference fallbacks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import kernelpack.runtime as rt
from kernelpack.archive import read_archive, write_archive
from kernelpack.build import BuildResult, build_bundle
from kernelpack.runtime import ACTIVE_FILE, Runtime, publish_active, read_active, unpublish_active
from kernelpack.scaffold import write_source
from tests.kernelpack.bundle_fixtures import *  # noqa: F403
from tests.kernelpack.bundle_fixtures import REPO, Keys, write_tiny_src

X = {"x": torch.randn(3, 16), "bias": torch.randn(16)}


@pytest.fixture(scope="module")
def tiny_v2(tmp_path_factory: pytest.TempPathFactory, keys: Keys, aot_cache: Path) -> BuildResult:
    root = tmp_path_factory.mktemp("tiny2")
    return build_bundle(write_tiny_src(root / "src", version="0.2.0"), root / "tiny-0.2.0.kpack",
                        keys.pair.private_path, cache_dir=aot_cache)


def ref(b: BuildResult) -> dict:
    return {"version": b.manifest.version, "path": str(b.path), "digest": b.digest}


def test_publish_and_read(tmp_path: Path, tiny_bundle: BuildResult, tiny_v2: BuildResult) -> None:
    publish_active(tmp_path, "tiny", "0.2.0", tiny_v2.path, tiny_v2.digest, stable=ref(tiny_bundle))
    publish_active(tmp_path, "other", "0.1.0", tiny_bundle.path, tiny_bundle.digest)
    doc = read_active(tmp_path)
    assert doc["tiny"].version == "0.2.0" and doc["tiny"].stable.version == "0.1.0"
    assert doc["other"].stable is None
    raw = json.loads((tmp_path / ACTIVE_FILE).read_text())
    assert raw["tiny"]["digest"] == tiny_v2.digest and raw["tiny"]["stable"]["digest"] == tiny_bundle.digest
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp files left
    before = (tmp_path / ACTIVE_FILE).read_bytes()
    with pytest.raises(ValueError, match="invalid active entry"):
        publish_active(tmp_path, "tiny", "0.3.0", tiny_v2.path, "not-a-digest")
    assert (tmp_path / ACTIVE_FILE).read_bytes() == before


def test_unpublish_withdraws_one_bundle(tmp_path: Path, keys: Keys, tiny_bundle: BuildResult,
                                       tiny_v2: BuildResult) -> None:
    """A withdrawn bundle leaves the document (atomically, the others untouched): a serving runtime sees a new
    generation and runs the PyTorch reference, with no stable fallback left."""
    run = Runtime(tmp_path / "run", keys.trusted, tmp_path / "cache", arch="sm_90")
    publish_active(run.runtime_dir, "tiny", "0.2.0", tiny_v2.path, tiny_v2.digest, stable=ref(tiny_bundle))
    publish_active(run.runtime_dir, "other", "0.1.0", tiny_bundle.path, tiny_bundle.digest)
    assert run.get_op("bias_gelu", bundle="tiny").bundle == "tiny@0.2.0"
    gen = run.generation
    assert unpublish_active(run.runtime_dir, "tiny") is True
    assert set(read_active(run.runtime_dir)) == {"other"}
    assert [p.name for p in run.runtime_dir.iterdir() if p.name.startswith(".")] == []  # no temp files left
    op = run.get_op("bias_gelu", bundle="tiny")
    assert op.bundle == "reference" and run.generation == gen + 1 and run.served_key("tiny") == ("", "")
    assert "no active version of tiny published" in run.reason["tiny"]
    before = (run.runtime_dir / ACTIVE_FILE).read_bytes()
    assert unpublish_active(run.runtime_dir, "tiny") is False  # not published: nothing rewritten
    assert (run.runtime_dir / ACTIVE_FILE).read_bytes() == before
    assert unpublish_active(tmp_path / "never", "tiny") is False


def test_switches_versions_and_falls_back(tmp_path: Path, keys: Keys, tiny_bundle: BuildResult,
                                          tiny_v2: BuildResult, caplog: pytest.LogCaptureFixture) -> None:
    run = Runtime(tmp_path / "run", keys.trusted, tmp_path / "cache", arch="sm_90")
    with caplog.at_level("WARNING", logger="kernelpack.runtime"):
        op = run.get_op("bias_gelu", bundle="tiny")
    assert op.bundle == "reference" and not op.supported and "no active version of tiny" in caplog.text
    assert torch.equal(op(X)[0], op.op.eager(X)[0])

    publish_active(run.runtime_dir, "tiny", "0.2.0", tiny_v2.path, tiny_v2.digest, stable=ref(tiny_bundle))
    op2 = run.get_op("bias_gelu", bundle="tiny")
    assert op2.bundle == "tiny@0.2.0" and op2.supported
    assert torch.allclose(op2(X)[0].double(), op2.op.reference(X)[0], atol=1e-5, rtol=1e-5)
    assert op2.fallbacks == 0

    publish_active(run.runtime_dir, "tiny", "0.1.0", tiny_bundle.path, tiny_bundle.digest)
    assert run.get_op("bias_gelu", bundle="tiny").bundle == "tiny@0.1.0"
    publish_active(run.runtime_dir, "tiny", "0.2.0", tiny_v2.path, tiny_v2.digest, stable=ref(tiny_bundle))
    assert run.get_op("bias_gelu", bundle="tiny") is op2  # both stay loaded: switching back is instant

    # the op is not in the bundle: the installed PyTorch path serves it
    other = run.get_op("add_rmsnorm", bundle="tiny")
    assert other.bundle == "reference" and other.name == "add_rmsnorm"

    # a tampered active version: serve the stable one, and say why
    members = read_archive(tiny_v2.path.read_bytes())
    members["kernels/bias_gelu.py"] += b"# evil\n"
    bad = tmp_path / "bad.kpack"
    write_archive(bad, members)
    bad_digest = __import__("hashlib").sha256(bad.read_bytes()).hexdigest()
    publish_active(run.runtime_dir, "tiny", "0.3.0", bad, bad_digest, stable=ref(tiny_bundle))
    with caplog.at_level("WARNING", logger="kernelpack.runtime"):
        op3 = run.get_op("bias_gelu", bundle="tiny")
    assert op3.bundle == "tiny@0.1.0"
    assert "kernels/bias_gelu.py does not match" in run.reason["tiny"] and "serving stable 0.1.0" in caplog.text

    # the published digest does not match the file: refused, and with no usable stable -> reference
    publish_active(run.runtime_dir, "tiny", "0.4.0", tiny_v2.path, "0" * 64)
    assert run.get_op("bias_gelu", bundle="tiny").bundle == "reference"
    assert "expected " + "0" * 64 in run.reason["tiny"]


def test_untrusted_bundle_is_not_served(tmp_path: Path, other_keys: Keys, tiny_bundle: BuildResult) -> None:
    run = Runtime(tmp_path / "run", other_keys.trusted, tmp_path / "cache", arch="sm_90")
    publish_active(run.runtime_dir, "tiny", "0.1.0", tiny_bundle.path, tiny_bundle.digest)
    assert run.get_op("bias_gelu", bundle="tiny").bundle == "reference"
    assert "not in the trusted keys" in run.reason["tiny"]


def test_module_level_get_op_reads_the_environment(tmp_path: Path, keys: Keys, tiny_bundle: BuildResult,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    publish_active(tmp_path / "run", "tiny", "0.1.0", tiny_bundle.path, tiny_bundle.digest)
    monkeypatch.setenv(rt.RUNTIME_DIR_ENV, str(tmp_path / "run"))
    monkeypatch.setenv(rt.TRUSTED_KEYS_ENV, str(keys.trusted))
    monkeypatch.setenv(rt.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv("KERNELCTL_ARCH", "sm_90")
    monkeypatch.setattr(rt, "_default", None)
    op = rt.get_op("bias_gelu", bundle="tiny")
    assert op.bundle == "tiny@0.1.0" and op.supported
    assert (tmp_path / "cache" / "bundles" / tiny_bundle.digest).is_dir()


PUBLISHER = """
    import sys
    from kernelpack.runtime import publish_active
    run_dir, a, b, n = sys.argv[1], sys.argv[2].split("|"), sys.argv[3].split("|"), int(sys.argv[4])
    for i in range(n):
        v = a if i % 2 == 0 else b
        publish_active(run_dir, "tiny", v[0], v[1], v[2], stable={"version": v[0], "path": v[1], "digest": v[2]})
"""


def test_switch_is_atomic_for_readers(tmp_path: Path, keys: Keys, tiny_bundle: BuildResult,
                                      tiny_v2: BuildResult) -> None:
    run_dir = tmp_path / "run"
    publish_active(run_dir, "tiny", "0.1.0", tiny_bundle.path, tiny_bundle.digest, stable=ref(tiny_bundle))
    pairs = {("0.1.0", tiny_bundle.digest), ("0.2.0", tiny_v2.digest)}
    a = f"0.1.0|{tiny_bundle.path}|{tiny_bundle.digest}"
    b = f"0.2.0|{tiny_v2.path}|{tiny_v2.digest}"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(PUBLISHER), str(run_dir), a, b, "200"], env=env)
    run = Runtime(run_dir, keys.trusted, tmp_path / "cache", arch="sm_90")
    seen: set[str] = set()
    try:
        while proc.poll() is None:
            doc = read_active(run_dir)  # never a torn or half-written document
            e = doc["tiny"]
            assert (e.version, e.digest) in pairs
            assert (e.stable.version, e.stable.digest) == (e.version, e.digest)
            op = run.get_op("bias_gelu", bundle="tiny")
            assert op.bundle in ("tiny@0.1.0", "tiny@0.2.0")
            seen.add(op.bundle)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == 0
    assert seen
    assert run.get_op("bias_gelu", bundle="tiny").bundle == "tiny@0.2.0"  # the last one published (i = 199)


@pytest.fixture(scope="module")
def acts(tmp_path_factory: pytest.TempPathFactory, keys: Keys, aot_cache: Path) -> BuildResult:
    """A second bundle name with another op (swiglu): rolled out independently of ``tiny`` (bias_gelu)."""
    root = tmp_path_factory.mktemp("acts")
    src = write_source(root / "src", "acts", "0.1.0", kernels={"swiglu": "kernelpack.kernels.swiglu"},
                       note="second bundle", triton="3.6.0")
    return build_bundle(src, root / "acts.kpack", keys.pair.private_path, cache_dir=aot_cache)


def test_each_op_is_served_by_the_active_bundle_that_provides_it(tmp_path: Path, keys: Keys,
                                                                  tiny_bundle: BuildResult, tiny_v2: BuildResult,
                                                                  acts: BuildResult) -> None:
    from kernelpack import torch_ops

    run = Runtime(tmp_path / "run", keys.trusted, tmp_path / "cache", arch="sm_90")
    publish_active(run.runtime_dir, "tiny", "0.1.0", tiny_bundle.path, tiny_bundle.digest)
    publish_active(run.runtime_dir, "acts", "0.1.0", acts.path, acts.digest)
    assert run.get_op("bias_gelu").bundle == "tiny@0.1.0"
    assert run.get_op("swiglu").bundle == "acts@0.1.0"
    assert run.providers("swiglu") == ["acts"]
    assert run.get_op("add_rmsnorm").bundle == "reference"  # nobody provides it
    assert "no active bundle provides add_rmsnorm" in run.reason["add_rmsnorm"]
    assert run.served_key() == (("acts", acts.digest, ""), ("tiny", tiny_bundle.digest, ""))
    g, u = torch.randn(3, 16), torch.randn(3, 16)
    torch_ops.configure(run)  # torch.ops.kernelctl: every op from its provider, no bundle named
    try:
        swiglu = run.get_op("swiglu")
        y = torch.ops.kernelctl.swiglu(g, u)
        assert torch_ops.last_served("swiglu") == "acts@0.1.0" and swiglu.calls == 1 and swiglu.fallbacks == 0
        assert torch.allclose(y, torch.nn.functional.silu(g) * u, atol=1e-5)
        torch.ops.kernelctl.bias_gelu(X["x"], X["bias"])
        assert torch_ops.last_served("bias_gelu") == "tiny@0.1.0"

        # a third active bundle that also provides bias_gelu: the runtime refuses to choose (PyTorch path)
        publish_active(run.runtime_dir, "other", "0.2.0", tiny_v2.path, tiny_v2.digest)
        out = torch.ops.kernelctl.bias_gelu(X["x"], X["bias"])
        assert torch_ops.last_served("bias_gelu") == "reference"
        assert "bias_gelu is provided by 2 active bundles (other, tiny): refusing to choose" in run.reason["bias_gelu"]
        assert torch.allclose(out, run.get_op("bias_gelu").op.eager(X)[0])
        assert run.get_op("bias_gelu", bundle="other").bundle == "tiny@0.2.0"  # a named bundle still serves
        torch.ops.kernelctl.swiglu(g, u)
        assert torch_ops.last_served("swiglu") == "acts@0.1.0"  # the other op is unaffected
    finally:
        torch_ops.configure(None)
