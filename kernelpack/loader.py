"""Load a verified bundle into the running process and bind its ops to this machine's arch.

``load_bundle`` verifies first (nothing is imported from an unverified bundle), extracts the archive into a
content-addressed directory ``<cache_dir>/bundles/<digest>/`` (read-only files; reused only when its bytes
still match), and imports each kernel module as ``_kpack_<digest12>.kernels.<op>``. Module code is executed
from the verified bytes (never from a .pyc); the files on disk exist because Triton's JIT reads kernel
source through ``inspect``. A meta-path finder serves only those private packages, so two versions live
side by side in one process and ``sys.path`` is never touched.

``BoundOp`` runs the Triton path with the launch config for the detected arch, or falls back to the PyTorch
eager path (logged, counted) when the hardware is outside the bundle's targets or the input is outside the op's
declared domain. The eager path is the installed ``kernelpack.kernels.<op>``'s where kernelpack has the op (it
implements the operator contract of this installation: an older bundle's op may lack a run-time parameter such
as eps, and its own eager path would ignore it), else the bundle's. A call giving a parameter the bundle's op
does not take a value other than the default runs that path too (``spec.call_inputs``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import logging
import os
import re
import shutil
import stat
import sys
import tempfile
import threading
import types
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import platformdirs
import torch
import triton
from triton import knobs

import kernelpack.kernels.spec as spec_module
from kernelpack.archive import DEFAULT_LIMITS, Limits, read_directory
from kernelpack.errors import LoadError
from kernelpack.kernels.spec import DomainError, Inputs, KernelOp, Outputs, call_inputs, first_tensor
from kernelpack.manifest import Manifest
from kernelpack.verify import TrustedKeys, VerifiedBundle, verify_path

log = logging.getLogger("kernelpack.loader")

ARCH_ENV = "KERNELCTL_ARCH"


def default_cache_dir() -> Path:
    return Path(platformdirs.user_cache_dir("kernelctl"))


# --------------------------------------------------------------------------------------------------------
# private-package import machinery


class _VerifiedSourceLoader(importlib.abc.SourceLoader):
    """Executes a module from bytes that were verified, ignoring any bytecode cache (none is written)."""

    def __init__(self, fullname: str, path: str, data: bytes) -> None:
        self._fullname, self._path, self._data = fullname, path, data

    def get_filename(self, fullname: str) -> str:
        return self._path

    def get_data(self, path: str) -> bytes:
        if path == self._path:
            return self._data
        raise OSError(f"{path} is not part of this bundle")


class _KpackFinder(importlib.abc.MetaPathFinder):
    """Resolves ``<package>.kernels.<module>`` for registered private packages only."""

    def __init__(self) -> None:
        self.packages: dict[str, dict[str, tuple[str, bytes]]] = {}
        self.lock = threading.Lock()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        head, _, rest = fullname.partition(".kernels.")
        sources = self.packages.get(head)
        if sources is None or not rest or "." in rest or rest not in sources:
            return None
        file_path, data = sources[rest]
        return importlib.util.spec_from_file_location(
            fullname, file_path, loader=_VerifiedSourceLoader(fullname, file_path, data)
        )


_FINDER = _KpackFinder()
if not any(isinstance(f, _KpackFinder) for f in sys.meta_path):
    sys.meta_path.append(_FINDER)


def import_kernel_package(package: str, root: Path, files: Mapping[str, bytes]) -> dict[str, types.ModuleType]:
    """Register ``package`` for the kernel sources ``files`` (``kernels/<mod>.py`` -> bytes, also present on
    disk under ``root``) and import every module; returns {module name: module}."""
    sources = {
        name[len("kernels/") : -3]: (str(Path(root, name)), data)
        for name, data in files.items()
        if name.startswith("kernels/") and name.endswith(".py") and name.count("/") == 1
    }
    with _FINDER.lock:
        if package not in sys.modules:
            pkg = types.ModuleType(package, f"kernel bundle package at {root}")
            pkg.__path__ = []
            pkg.__package__ = package
            sub = types.ModuleType(f"{package}.kernels")
            sub.__path__ = []
            sub.__package__ = f"{package}.kernels"
            sys.modules[package] = pkg
            sys.modules[f"{package}.kernels"] = sub
            sys.modules[f"{package}.kernels.spec"] = spec_module
            pkg.kernels = sub  # type: ignore[attr-defined]
        _FINDER.packages[package] = sources
    modules: dict[str, types.ModuleType] = {}
    for mod in sorted(sources):
        try:
            modules[mod] = importlib.import_module(f"{package}.kernels.{mod}")
        except Exception as exc:
            raise LoadError(f"kernel module kernels/{mod}.py failed to import: {type(exc).__name__}: {exc}") from exc
    return modules


def forget_package(package: str) -> None:
    """Drop a private package from sys.modules (used for throw-away build-time imports)."""
    with _FINDER.lock:
        _FINDER.packages.pop(package, None)
        for name in [n for n in sys.modules if n == package or n.startswith(package + ".")]:
            del sys.modules[name]


def op_from_module(module: types.ModuleType, op: str, entry: str = "OP") -> KernelOp:
    obj = getattr(module, entry, None)
    if not isinstance(obj, KernelOp):
        raise LoadError(f"kernel module for op {op} has no {entry}: KernelOp (found {type(obj).__name__})")
    if obj.name != op:
        raise LoadError(f"kernel module for op {op} exports an OP named {obj.name!r}")
    return obj


# --------------------------------------------------------------------------------------------------------
# extraction


def _make_read_only(root: Path) -> None:
    for dirpath, _dirnames, filenames in os.walk(root):
        for fn in filenames:
            os.chmod(Path(dirpath, fn), stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
        os.chmod(dirpath, stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)


def _remove_tree(root: Path) -> None:
    for dirpath, _d, _f in os.walk(root):
        os.chmod(dirpath, stat.S_IRWXU)
    shutil.rmtree(root, ignore_errors=True)


def extract(bundle: VerifiedBundle, target: Path, limits: Limits = DEFAULT_LIMITS) -> Path:
    """Materialise verified members at ``target`` (content-addressed); reuse it only if byte-identical."""
    target = Path(target)
    if target.is_dir():
        try:
            if read_directory(target, limits) == bundle.members:
                return target
        except Exception:
            pass
        log.warning("extracted bundle at %s does not match its digest; re-extracting", target)
        stale = target.with_name(f".{target.name}.stale{os.getpid()}")
        os.replace(target, stale)
        _remove_tree(stale)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name[:12]}-"))
    for name, data in bundle.members.items():
        p = tmp / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    _make_read_only(tmp)
    try:
        os.replace(tmp, target)
    except OSError:  # a concurrent loader extracted it first; theirs is verified on next use
        _remove_tree(tmp)
    return target


# --------------------------------------------------------------------------------------------------------
# arch detection and binding


def detect_arch(arch: str | None = None) -> str | None:
    """``sm_{major}{minor}`` of the CUDA device, else ``arch``, else ``$KERNELCTL_ARCH``, else None."""
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"sm_{major}{minor}"
    return arch or os.environ.get(ARCH_ENV) or None


def detect_device() -> str | None:
    """The CUDA device's GPU model as launch configs name it (``{arch}-{device}`` keys): the first word of its
    name with a digit in it, lower-cased, "NVIDIA" dropped ("NVIDIA H100 80GB HBM3" -> ``h100``, "NVIDIA H200" ->
    ``h200``, "NVIDIA A100-SXM4-80GB" -> ``a100``); None without a CUDA device."""
    if not torch.cuda.is_available():
        return None
    return device_model(torch.cuda.get_device_name())


def device_model(name: str) -> str | None:
    """``detect_device``'s rule on a device name (None when no word of it has a digit)."""
    m = re.search(r"[a-z]*[0-9]+[a-z]*", name.lower().replace("nvidia", ""))
    return m.group(0) if m else None


def unsupported_reason(manifest: Manifest, arch: str | None) -> str | None:
    """Why this process cannot run the bundle's Triton kernels (None when it can)."""
    interpret = bool(knobs.runtime.interpret)
    if not torch.cuda.is_available() and not interpret:
        return "no CUDA device and the Triton interpreter (TRITON_INTERPRET=1) is off"
    if arch is not None and arch not in manifest.targets.archs:
        return f"arch {arch} is not a target of {manifest.name}@{manifest.version} ({', '.join(manifest.targets.archs)})"
    if arch is None and not interpret:
        return "GPU arch unknown"
    if triton.__version__ != manifest.targets.triton:
        return f"Triton {triton.__version__} installed, bundle needs {manifest.targets.triton}"
    if not manifest.targets.torch_ok(torch.__version__):
        return f"torch {torch.__version__} outside the bundle's range {manifest.targets.torch}"
    return None


def installed_op(name: str) -> KernelOp | None:
    """The op ``name`` of the installed ``kernelpack.kernels`` package (None when kernelpack has no such op)."""
    try:
        op = importlib.import_module(f"kernelpack.kernels.{name}").OP
    except (ImportError, AttributeError):
        return None
    return op if isinstance(op, KernelOp) else None


@dataclass
class BoundOp:
    """One op of a loaded bundle bound to an arch: call it like a function on a dict of input tensors (and the
    op's scalar parameters). ``calls`` counts the calls its Triton kernel served, ``fallbacks`` the others."""

    name: str
    op: KernelOp
    config: dict[str, Any]
    arch: str | None
    bundle: str
    triton_cache_dir: Path
    unsupported: str | None = None
    fallbacks: int = 0
    last_fallback_reason: str | None = None
    calls: int = 0
    # (lo, hi) token windows where the manifest says the kernel wins on this arch; None: no measurement
    wins: tuple[tuple[int, int | None], ...] | None = None
    _logged: set[str] = field(default_factory=set, repr=False)
    _installed: KernelOp | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._installed = installed_op(self.name)

    @property
    def supported(self) -> bool:
        return self.unsupported is None

    def wins_at(self, tokens: int) -> bool:
        """Whether the bundle says its kernel wins at ``tokens`` tokens per call on this arch (True where it
        ships no measurement for the arch)."""
        return self.wins is None or any(lo <= tokens and (hi is None or tokens <= hi) for lo, hi in self.wins)

    def _fallback(self, inputs: Inputs, reason: str) -> Outputs:
        self.fallbacks += 1
        self.last_fallback_reason = reason
        if reason not in self._logged and len(self._logged) < 64:
            self._logged.add(reason)
            log.warning("%s %s: falling back to the PyTorch eager path: %s", self.bundle, self.name, reason)
        if self._installed is not None:
            return self._installed.eager(inputs)
        return self.op.eager(call_inputs(self.op, inputs, {}) or {})

    @contextmanager
    def cache_scope(self) -> Iterator[None]:
        """Compile into this bundle's Triton cache dir (persists across processes for warm trials)."""
        with knobs.cache.scope():
            knobs.cache.dir = str(self.triton_cache_dir)
            yield

    def __call__(self, inputs: Inputs) -> Outputs:
        if self.unsupported is not None:
            return self._fallback(inputs, self.unsupported)
        contract = self._installed.domain.params if self._installed is not None else self.op.domain.params
        args = call_inputs(self.op, inputs, contract)
        if args is None:
            lacks = sorted(k for k in inputs if k in contract and k not in self.op.domain.params)
            return self._fallback(inputs, f"this version's op predates the run-time parameter(s) {', '.join(lacks)} "
                                          "and computes with their defaults only")
        try:
            self.op.domain.check(first_tensor(args).dtype, self.op.shape_of(args), args)
        except DomainError as exc:
            return self._fallback(inputs, f"input outside the op's domain: {exc}")
        outs = self.op.alloc_outputs(args)
        with self.cache_scope():
            self.op.run(args, outs, self.config)
        self.calls += 1
        return outs


@dataclass
class LoadedBundle:
    name: str
    version: str
    digest: str
    manifest: Manifest
    ops: dict[str, BoundOp]
    root: Path
    key_id: str
    arch: str | None
    package: str

    def __getitem__(self, op: str) -> BoundOp:
        return self.ops[op]


def load_bundle(
    path_or_extracted_dir: Path,
    trusted_keys: TrustedKeys,
    *,
    arch: str | None = None,
    cache_dir: Path | None = None,
    limits: Limits = DEFAULT_LIMITS,
    digest: str | None = None,
) -> LoadedBundle:
    """Verify, extract and import a bundle; bind its ops to the detected arch (see module docstring)."""
    source = Path(path_or_extracted_dir)
    bundle = verify_path(source, trusted_keys, limits=limits, digest=digest)
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    root = source if source.is_dir() else extract(bundle, cache_dir / "bundles" / bundle.digest, limits)
    package = f"_kpack_{bundle.digest[:12]}"
    kernel_files = {n: d for n, d in bundle.members.items() if n.startswith("kernels/")}
    modules = import_kernel_package(package, root, kernel_files)
    manifest = bundle.manifest
    resolved_arch = detect_arch(arch)
    device = detect_device()
    reason = unsupported_reason(manifest, resolved_arch)
    triton_cache = cache_dir / "triton" / bundle.digest
    triton_cache.mkdir(parents=True, exist_ok=True)
    ops: dict[str, BoundOp] = {}
    for k in manifest.kernels:
        mod = modules.get(k.module[len("kernels/") : -3])
        if mod is None:
            raise LoadError(f"kernel module {k.module} for op {k.op} is missing")
        op = op_from_module(mod, k.op, k.entry)
        config = {**op.default_config, **k.config_for(resolved_arch, device)}
        why = reason
        if why is None and resolved_arch is not None and resolved_arch not in k.built_for(manifest.targets):
            why = f"op {k.op} is not built for {resolved_arch} (only {', '.join(k.built_for(manifest.targets))})"
        wins = k.wins_for(resolved_arch)
        ops[k.op] = BoundOp(
            k.op, op, config, resolved_arch, f"{manifest.name}@{manifest.version}", triton_cache, why,
            wins=None if wins is None else tuple((w.lo, w.hi) for w in wins),
        )
    if reason is not None:
        log.warning("%s@%s: Triton kernels disabled (%s); ops use the PyTorch path", manifest.name,
                    manifest.version, reason)
    return LoadedBundle(
        manifest.name, manifest.version, bundle.digest, manifest, ops, root, bundle.key_id, resolved_arch, package
    )
