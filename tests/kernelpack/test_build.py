"""bundle build: deterministic archives, real AOT artifacts, the compile cache, and build-time refusals."""

from __future__ import annotations

import gzip
import io
import json
import logging
import tarfile
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

import kernelpack.build as build_mod
from kernelpack.archive import read_archive
from kernelpack.build import BuildResult, build_bundle
from kernelpack.errors import BuildError, KeyFileError, ManifestError
from kernelpack.manifest import MANIFEST_NAME, SIGNATURE_NAME
from kernelpack.verify import verify_path
from tests.kernelpack.bundle_fixtures import *  # noqa: F403
from tests.kernelpack.bundle_fixtures import FAULTS, SHIPPED, Keys, write_tiny_src


def test_rebuild_is_byte_identical_and_archive_is_normalised(tiny_bundle: BuildResult, keys: Keys,
                                                             tmp_path: Path, aot_cache: Path) -> None:
    src = write_tiny_src(tmp_path / "elsewhere" / "src")  # same sources, different location
    again = build_bundle(src, tmp_path / "again.kpack", keys.pair.private_path, cache_dir=aot_cache)
    assert again.path.read_bytes() == tiny_bundle.path.read_bytes()
    assert again.digest == tiny_bundle.digest
    blob = tiny_bundle.path.read_bytes()
    assert blob[4:8] == b"\x00\x00\x00\x00"  # gzip header mtime 0
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(blob))) as tar:
        infos = tar.getmembers()
    names = [i.name for i in infos]
    assert names == sorted(names)
    assert all(i.isreg() and i.mtime == 0 and i.uid == 0 and i.gid == 0 and i.uname == "" and i.mode == 0o644
               for i in infos)
    assert MANIFEST_NAME in names and SIGNATURE_NAME in names


def test_tiny_bundle_content(tiny_bundle: BuildResult) -> None:
    m = tiny_bundle.manifest
    members = read_archive(tiny_bundle.path.read_bytes())
    k = m.kernel("bias_gelu")
    assert k.module == "kernels/bias_gelu.py"
    assert members[k.module] == Path(build_mod._package_kernels_dir(), "bias_gelu.py").read_bytes()
    assert k.limitations["dtypes"] == ["fp16", "bf16", "fp32"]
    assert set(k.tolerances) == {"fp16", "bf16", "fp32"}
    assert {(a.arch, a.dtype) for a in m.artifacts} == {("sm_90", d) for d in ("fp16", "bf16", "fp32")}
    for a in m.artifacts:
        assert members[a.cubin][:4] == b"\x7fELF"
        assert b".target sm_90" in members[a.ptx]
        meta = json.loads(members[a.meta])
        assert meta["constexprs"] == {"BLOCK_M": 2, "BLOCK_N": 64}  # the sm_90 config from bundle.toml
        assert meta["name"] == a.kernel
    assert m.golden and all(g.path in members and len(members[g.path]) > 0 for g in m.golden)


def test_second_build_reuses_the_compile_cache(keys: Keys, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    src = write_tiny_src(tmp_path / "src")
    cache = tmp_path / "cache"
    first = build_bundle(src, tmp_path / "a.kpack", keys.pair.private_path, cache_dir=cache)
    entries = sorted(p.name for p in cache.glob("??/*"))
    assert len(entries) == len(first.manifest.artifacts) == 3

    def no_compiling(*a: object, **k: object) -> None:
        raise AssertionError("the second build must not compile")

    monkeypatch.setattr(build_mod, "compile_jobs", no_compiling)
    second = build_bundle(src, tmp_path / "b.kpack", keys.pair.private_path, cache_dir=cache)
    assert second.digest == first.digest
    assert sorted(p.name for p in cache.glob("??/*")) == entries


def _edit_tiny(tmp_path: Path, edit: Callable[[str], str], kernel: str | None = None) -> Path:
    src = write_tiny_src(tmp_path / "src", marker=kernel is not None)
    if kernel is not None:
        (src / "kernels" / "bias_gelu_marker.py").write_text(kernel)
    (src / "bundle.toml").write_text(edit((src / "bundle.toml").read_text()))
    return src


@pytest.mark.parametrize(
    ("kernel", "message"),
    [
        ("from kernelpack.harness import golden\n", "may import only torch, triton"),
        ("import requests\n", "import of requests is not allowed"),
        ("from .. import spec\n", "imports outside the kernels package"),
        ("from .helper import x\n", "relative import of 'helper'"),
        ("def broken(:\n", "syntax error"),
        ("X = 1\n", "has no OP: KernelOp"),
    ],
)
def test_bad_kernel_modules_are_refused(kernel: str, message: str, keys: Keys, tmp_path: Path,
                                        aot_cache: Path) -> None:
    src = _edit_tiny(tmp_path, lambda s: s, kernel)
    with pytest.raises(BuildError, match=message):
        build_bundle(src, tmp_path / "t.kpack", keys.pair.private_path, cache_dir=aot_cache)
    assert not (tmp_path / "t.kpack").exists()


def test_other_build_refusals(keys: Keys, tmp_path: Path, aot_cache: Path) -> None:
    out = tmp_path / "t.kpack"
    src = _edit_tiny(tmp_path / "a", lambda s: s.replace('triton = "3.6.0"', 'triton = "3.5.0"'))
    with pytest.raises(BuildError, match=r"targets Triton 3.5.0 but 3.6.0 is installed"):
        build_bundle(src, out, keys.pair.private_path, cache_dir=aot_cache)
    src = _edit_tiny(tmp_path / "b", lambda s: s.replace("kernelpack.kernels.bias_gelu", "kernelpack.kernels.nope"))
    with pytest.raises(BuildError, match=r"source kernelpack.kernels.nope not found"):
        build_bundle(src, out, keys.pair.private_path, cache_dir=aot_cache)
    src = _edit_tiny(tmp_path / "c", lambda s: s.replace("BLOCK_N = 64", "BLOCK_N = 63"))
    with pytest.raises(BuildError, match="BLOCK_N=63"):
        build_bundle(src, out, keys.pair.private_path, cache_dir=aot_cache)
    src = _edit_tiny(tmp_path / "d", lambda s: s.replace('op = "bias_gelu"', 'op = "bias_gelu_tanh"'))
    with pytest.raises(BuildError, match="exports an OP named 'bias_gelu'"):
        build_bundle(src, out, keys.pair.private_path, cache_dir=aot_cache)
    src = _edit_tiny(tmp_path / "e", lambda s: s.replace('version = "0.1.0"', 'version = "v1"'))
    with pytest.raises(ManifestError, match="not a semantic version"):
        build_bundle(src, out, keys.pair.private_path, cache_dir=aot_cache)
    with pytest.raises(KeyFileError):
        build_bundle(_edit_tiny(tmp_path / "f", lambda s: s), out, tmp_path / "no.key", cache_dir=aot_cache)
    assert not out.exists()


def test_source_only_and_arch_subset_builds(keys: Keys, tmp_path: Path, aot_cache: Path) -> None:
    """``aot_archs=[]`` builds a signed source-only bundle without compiling anything; an arch outside the
    bundle's targets is refused before anything is written."""
    src = write_tiny_src(tmp_path / "src")
    cold = tmp_path / "cold-cache"
    res = build_bundle(src, tmp_path / "src-only.kpack", keys.pair.private_path, cache_dir=cold, aot_archs=[])
    assert res.manifest.artifacts == []
    assert not any(cold.glob("??/*"))  # nothing was compiled
    vb = verify_path(res.path, keys.trusted)
    assert "kernels/bias_gelu.py" in vb.members and res.manifest.golden
    assert not any(name.startswith("artifacts/") for name in vb.members)
    subset = build_bundle(src, tmp_path / "sm90.kpack", keys.pair.private_path, cache_dir=aot_cache,
                          aot_archs=["sm_90"])
    assert {a.arch for a in subset.manifest.artifacts} == {"sm_90"}
    with pytest.raises(BuildError, match=r"cannot compile ahead of time for sm_80: not one of"):
        build_bundle(src, tmp_path / "bad.kpack", keys.pair.private_path, cache_dir=aot_cache,
                     aot_archs=["sm_80"])
    assert not (tmp_path / "bad.kpack").exists()


def test_concurrent_builds_compile_once(keys: Keys, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Two builds of the same sources on one cold cache at once (pytest-xdist workers, two CI jobs): the
    second waits for the first's compile lock, finds the kernels cached and compiles nothing."""
    src = write_tiny_src(tmp_path / "src")
    cache = tmp_path / "cold-cache"
    results: dict[int, str] = {}

    def build(i: int) -> None:
        results[i] = build_bundle(src, tmp_path / f"{i}.kpack", keys.pair.private_path, cache_dir=cache).digest

    with caplog.at_level(logging.INFO, logger="kernelpack.build"):
        threads = [threading.Thread(target=build, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    assert len(results) == 2 and results[0] == results[1]
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("compiling")] == [
        "compiling 3 (op, arch, dtype) groups ahead of time"]


@pytest.mark.slow
@pytest.mark.parametrize("version", SHIPPED)
def test_shipped_bundles_build_and_verify(version: str, shipped: Callable[[str], BuildResult],
                                          keys: Keys) -> None:
    res = shipped(version)
    vb = verify_path(res.path, keys.trusted)
    m = vb.manifest
    assert m.version == version
    ops = {k.op for k in m.kernels}
    for k in m.kernels:
        dtypes = k.limitations["dtypes"]
        for arch in m.targets.archs:
            got = {a.dtype for a in m.artifacts if a.op == k.op and a.arch == arch}
            assert got == (set(dtypes) if arch in k.built_for(m.targets) else set()), (k.op, arch)
    assert {g.op for g in m.golden} == ops
    assert all(vb.members[a.cubin][:4] == b"\x7fELF" for a in m.artifacts)
    if version.startswith("1.2.0-fault."):
        fault = version.rsplit(".", 1)[1]
        assert m.fault_fixture and m.parent == "1.1.0"
        assert vb.members["kernels/add_rmsnorm.py"].startswith(
            f'"""FAULT FIXTURE (llm-fused 1.2.0-fault.{fault})'.encode())
    else:
        assert m.fault_fixture is None
        assert b"FAULT FIXTURE" not in vb.members["kernels/add_rmsnorm.py"]


@pytest.mark.slow
def test_1_1_0_compiles_arch_specific_configs(shipped: Callable[[str], BuildResult]) -> None:
    m10, m11 = shipped("1.0.0").manifest, shipped("1.1.0").manifest
    members = read_archive(shipped("1.1.0").path.read_bytes())
    warps = {a.arch: json.loads(members[a.meta])["num_warps"]
             for a in m11.artifacts if a.op == "add_rmsnorm" and a.dtype == "bf16"}
    assert warps["sm_90"] > warps["sm_80"]
    shared = set(m10.files) & set(m11.files)
    assert "kernels/add_rmsnorm.py" in shared
    assert m10.files["kernels/add_rmsnorm.py"] == m11.files["kernels/add_rmsnorm.py"]
    assert FAULTS  # fixtures are exercised in test_loader


def test_the_cpython_ast_depth_error_is_parsed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPython 3.11 < 3.11.8 (gh-106905) may raise a SystemError from ast.parse while another thread builds an AST
    (a suite run lost a module's bundle fixture to it): the import check parses again; other errors still fail."""
    import ast

    real, calls = ast.parse, []

    def flaky(*args: object, **kw: object) -> ast.Module:
        calls.append(1)
        if len(calls) < 3:
            raise SystemError("AST constructor recursion depth mismatch (before=165, after=32)")
        return real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(ast, "parse", flaky)
    assert build_mod._check_imports("k.py", b"from . import common\nimport math\n") == {"common"}
    assert len(calls) == 3
    monkeypatch.setattr(ast, "parse", lambda *a, **k: (_ for _ in ()).throw(SystemError("something else")))
    with pytest.raises(SystemError, match="something else"):
        build_mod._check_imports("k.py", b"import math\n")


def test_a_gpu_models_config_is_compiled_beside_its_archs(keys: Keys, tmp_path: Path, aot_cache: Path) -> None:
    """``sm_90-h200`` layers over ``sm_90``: the build compiles both, the model's artifacts named for it; the
    arch's own artifacts keep their config (and their paths and manifest form, so older bundles rebuild the
    same)."""
    src = _edit_tiny(tmp_path, lambda s: s + '"sm_90-h200" = { BLOCK_N = 128 }\n')
    built = build_bundle(src, tmp_path / "d.kpack", keys.pair.private_path, cache_dir=aot_cache)
    members = read_archive(built.path.read_bytes())
    k = built.manifest.kernel("bias_gelu")
    assert k.config_for("sm_90", "h200") == {"BLOCK_M": 2, "BLOCK_N": 128}
    assert k.config_for("sm_90", "h100") == k.config_for("sm_90") == {"BLOCK_M": 2, "BLOCK_N": 64}
    by_device = {a.device: a for a in built.manifest.artifacts if a.dtype == "bf16"}
    assert set(by_device) == {None, "h200"}
    assert by_device["h200"].cubin.startswith("artifacts/sm_90-h200/bias_gelu/bf16/")
    assert json.loads(members[by_device["h200"].meta])["constexprs"] == {"BLOCK_M": 2, "BLOCK_N": 128}
    assert json.loads(members[by_device[None].meta])["constexprs"] == {"BLOCK_M": 2, "BLOCK_N": 64}
    assert b'"device"' not in json.dumps([a.model_dump(mode="json") for a in built.manifest.artifacts
                                          if a.device is None]).encode()
