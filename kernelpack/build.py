"""``bundle build``: bundle.toml + kernel sources -> a signed, deterministic .kpack.

Steps: validate bundle.toml; collect each op's module (from the installed ``kernelpack.kernels`` package or a
bundle-local ``kernels/<file>.py``) as ``kernels/<op>.py`` plus any sibling modules it imports relatively (a
bundle-local module may import ``stable_<op>``: the installed ``kernelpack.kernels.<op>`` source, bundled, and
the installed shared modules such as ``norm_common``, bundled too);
check the import rules; import them under a throw-away private package; compile every ``OP.aot`` spec for every
target arch (or the subset asked for) and every dtype of the op's domain (``kernelpack.aot``, cached); add golden vectors from
``kernelpack.harness.golden`` when it is installed; record sizes and sha256 of every member; sign the canonical
manifest; write the archive deterministically. The same sources always give the same bytes.
"""

from __future__ import annotations

import ast
import importlib.util
import logging
import shutil
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import triton
from pydantic import ValidationError
from tenacity import retry, retry_if_exception, stop_after_attempt, wait_random

from kernelpack.aot import Job, cached, compile_jobs, compile_lock, default_cache_dir, representative_specs
from kernelpack.archive import write_archive
from kernelpack.errors import BuildError, BundleError
from kernelpack.kernels.spec import AotSpec, KernelOp
from kernelpack.loader import forget_package, import_kernel_package, op_from_module
from kernelpack.manifest import (
    LOCAL_SOURCE_RE,
    MANIFEST_NAME,
    PACKAGE_SOURCE_RE,
    SIGNATURE_NAME,
    BundleSource,
    Manifest,
    canonical_json,
    load_source,
)
from kernelpack.signing import load_private_key, sign
from kernelpack.verify import sha256_hex

log = logging.getLogger("kernelpack.build")

GOLDEN_SEED = 0
ALLOWED_TOP_LEVEL = {"torch", "triton", "math", "functools", "dataclasses", "typing", "collections", "itertools",
                     "__future__", "operator", "enum", "abc", "random", "struct", "os", "warnings"}
ALLOWED_KERNELPACK = {"kernelpack.kernels.spec"}
STABLE_PREFIX = "stable_"  # a relative import of stable_<op> in a bundle-local module: kernelpack.kernels.<op>


@dataclass(frozen=True)
class BuildResult:
    path: Path
    digest: str
    manifest: Manifest
    size: int


def _package_kernels_dir() -> Path:
    spec = importlib.util.find_spec("kernelpack.kernels")
    if spec is None or not spec.submodule_search_locations:
        raise BuildError("the kernelpack.kernels package is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


# CPython 3.11 before 3.11.8 (gh-106905): ast.parse may raise this SystemError when another thread builds an AST
# at the same time (Triton's JIT parses kernel sources); the same parse again succeeds.
@retry(retry=retry_if_exception(lambda e: isinstance(e, SystemError) and "recursion depth mismatch" in str(e)),
       stop=stop_after_attempt(5), wait=wait_random(0, 0.05), reraise=True)
def _parse(data: bytes, filename: str) -> ast.Module:
    return ast.parse(data, filename=filename)


def _check_imports(label: str, data: bytes) -> set[str]:
    """Enforce the bundle import rules; return the sibling modules imported relatively."""
    try:
        tree = _parse(data, filename=label)
    except SyntaxError as exc:
        raise BuildError(f"{label}: syntax error at line {exc.lineno}: {exc.msg}") from exc
    siblings: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            if node.level > 1:
                raise BuildError(f"{label}: line {node.lineno}: imports outside the kernels package")
            if node.module is None:
                siblings.update(a.name for a in node.names)
            else:
                siblings.add(node.module.split(".")[0])
            continue
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
            [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
        for name in names:
            top = name.split(".")[0]
            if top in ("kernelpack", "kernelctl", "controller", "agents"):
                if name not in ALLOWED_KERNELPACK:
                    raise BuildError(
                        f"{label}: line {node.lineno}: bundle kernels may import only torch, triton, the "
                        f"standard library and kernelpack.kernels.spec, not {name}"
                    )
            elif top not in sys.stdlib_module_names and top not in ALLOWED_TOP_LEVEL:
                raise BuildError(f"{label}: line {node.lineno}: import of {name} is not allowed in a bundle")
    siblings.discard("spec")
    return siblings


def collect_sources(src_dir: Path, source: BundleSource) -> tuple[dict[str, bytes], dict[str, set[str]]]:
    """{archive path: bytes} for every kernel module and its relatively imported siblings, and for each op
    the archive paths its module depends on (itself and its siblings, transitively)."""
    pkg_dir = _package_kernels_dir()
    files: dict[str, bytes] = {}
    deps: dict[str, set[str]] = {}

    def add(arc: str, data: bytes, label: str) -> None:
        if arc in files and files[arc] != data:
            raise BuildError(f"two different sources map to {arc} (last: {label})")
        files[arc] = data

    for k in source.kernels:
        if m := PACKAGE_SOURCE_RE.match(k.source):
            base, mod = pkg_dir, m.group(1)
        else:
            m = LOCAL_SOURCE_RE.match(k.source)
            assert m is not None
            base, mod = src_dir / "kernels", m.group(1)
        path = base / f"{mod}.py"
        if not path.is_file():
            raise BuildError(f"kernel {k.op}: source {k.source} not found ({path})")
        data = path.read_bytes()
        add(f"kernels/{k.op}.py", data, k.source)
        deps[k.op] = {f"kernels/{k.op}.py"}
        # (sibling, folder of the module importing it): an installed module's siblings are installed modules
        todo = [(sib, base) for sib in _check_imports(k.source, data)]
        seen: set[str] = set()
        while todo:
            sib, where = todo.pop()
            if sib in seen:
                continue
            seen.add(sib)
            sp = where / f"{sib}.py"
            if not sp.is_file() and sib.startswith(STABLE_PREFIX):
                # ``from . import stable_<op>``: the installed op module's source, bundled (and signed) under
                # that name, so a small module can reuse the stable op and override only what it changes
                sp = pkg_dir / f"{sib[len(STABLE_PREFIX):]}.py"
            elif not sp.is_file() and (pkg_dir / f"{sib}.py").is_file():
                # an installed shared module (``norm_common``, ``gelu_common``): bundled (and signed) too
                sp = pkg_dir / f"{sib}.py"
            if not sp.is_file():
                raise BuildError(f"kernel {k.op}: relative import of {sib!r} but {sp} does not exist")
            sdata = sp.read_bytes()
            add(f"kernels/{sib}.py", sdata, str(sp))
            deps[k.op].add(f"kernels/{sib}.py")
            todo.extend((s, sp.parent) for s in _check_imports(str(sp), sdata))
    return files, deps


def _import_ops(source: BundleSource, files: dict[str, bytes], stage: Path, tag: str) -> dict[str, KernelOp]:
    package = f"_kpack_build_{tag}"
    try:
        modules = import_kernel_package(package, stage, files)
        return {k.op: op_from_module(modules[k.op], k.op, k.entry) for k in source.kernels}
    except BundleError as exc:
        raise BuildError(str(exc)) from exc


def _make_golden(ops: dict[str, KernelOp]) -> tuple[dict[str, bytes], list[dict[str, Any]]]:
    try:
        from kernelpack.harness.golden import make_golden
    except ImportError:
        log.warning("kernelpack.harness.golden is not available: building without golden vectors")
        return {}, []
    files: dict[str, bytes] = {}
    entries: list[dict[str, Any]] = []
    for name in sorted(ops):
        for dtype in ops[name].domain.dtypes:
            path = f"golden/{name}/{dtype}.bin"
            try:
                files[path] = make_golden(ops[name], dtype, GOLDEN_SEED)
            except Exception as exc:
                raise BuildError(f"golden vectors for {name} {dtype} failed: {type(exc).__name__}: {exc}") from exc
            entries.append({"op": name, "dtype": dtype, "seed": GOLDEN_SEED, "path": path})
    return files, entries


def build_bundle(
    src: Path,
    out: Path,
    key: Path,
    *,
    cache_dir: Path | None = None,
    aot_archs: Iterable[str] | None = None,
) -> BuildResult:
    """Build the bundle in directory ``src`` into ``out`` signed with private key file ``key``.

    ``aot_archs`` limits ahead-of-time compilation to those target archs (default: every target arch;
    an empty list builds a source-only bundle, as a CPU fleet that runs kernels through Triton's
    interpreter needs). The manifest's ``artifacts`` list says exactly which archs were compiled; nodes
    JIT-compile from the same signed sources either way.
    """
    src = Path(src)
    source = load_source(src)
    only = None if aot_archs is None else set(aot_archs)
    if only is not None and (unknown := sorted(only - set(source.targets.archs))):
        raise BuildError(f"cannot compile ahead of time for {unknown[0]}: not one of the bundle's target "
                         f"archs ({', '.join(source.targets.archs)})")
    private_key = load_private_key(key)
    if triton.__version__ != source.targets.triton:
        raise BuildError(f"bundle targets Triton {source.targets.triton} but {triton.__version__} is installed")
    files, deps = collect_sources(src, source)
    # per-op digest of the sources it compiles from: an override of one op leaves the others' cache warm
    digests = {op: sha256_hex(canonical_json({n: sha256_hex(files[n]) for n in sorted(paths)}))
               for op, paths in deps.items()}
    tag = sha256_hex(canonical_json(digests))[:12]
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    stage = Path(tempfile.mkdtemp(prefix="kpack-build-"))
    members: dict[str, bytes] = dict(files)
    artifacts: list[dict[str, Any]] = []
    try:
        for name, data in files.items():
            (stage / name).parent.mkdir(parents=True, exist_ok=True)
            (stage / name).write_bytes(data)
        ops = _import_ops(source, files, stage, tag)
        plan: list[tuple[str, str, str | None, str, int, AotSpec]] = []
        jobs: list[tuple[Job, list[AotSpec]]] = []
        for k in source.kernels:
            op = ops[k.op]
            if op.aot is None:
                raise BuildError(f"kernel {k.op} has no aot(): it cannot be compiled ahead of time")
            for arch in k.built_for(source.targets):
                if only is not None and arch not in only:
                    continue
                # the arch's config, then each GPU model's own config of it (sm_90-h200)
                for device in (None, *k.devices_for(arch)):
                    config = {**op.default_config, **k.config_for(arch, device)}
                    for dtype in op.domain.dtypes:
                        where = f"{arch}-{device}" if device else arch
                        try:
                            specs = representative_specs(op.aot(dtype, config))
                        except Exception as exc:
                            raise BuildError(f"kernel {k.op} {where} {dtype}: aot() failed: {exc}") from exc
                        plan.extend((k.op, arch, device, dtype, i, s) for i, s in enumerate(specs))
                        jobs.append((Job(k.op, arch, dtype, config), specs))

        def missing() -> list[Job]:
            return [j for j, specs in jobs if any(cached(s, j.arch, digests[j.op], cache) is None for s in specs)]

        if missing():
            with compile_lock(cache):  # a concurrent build may have compiled them meanwhile: look again
                if todo := missing():
                    log.info("compiling %d (op, arch, dtype) groups ahead of time", len(todo))
                    compile_jobs(stage, todo, digests, cache)
        for op_name, arch, device, dtype, i, aspec in plan:
            c = cached(aspec, arch, digests[op_name], cache)
            where = f"{arch}-{device}" if device else arch
            if c is None:
                raise BuildError(f"compiled artifact for {op_name} {where} {dtype} #{i} missing from cache {cache}")
            stem = f"artifacts/{where}/{op_name}/{dtype}/{i}-{c.kernel}"
            members[f"{stem}.cubin"] = c.cubin
            members[f"{stem}.ptx"] = c.ptx
            members[f"{stem}.json"] = c.meta
            artifacts.append({"op": op_name, "arch": arch, "device": device, "dtype": dtype, "kernel": c.kernel,
                              "cubin": f"{stem}.cubin", "ptx": f"{stem}.ptx", "meta": f"{stem}.json"})
        golden_files, golden = _make_golden(ops)
        members.update(golden_files)
    finally:
        forget_package(f"_kpack_build_{tag}")
        shutil.rmtree(stage, ignore_errors=True)
    kernels = []
    for k in source.kernels:
        op = ops[k.op]
        kernels.append({
            **k.model_dump(mode="json"),
            "module": f"kernels/{k.op}.py",
            "limitations": op.domain.to_json(),
            "tolerances": {dt: {"atol": float(t.atol), "rtol": float(t.rtol)} for dt, t in op.tolerances.items()},
        })
    doc = {
        **source.model_dump(mode="json", exclude={"kernels"}),
        "kernels": kernels,
        "files": {n: {"sha256": sha256_hex(d), "size": len(d)} for n, d in sorted(members.items())},
        "artifacts": artifacts,
        "golden": golden,
    }
    try:
        manifest = Manifest.model_validate(doc)
    except ValidationError as exc:
        raise BuildError(f"the built manifest is invalid: {exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}") from exc
    manifest_bytes = manifest.to_bytes()
    members[MANIFEST_NAME] = manifest_bytes
    members[SIGNATURE_NAME] = sign(manifest_bytes, private_key).to_bytes()
    blob = write_archive(Path(out), members)
    return BuildResult(Path(out), sha256_hex(blob), manifest, len(blob))
