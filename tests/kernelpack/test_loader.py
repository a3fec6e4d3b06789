"""Loading bundles: verify-before-import, side-by-side versions, arch configs, fallbacks and the fault fixtures.

Kernels run through Triton's interpreter here (tests/kernelpack/conftest.py sets TRITON_INTERPRET=1 on
machines without CUDA).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kernelpack.archive import read_archive, write_archive
from kernelpack.build import BuildResult, build_bundle
from kernelpack.errors import DigestMismatchError, UnsafeMemberError
from kernelpack.loader import extract, load_bundle
from kernelpack.verify import verify_path
from tests.kernelpack.bundle_fixtures import *  # noqa: F403
from tests.kernelpack.bundle_fixtures import REPO, Keys, write_tiny_src

needs_interpreter = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU-interpreter behaviour (GPU runs go through the device tool)"
)


def rms_inputs(tokens: int, hidden: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(tokens, hidden, generator=g).to(dtype),
            "residual": torch.randn(tokens, hidden, generator=g).to(dtype),
            "weight": (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)}


def test_tampered_bundle_never_runs_code(keys: Keys, tmp_path: Path, aot_cache: Path) -> None:
    src = write_tiny_src(tmp_path / "src", marker=True)
    res = build_bundle(src, tmp_path / "m.kpack", keys.pair.private_path, cache_dir=aot_cache)
    members = read_archive(res.path.read_bytes())
    members["kernels/bias_gelu.py"] += b"\n# tampered\n"
    write_archive(tmp_path / "bad.kpack", members)
    marker = tmp_path / "marker"
    os.environ["KPACK_TEST_MARKER"] = str(marker)
    try:
        with pytest.raises(DigestMismatchError, match=r"kernels/bias_gelu.py"):
            load_bundle(tmp_path / "bad.kpack", keys.trusted, arch="sm_90", cache_dir=tmp_path / "c")
        assert not marker.exists()
        assert not (tmp_path / "c" / "bundles").exists()  # nothing extracted either
        lb = load_bundle(res.path, keys.trusted, arch="sm_90", cache_dir=tmp_path / "c")
        assert marker.read_text() == "imported\n"  # the genuine bundle's module did run, once
        assert lb.ops["bias_gelu"].op.name == "bias_gelu"
    finally:
        del os.environ["KPACK_TEST_MARKER"]


@pytest.mark.slow
def test_two_versions_side_by_side(shipped: Callable[[str], BuildResult], keys: Keys, tmp_path: Path) -> None:
    a = load_bundle(shipped("1.0.0").path, keys.trusted, arch="sm_90", cache_dir=tmp_path)
    b = load_bundle(shipped("1.1.0").path, keys.trusted, arch="sm_90", cache_dir=tmp_path)
    assert (a.version, b.version) == ("1.0.0", "1.1.0")
    assert a.package != b.package
    ra, rb = a.ops["add_rmsnorm"], b.ops["add_rmsnorm"]
    assert ra.op is not rb.op
    assert sys.modules[f"{a.package}.kernels.add_rmsnorm"].OP is ra.op
    assert sys.modules[f"{b.package}.kernels.add_rmsnorm"].OP is rb.op
    assert ra.config == ra.op.default_config and rb.config["num_warps"] == 16  # sm_90 tuning in 1.1.0
    assert not any(str(a.root) in p or str(b.root) in p for p in sys.path)
    inputs = rms_inputs(5, 96)
    ya, ha = ra(inputs)
    yb, hb = rb(inputs)
    ref_y, _ = ra.op.reference(inputs)
    assert ra.fallbacks == rb.fallbacks == 0
    for y in (ya, yb):
        assert torch.allclose(y.double(), ref_y, atol=1e-5, rtol=1e-5)
    assert torch.equal(ha, hb)
    g = b.ops["bias_gelu_tanh"]
    assert g.config["BLOCK_M"] == 2 and g.config["BLOCK_N"] == 1024  # 1.1.0's sm_90 config
    x = {"x": torch.randn(3, 40), "bias": torch.randn(40)}
    assert torch.allclose(g(x)[0].double(), g.op.reference(x)[0], atol=1e-5, rtol=1e-5)
    assert g.fallbacks == 0
    # loading again reuses the verified extraction and the imported modules
    again = load_bundle(shipped("1.1.0").path, keys.trusted, arch="sm_80", cache_dir=tmp_path)
    assert again.ops["add_rmsnorm"].op is rb.op and again.ops["add_rmsnorm"].config["num_warps"] == 8


def test_fallback_for_unsupported_arch_and_out_of_domain(tiny_bundle: BuildResult, keys: Keys,
                                                         tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    lb = load_bundle(tiny_bundle.path, keys.trusted, arch="sm_75", cache_dir=tmp_path)
    op = lb.ops["bias_gelu"]
    assert not op.supported and "sm_75 is not a target" in str(op.unsupported)
    x = {"x": torch.randn(2, 16), "bias": torch.randn(16)}
    with caplog.at_level("WARNING", logger="kernelpack.loader"):
        out = op(x)
    assert torch.equal(out[0], op.op.eager(x)[0])
    assert op.fallbacks == 1 and "sm_75" in caplog.text
    ok = load_bundle(tiny_bundle.path, keys.trusted, arch="sm_90", cache_dir=tmp_path).ops["bias_gelu"]
    assert ok.supported and ok.config == {"BLOCK_M": 2, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1}
    bad = {"x": torch.randn(2, 12, dtype=torch.float64), "bias": torch.randn(12, dtype=torch.float64)}
    with caplog.at_level("WARNING", logger="kernelpack.loader"):
        out = ok(bad)
    assert ok.fallbacks == 1 and "outside the op's domain" in str(ok.last_fallback_reason)
    assert torch.equal(out[0], ok.op.eager(bad)[0])
    good = {"x": torch.randn(3, 16), "bias": torch.randn(16)}
    assert torch.allclose(ok(good)[0].double(), ok.op.reference(good)[0], atol=1e-5, rtol=1e-5)
    assert ok.fallbacks == 1


def test_arch_from_environment(tiny_bundle: BuildResult, keys: Keys, tmp_path: Path,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KERNELCTL_ARCH", "sm_80")
    lb = load_bundle(tiny_bundle.path, keys.trusted, cache_dir=tmp_path)
    assert lb.arch == "sm_80" and not lb.ops["bias_gelu"].supported
    monkeypatch.setenv("KERNELCTL_ARCH", "sm_90")
    assert load_bundle(tiny_bundle.path, keys.trusted, cache_dir=tmp_path).ops["bias_gelu"].supported


def test_extraction_is_content_addressed_and_repaired(tiny_bundle: BuildResult, keys: Keys,
                                                      tmp_path: Path) -> None:
    lb = load_bundle(tiny_bundle.path, keys.trusted, arch="sm_90", cache_dir=tmp_path)
    assert lb.root == tmp_path / "bundles" / tiny_bundle.digest
    kernel = lb.root / "kernels" / "bias_gelu.py"
    assert not os.access(kernel, os.W_OK) or os.geteuid() == 0
    # an extracted copy that was modified on disk is replaced by the verified bytes
    os.chmod(kernel.parent, 0o755)
    os.chmod(kernel, 0o644)
    kernel.write_bytes(kernel.read_bytes() + b"\nraise SystemExit('evil')\n")
    vb = verify_path(tiny_bundle.path, keys.trusted)
    assert extract(vb, lb.root) == lb.root
    assert kernel.read_bytes() == vb.members["kernels/bias_gelu.py"]
    # loading the extracted directory itself verifies it too
    assert load_bundle(lb.root, keys.trusted, arch="sm_90", cache_dir=tmp_path).digest == tiny_bundle.digest
    (tmp_path / "copy").mkdir()
    (tmp_path / "copy" / "kernels").symlink_to(lb.root / "kernels")
    with pytest.raises(UnsafeMemberError):
        load_bundle(tmp_path / "copy", keys.trusted, cache_dir=tmp_path)


@pytest.mark.slow
@needs_interpreter
def test_drift_fixture_breaches_tolerance_on_wide_rows_only(shipped: Callable[[str], BuildResult], keys: Keys,
                                                             tmp_path: Path) -> None:
    lb = load_bundle(shipped("1.2.0-fault.drift").path, keys.trusted, arch="sm_90", cache_dir=tmp_path)
    op = lb.ops["add_rmsnorm"]
    tol = op.op.tolerances["bf16"]
    for hidden, breaches in ((128, False), (248, False), (256, True), (1024, True)):
        inputs = rms_inputs(3, hidden, torch.bfloat16)
        y, _ = op(inputs)
        ref = op.op.reference(inputs)[0]
        err = (y.double() - ref).abs()
        over = (err > tol.atol + tol.rtol * ref.abs()).any().item()
        assert over == breaches, (hidden, err.max().item())


def _run_child(code: str, tmp_path: Path, **extra_env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO), **extra_env}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, timeout=300, cwd=tmp_path)


LOAD_AND_CALL = """
    import resource, sys, torch
    from pathlib import Path
    from kernelpack.loader import load_bundle
    limit = {limit}
    if limit:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    lb = load_bundle(Path({path!r}), Path({trusted!r}), arch="sm_90", cache_dir=Path({cache!r}))
    op = lb.ops["add_rmsnorm"]
    x = {{"x": torch.randn({tokens}, 64), "residual": torch.randn({tokens}, 64), "weight": torch.ones(64)}}
    try:
        op(x)
    except Exception as exc:
        print("FAILED", type(exc).__name__, str(exc)[:200])
        sys.exit(7)
    print("OK")
"""


@pytest.mark.slow
@needs_interpreter
def test_crash_fixture_kills_the_process(shipped: Callable[[str], BuildResult], keys: Keys,
                                         tmp_path: Path) -> None:
    code = LOAD_AND_CALL.format(path=str(shipped("1.2.0-fault.crash").path), trusted=str(keys.trusted),
                                cache=str(tmp_path), tokens=2, limit=0)
    proc = _run_child(code, tmp_path)
    assert proc.returncode == -11, (proc.returncode, proc.stdout, proc.stderr[-2000:])  # SIGSEGV


@pytest.mark.slow
@needs_interpreter
def test_oom_fixture_fails_to_allocate_at_64_tokens(shipped: Callable[[str], BuildResult], keys: Keys,
                                                    tmp_path: Path) -> None:
    path = str(shipped("1.2.0-fault.oom").path)
    common = dict(path=path, trusted=str(keys.trusted), cache=str(tmp_path), limit=16 << 30)
    small = _run_child(LOAD_AND_CALL.format(tokens=8, **common), tmp_path)
    assert small.returncode == 0 and "OK" in small.stdout, small.stderr[-2000:]
    big = _run_child(LOAD_AND_CALL.format(tokens=64, **common), tmp_path)
    assert big.returncode == 7, (big.stdout, big.stderr[-2000:])
    assert "FAILED" in big.stdout and ("alloc" in big.stdout.lower() or "memory" in big.stdout.lower())


@pytest.mark.slow
@needs_interpreter
def test_slow_fixture_is_correct(shipped: Callable[[str], BuildResult], keys: Keys, tmp_path: Path) -> None:
    """Correct results (its slowness is measured by the harness benchmarks, not by a timed unit test)."""
    lb = load_bundle(shipped("1.2.0-fault.slow").path, keys.trusted, arch="sm_90", cache_dir=tmp_path)
    op = lb.ops["add_rmsnorm"]
    assert op.config["num_warps"] == 1 and op.config["REDUNDANT"] > 1
    inputs = rms_inputs(3, 72)
    y, h = op(inputs)
    ry, rh = op.op.reference(inputs)
    assert torch.allclose(y.double(), ry, atol=1e-5, rtol=1e-5) and torch.allclose(h.double(), rh)
    assert json.loads(json.dumps(op.config))  # plain JSON-able config for the harness
