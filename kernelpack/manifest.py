"""The bundle manifest schema (``schema_version: 1``): source form ``bundle.toml`` and built form ``manifest.json``.

``BundleSource`` is what a developer writes; ``Manifest`` is what ``bundle build`` emits: the source fields plus
each kernel's limitations and tolerances, the sha256 of every archive member and the list of compiled
artifacts. Both are strict pydantic v2 models (extra fields forbidden). ``canonical_json`` gives the exact bytes
that are signed.
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from typing import Any, Literal

import tomllib
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kernelpack.errors import ManifestError

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
SIGNATURE_NAME = "signature.json"
SOURCE_NAME = "bundle.toml"

SEMVER_RE = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$"
)
NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,63}$"
OP_PATTERN = r"^[a-z][a-z0-9_]{0,63}$"
ARCH_PATTERN = r"^sm_[1-9][0-9]{1,2}a?$"
# a GPU model within an arch, as kernelpack.loader.detect_device names it ("h100", "h200"): one arch spans
# parts whose best launch configs differ (an H200 has 1.4x an H100's memory bandwidth, same SMs)
DEVICE_PATTERN = r"^[a-z0-9]+$"
ARCH_DEVICE_PATTERN = r"^(sm_[1-9][0-9]{1,2}a?)-([a-z0-9]+)$"
SHA256_PATTERN = r"^[0-9a-f]{64}$"
MEMBER_PATTERN = r"^(kernels|artifacts|golden)/[A-Za-z0-9._/-]+$"
PACKAGE_SOURCE_RE = re.compile(r"^kernelpack\.kernels\.([a-z_][a-z0-9_]*)$")
LOCAL_SOURCE_RE = re.compile(r"^kernels/([a-z_][a-z0-9_]*)\.py$")

ConfigValue = int | float | bool | str


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


def is_prerelease(version: str) -> bool:
    m = SEMVER_RE.match(version)
    return bool(m and m.group(4))


def _check_semver(v: str) -> str:
    if not SEMVER_RE.match(v):
        raise ValueError(f"{v!r} is not a semantic version (MAJOR.MINOR.PATCH[-prerelease][+build])")
    return v


class Targets(_Strict):
    """Hardware and software the bundle was built and validated for."""

    archs: list[str] = Field(min_length=1)
    min_driver: str = Field(pattern=r"^\d+(\.\d+){0,2}$")
    cuda: list[str] = Field(min_length=1)
    triton: str = Field(pattern=r"^\d+\.\d+\.\d+$")
    torch: str

    @field_validator("archs")
    @classmethod
    def _archs(cls, v: list[str]) -> list[str]:
        for a in v:
            if not re.match(ARCH_PATTERN, a):
                raise ValueError(f"arch {a!r} is not of the form sm_XY (e.g. sm_80, sm_90)")
        if len(set(v)) != len(v):
            raise ValueError("archs contain duplicates")
        return v

    @field_validator("cuda")
    @classmethod
    def _cuda(cls, v: list[str]) -> list[str]:
        for c in v:
            if not re.match(r"^\d+\.(\d+|x)$", c):
                raise ValueError(f"CUDA version {c!r} must look like 12.x or 12.4")
        return v

    @field_validator("torch")
    @classmethod
    def _torch(cls, v: str) -> str:
        try:
            spec = SpecifierSet(v)
        except InvalidSpecifier as exc:
            raise ValueError(f"torch range {v!r} is not a version specifier (e.g. '>=2.9,<2.15')") from exc
        if not list(spec):
            raise ValueError("torch range must not be empty")
        return v

    def torch_ok(self, version: str) -> bool:
        return SpecifierSet(self.torch).contains(version.split("+")[0], prereleases=True)


class Traffic(_Strict):
    """The production shapes trials measure: decode batch sizes and prefill token counts."""

    decode_batch_sizes: list[int] = Field(min_length=1)
    prefill_tokens: list[int] = Field(min_length=1)

    @field_validator("decode_batch_sizes", "prefill_tokens")
    @classmethod
    def _positive_sorted(cls, v: list[int]) -> list[int]:
        if any(x <= 0 for x in v):
            raise ValueError("sizes must be positive")
        if v != sorted(set(v)):
            raise ValueError("sizes must be strictly increasing (sorted, no duplicates)")
        return v


class TokenWindow(_Strict):
    """Calls of ``lo`` to ``hi`` tokens (batch x sequence of the call; ``hi`` absent: no ceiling)."""

    lo: int = Field(ge=1)
    hi: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> TokenWindow:
        if self.hi is not None and self.hi < self.lo:
            raise ValueError(f"token window [{self.lo}, {self.hi}] is empty")
        return self

    def contains(self, tokens: int) -> bool:
        return self.lo <= tokens and (self.hi is None or tokens <= self.hi)


class KernelSource(_Strict):
    """One op as written in bundle.toml."""

    op: str = Field(pattern=OP_PATTERN)
    source: str
    entry: Literal["OP"] = "OP"
    configs: dict[str, dict[str, ConfigValue]] = Field(default_factory=lambda: {"default": {}})
    # the target archs this op is built for (default: all); e.g. FP8 kernels need sm_89+
    archs: list[str] | None = None
    # per arch, the token windows where this op's kernel was measured at least as fast as the baseline a serving
    # team runs (docs/serving.md, "Where the kernels run"); serving runs the baseline outside them. An arch
    # without an entry runs the kernel wherever its domain allows. Absent from manifests built before it existed
    # (and left out of the signed bytes when unset, so those still verify).
    wins: dict[str, list[TokenWindow]] | None = Field(default=None, exclude_if=lambda v: v is None)

    @field_validator("source")
    @classmethod
    def _source(cls, v: str) -> str:
        if not (PACKAGE_SOURCE_RE.match(v) or LOCAL_SOURCE_RE.match(v)):
            raise ValueError(
                f"source {v!r} must be 'kernelpack.kernels.<module>' or a bundle-local 'kernels/<file>.py'"
            )
        return v

    @field_validator("configs")
    @classmethod
    def _configs(cls, v: dict[str, dict[str, ConfigValue]]) -> dict[str, dict[str, ConfigValue]]:
        if "default" not in v:
            raise ValueError("configs must contain a 'default' entry")
        for key in v:
            if key != "default" and not re.match(ARCH_PATTERN, key) and not re.match(ARCH_DEVICE_PATTERN, key):
                raise ValueError(f"config key {key!r} must be 'default', an arch like sm_90 or an arch and a "
                                 "GPU model like sm_90-h200")
        return v

    def built_for(self, targets: Targets) -> list[str]:
        """The archs this op is compiled for."""
        return list(self.archs) if self.archs is not None else list(targets.archs)

    @field_validator("wins")
    @classmethod
    def _wins(cls, v: dict[str, list[TokenWindow]] | None) -> dict[str, list[TokenWindow]] | None:
        for arch, windows in (v or {}).items():
            if not re.match(ARCH_PATTERN, arch):
                raise ValueError(f"wins key {arch!r} must be an arch like sm_90")
            for a, b in itertools.pairwise(windows):
                if a.hi is None or b.lo <= a.hi:
                    raise ValueError(f"wins for {arch}: token windows must be sorted and must not overlap")
        return v

    def wins_for(self, arch: str | None) -> list[TokenWindow] | None:
        """The token windows where the kernel wins on ``arch`` (None: no measurement, run it everywhere)."""
        return None if self.wins is None or arch is None else self.wins.get(arch)

    def config_for(self, arch: str | None, device: str | None = None) -> dict[str, ConfigValue]:
        """The launch config for ``arch`` on GPU model ``device``: ``default``, then the arch entry, then the
        ``{arch}-{device}`` entry, each layered over the one before."""
        if not arch:
            return dict(self.configs["default"])
        return {**self.configs["default"], **self.configs.get(arch, {}),
                **(self.configs.get(f"{arch}-{device}", {}) if device else {})}

    def devices_for(self, arch: str) -> list[str]:
        """The GPU models of ``arch`` with a config entry of their own."""
        return sorted(m.group(2) for key in self.configs
                      if (m := re.match(ARCH_DEVICE_PATTERN, key)) and m.group(1) == arch)


class _BundleCommon(_Strict):
    schema_version: Literal[1]
    name: str = Field(pattern=NAME_PATTERN)
    version: str
    parent: str | None = None
    note: str = Field(min_length=1, max_length=4000)
    fault_fixture: str | None = None
    targets: Targets
    traffic: Traffic

    @field_validator("version")
    @classmethod
    def _version(cls, v: str) -> str:
        return _check_semver(v)

    @field_validator("parent")
    @classmethod
    def _parent(cls, v: str | None) -> str | None:
        return None if v is None else _check_semver(v)

    @model_validator(mode="after")
    def _common(self) -> _BundleCommon:
        if self.parent == self.version:
            raise ValueError(f"parent {self.parent} must differ from version")
        if self.fault_fixture is not None:
            if not self.fault_fixture.strip():
                raise ValueError("fault_fixture must describe the injected fault")
            if not is_prerelease(self.version):
                raise ValueError(
                    f"fault fixture bundles must carry a prerelease version (e.g. 1.2.0-fault.x), got {self.version}"
                )
        ops = [k.op for k in self.kernels]  # type: ignore[attr-defined]
        if len(set(ops)) != len(ops):
            raise ValueError("kernels list the same op twice")
        if not ops:
            raise ValueError("a bundle needs at least one kernel")
        for k in self.kernels:  # type: ignore[attr-defined]
            for key in k.configs:
                arch = m.group(1) if (m := re.match(ARCH_DEVICE_PATTERN, key)) else key
                if key != "default" and arch not in self.targets.archs:
                    raise ValueError(f"kernel {k.op}: config for {key} whose arch is not a target arch")
            for key in k.wins or {}:
                if key not in self.targets.archs:
                    raise ValueError(f"kernel {k.op}: wins for {key} which is not a target arch")
            if k.archs is not None:
                if not k.archs or len(set(k.archs)) != len(k.archs):
                    raise ValueError(f"kernel {k.op}: archs must be a non-empty list without duplicates")
                for a in k.archs:
                    if a not in self.targets.archs:
                        raise ValueError(f"kernel {k.op}: arch {a} is not a target arch")
        return self


class BundleSource(_BundleCommon):
    """bundle.toml: what a developer writes."""

    kernels: list[KernelSource]


class ToleranceEntry(_Strict):
    atol: float = Field(ge=0)
    rtol: float = Field(ge=0)


class BuiltKernel(KernelSource):
    """One op in the built manifest: module path inside the archive, domain and tolerances recorded."""

    module: str = Field(pattern=r"^kernels/[a-z_][a-z0-9_]*\.py$")
    limitations: dict[str, Any]
    tolerances: dict[str, ToleranceEntry]


class FileEntry(_Strict):
    sha256: str = Field(pattern=SHA256_PATTERN)
    size: int = Field(ge=0)


class Artifact(_Strict):
    """One ahead-of-time compiled kernel: cubin + ptx + launch metadata for one (op, arch, dtype, fn)."""

    op: str = Field(pattern=OP_PATTERN)
    arch: str = Field(pattern=ARCH_PATTERN)
    # compiled with the config of this GPU model of the arch (``{arch}-{device}``); unset: the arch's config
    device: str | None = Field(default=None, pattern=DEVICE_PATTERN, exclude_if=lambda v: v is None)
    dtype: str
    kernel: str
    cubin: str = Field(pattern=MEMBER_PATTERN)
    ptx: str = Field(pattern=MEMBER_PATTERN)
    meta: str = Field(pattern=MEMBER_PATTERN)


class Golden(_Strict):
    op: str = Field(pattern=OP_PATTERN)
    dtype: str
    seed: int
    path: str = Field(pattern=MEMBER_PATTERN)


class Manifest(_BundleCommon):
    """manifest.json: the built, signed description of every byte in the archive."""

    kernels: list[BuiltKernel]
    files: dict[str, FileEntry]
    artifacts: list[Artifact]
    golden: list[Golden]

    @field_validator("files")
    @classmethod
    def _files(cls, v: dict[str, FileEntry]) -> dict[str, FileEntry]:
        for path in v:
            if not re.match(MEMBER_PATTERN, path) or ".." in path.split("/") or "//" in path:
                raise ValueError(f"file path {path!r} is not a safe bundle member path")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        for k in self.kernels:
            if k.module not in self.files:
                raise ValueError(f"kernel {k.op}: module {k.module} is not listed in files")
        for a in self.artifacts:
            for p in (a.cubin, a.ptx, a.meta):
                if p not in self.files:
                    raise ValueError(f"artifact {p} is not listed in files")
        for g in self.golden:
            if g.path not in self.files:
                raise ValueError(f"golden vector {g.path} is not listed in files")
        return self

    def kernel(self, op: str) -> BuiltKernel:
        for k in self.kernels:
            if k.op == op:
                return k
        raise KeyError(op)

    def to_bytes(self) -> bytes:
        return canonical_json(self.model_dump(mode="json"))


def canonical_json(obj: Any) -> bytes:
    """The canonical encoding that is hashed and signed: sorted keys, no insignificant whitespace, UTF-8."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def _format_validation(where: str, exc: ValidationError) -> str:
    errs = []
    for e in exc.errors()[:5]:
        loc = ".".join(str(x) for x in e["loc"]) or "<root>"
        errs.append(f"{loc}: {e['msg']}")
    more = f" (+{exc.error_count() - 5} more)" if exc.error_count() > 5 else ""
    return f"{where}: " + "; ".join(errs) + more


def load_source(path: Path) -> BundleSource:
    """Parse and validate a bundle.toml (``path`` may be the file or the bundle directory)."""
    path = Path(path)
    if path.is_dir():
        path = path / SOURCE_NAME
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ManifestError(f"{path}: no such file") from exc
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{path}: not valid TOML: {exc}") from exc
    try:
        return BundleSource.model_validate(data)
    except ValidationError as exc:
        raise ManifestError(_format_validation(str(path), exc)) from exc


def parse_manifest(data: bytes, where: str = MANIFEST_NAME) -> Manifest:
    """Parse and validate manifest.json bytes; it must also be in canonical form."""
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"{where}: not valid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise ManifestError(f"{where}: must be a JSON object")
    try:
        manifest = Manifest.model_validate(obj)
    except ValidationError as exc:
        raise ManifestError(_format_validation(where, exc)) from exc
    if manifest.to_bytes() != data:
        raise ManifestError(f"{where}: not in canonical form (sorted keys, compact separators)")
    return manifest
