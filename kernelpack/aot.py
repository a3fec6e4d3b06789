"""Ahead-of-time compilation of a kernel's ``AotSpec`` to cubin + PTX for one target arch, with a disk cache.

Triton compiles for a ``GPUTarget`` without a GPU, so CPU build machines emit real cubins. Compilation runs
with the interpreter switched off and line info disabled (no build-path strings end up in the binaries, so
outputs are byte-identical wherever the sources live). Results are cached under
``<cache_dir>/<key[:2]>/<key>/`` keyed by source digest, function, signature, constexprs, launch options, arch
and Triton version, so CI's repeated builds are fast; concurrent builds on one cache compile one at a time
(a lock file), so the second finds what the first compiled.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import platformdirs
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler import compile as triton_compile

from kernelpack.errors import BuildError
from kernelpack.kernels.spec import AotSpec
from kernelpack.manifest import canonical_json


def default_cache_dir() -> Path:
    return Path(platformdirs.user_cache_dir("kernelctl")) / "aot"


@dataclass(frozen=True)
class Compiled:
    """One compiled kernel: the binaries and a JSON launch-metadata document."""

    kernel: str
    cubin: bytes
    ptx: bytes
    meta: bytes


def arch_target(arch: str) -> GPUTarget:
    """``sm_90`` -> GPUTarget('cuda', 90, 32)."""
    try:
        cc = int(arch.removeprefix("sm_").rstrip("a"))
    except ValueError as exc:
        raise BuildError(f"cannot compile for arch {arch!r}: expected sm_XY") from exc
    return GPUTarget("cuda", cc, 32)


def _jsonable(v: Any) -> Any:
    if isinstance(v, bool | int | float | str) or v is None:
        return v
    return str(v)


@contextmanager
def compile_mode(cache_dir: Path) -> Iterator[None]:
    """Compile (not interpret) with line info off and Triton's own cache under ``cache_dir``; restore after."""
    with knobs.runtime.scope(), knobs.compilation.scope(), knobs.cache.scope():
        knobs.runtime.interpret = False
        knobs.compilation.disable_line_info = True
        knobs.cache.dir = str(cache_dir / "triton")
        yield


def spec_name(spec: AotSpec) -> str:
    fn = spec.fn
    return getattr(fn, "__name__", None) or getattr(getattr(fn, "fn", None), "__name__", "kernel")


def cache_key(spec: AotSpec, arch: str, source_digest: str) -> str:
    doc = {
        "source": source_digest,
        "fn": spec_name(spec),
        "signature": dict(spec.signature),
        "constexprs": {k: _jsonable(v) for k, v in spec.constexprs.items()},
        "num_warps": spec.num_warps,
        "num_stages": spec.num_stages,
        "arch": arch,
        "triton": triton.__version__,
    }
    return hashlib.sha256(canonical_json(doc)).hexdigest()


def _entry(cache_dir: Path, key: str) -> Path:
    return cache_dir / key[:2] / key


def cached(spec: AotSpec, arch: str, source_digest: str, cache_dir: Path) -> Compiled | None:
    """The cached compilation of ``spec`` for ``arch``, or None."""
    entry = _entry(cache_dir, cache_key(spec, arch, source_digest))
    try:
        return Compiled(
            spec_name(spec),
            (entry / "kernel.cubin").read_bytes(),
            (entry / "kernel.ptx").read_bytes(),
            (entry / "kernel.json").read_bytes(),
        )
    except OSError:
        return None


def compile_spec(spec: AotSpec, arch: str, source_digest: str, cache_dir: Path) -> Compiled:
    """Compile ``spec`` for ``arch`` into the cache. Needs a process whose Triton was imported with the
    interpreter off (Triton's own library functions are interpreted otherwise): see :func:`compile_jobs`."""
    hit = cached(spec, arch, source_digest, cache_dir)
    if hit is not None:
        return hit
    name = spec_name(spec)
    src = ASTSource(fn=spec.fn, signature=dict(spec.signature), constexprs=dict(spec.constexprs))
    try:
        ck = triton_compile(
            src,
            target=arch_target(arch),
            options={"num_warps": spec.num_warps, "num_stages": spec.num_stages},
        )
    except Exception as exc:  # Triton raises many types (CompilationError, RuntimeError, ...)
        lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip() and set(ln.strip()) != {"^"}]
        detail = lines[-1] if lines else ""
        raise BuildError(f"compiling {name} for {arch} failed: {type(exc).__name__}: {detail}") from exc
    md = ck.metadata
    meta = canonical_json(
        {
            "name": md.name,
            "arch": arch,
            "num_warps": md.num_warps,
            "num_stages": md.num_stages,
            "num_ctas": md.num_ctas,
            "shared": md.shared,
            "global_scratch_size": getattr(md, "global_scratch_size", 0),
            "signature": dict(spec.signature),
            "constexprs": {k: _jsonable(v) for k, v in spec.constexprs.items()},
            "triton_version": triton.__version__,
        }
    )
    out = Compiled(name, bytes(ck.asm["cubin"]), ck.asm["ptx"].encode(), meta)
    entry = _entry(cache_dir, cache_key(spec, arch, source_digest))
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=entry.parent, prefix=f".{entry.name[:8]}-"))
    (tmp / "kernel.cubin").write_bytes(out.cubin)
    (tmp / "kernel.ptx").write_bytes(out.ptx)
    (tmp / "kernel.json").write_bytes(out.meta)
    try:
        os.replace(tmp, entry)
    except OSError:  # another build filled the same entry first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


@contextmanager
def compile_lock(cache_dir: Path) -> Iterator[None]:
    """Hold the cache's compile lock: one compiling build per cache at a time, so a concurrent build of the
    same kernels (pytest-xdist workers, two ``bundle build`` commands) waits, re-checks the cache and finds
    them compiled instead of compiling them a second time. Not reentrant."""
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    with open(Path(cache_dir) / ".compile.lock", "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@dataclass(frozen=True)
class Job:
    """Compile every AotSpec of ``op`` for (arch, dtype) with launch ``config``."""

    op: str
    arch: str
    dtype: str
    config: dict[str, Any]


MAX_SPECS_PER_GROUP = 2


def representative_specs(specs: list[AotSpec]) -> list[AotSpec]:
    """The compilation units a bundle ships artifacts for: all of them when there are few, otherwise the
    narrowest and the widest block size of the op's list (``aot()`` orders them by width).

    Widths in between are compiled by Triton's JIT on the node, from the same verified source, into the
    bundle's own cache directory; the shipped artifacts prove that every kernel compiles for every target
    and record digests of what it compiles to.
    """
    if len(specs) <= MAX_SPECS_PER_GROUP:
        return list(specs)
    return [specs[0], specs[-1]]


def compile_jobs(
    stage: Path, jobs: list[Job], source_digests: dict[str, str], cache_dir: Path, timeout: float = 3600,
    workers: int | None = None,
) -> None:
    """Fill the cache for ``jobs`` in child processes with a clean (non-interpreting) Triton.

    ``stage`` holds the bundle's ``kernels/*.py``; ``source_digests`` maps op -> digest of its sources.
    Jobs are spread over ``workers`` children (default: one per CPU). Raises BuildError with a child's
    one-line reason.
    """
    workers = max(1, min(workers or os.cpu_count() or 1, len(jobs)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(Path(cache_dir) / "triton")
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    children = []
    for w in range(workers):
        request = {
            "stage": str(stage),
            "source_digests": source_digests,
            "cache_dir": str(cache_dir),
            "jobs": [dataclasses.asdict(j) for j in jobs[w::workers]],
        }
        proc = subprocess.Popen(
            [sys.executable, "-m", "kernelpack.aot"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
        )
        children.append((proc, json.dumps(request).encode()))
    failures = []
    try:
        for proc, request in children:
            out, err = proc.communicate(request, timeout=timeout)
            if proc.returncode != 0:
                lines = out.decode(errors="replace").strip().splitlines()
                errs = err.decode(errors="replace").strip().splitlines()
                failures.append(lines[-1] if lines else (errs[-1] if errs else f"exit code {proc.returncode}"))
    except subprocess.TimeoutExpired as exc:
        raise BuildError(f"ahead-of-time compilation did not finish within {timeout:.0f} s") from exc
    finally:
        for proc, _ in children:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if failures:
        raise BuildError(failures[0])


def _child_main() -> int:
    from kernelpack.loader import import_kernel_package, op_from_module

    req = json.loads(sys.stdin.buffer.read())
    stage, digests, cache = Path(req["stage"]), req["source_digests"], Path(req["cache_dir"])
    tag = hashlib.sha256(canonical_json(digests)).hexdigest()[:12]
    files = {p.relative_to(stage).as_posix(): p.read_bytes() for p in sorted((stage / "kernels").glob("*.py"))}
    try:
        modules = import_kernel_package(f"_kpack_aot_{tag}", stage, files)
        with compile_mode(cache):
            for j in req["jobs"]:
                op = op_from_module(modules[j["op"]], j["op"])
                if op.aot is None:
                    raise BuildError(f"kernel {j['op']} has no aot(): it cannot be compiled ahead of time")
                try:
                    specs = representative_specs(op.aot(j["dtype"], j["config"]))
                except Exception as exc:
                    raise BuildError(f"{j['op']}.aot({j['dtype']}, {j['config']}) failed: {exc}") from exc
                for spec in specs:
                    try:
                        compile_spec(spec, j["arch"], digests[j["op"]], cache)
                    except BuildError as exc:
                        raise BuildError(f"kernel {j['op']} {j['dtype']}: {exc}") from exc
    except Exception as exc:
        print(str(exc).splitlines()[0] if str(exc) else type(exc).__name__, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_child_main())
