"""Bundle sources and signed bundle sets made in code: the one writer of a ``bundle.toml`` outside the shipped
bundles, and a signing key with its trusted directory.

Tests, benchmarks, the simulators and the demo build small real bundles through here (then
:func:`kernelpack.build.build_bundle` validates, compiles and signs them as for any bundle)::

    keys = signing_keys(root / "keys")
    src = write_source(root / "src", "llm-fused", "1.1.0", kernels={"bias_gelu": "kernelpack.kernels.bias_gelu"})
    bundles = build_signed(root, "llm-fused", ["1.0.0", "1.1.0"], kernels={"bias_gelu": "kernelpack.kernels.bias_gelu"})
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kernelpack.signing import KeyPair, generate_keypair

DEFAULT_TORCH = ">=2.9,<2.15"


def _toml(value: Any) -> str:
    """A TOML value: strings, numbers, booleans, lists and (inline) tables of them."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string for the plain text used here
    if isinstance(value, Mapping):
        return "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + " }" if value else "{}"
    return "[" + ", ".join(_toml(v) for v in value) + "]"


def bundle_toml(name: str, version: str, *, kernels: Mapping[str, str], note: str = "",
                archs: Iterable[str] = ("sm_90",), min_driver: str = "535", cuda: Iterable[str] = ("12.x",),
                triton: str | None = None, torch: str = DEFAULT_TORCH, decode_batch_sizes: Iterable[int] = (1, 8),
                prefill_tokens: Iterable[int] = (64,),
                configs: Mapping[str, Mapping[str, Mapping[str, Any]]] | None = None,
                wins: Mapping[str, Mapping[str, Iterable[Mapping[str, int]]]] | None = None) -> str:
    """The text of a ``bundle.toml``: ``kernels`` maps op -> source (module or bundle-relative path),
    ``configs`` op -> {arch or "default": launch config}, ``wins`` op -> {arch: token windows ``{lo, hi}``
    where the kernel wins}; ``triton`` defaults to the installed version."""
    if triton is None:
        import triton as _triton

        triton = _triton.__version__
    lines = [f"schema_version = 1\nname = {_toml(name)}\nversion = {_toml(version)}\nnote = {_toml(note)}\n",
             f"[targets]\narchs = {_toml(list(archs))}\nmin_driver = {_toml(min_driver)}\ncuda = {_toml(list(cuda))}",
             f"triton = {_toml(triton)}\ntorch = {_toml(torch)}\n",
             f"[traffic]\ndecode_batch_sizes = {_toml(list(decode_batch_sizes))}",
             f"prefill_tokens = {_toml(list(prefill_tokens))}"]
    for op, source in kernels.items():
        lines.append(f"\n[[kernels]]\nop = {_toml(op)}\nsource = {_toml(source)}")
        op_configs = (configs or {}).get(op)
        if op_configs:
            lines.append("[kernels.configs]")
            lines += [f"{arch} = {_toml(cfg)}" for arch, cfg in op_configs.items()]
        if (op_wins := (wins or {}).get(op)) is not None:
            lines.append("[kernels.wins]")
            lines += [f"{arch} = {_toml(list(windows))}" for arch, windows in op_wins.items()]
    return "\n".join(lines) + "\n"


def write_source(root: Path, name: str, version: str, **toml: Any) -> Path:
    """Write ``root/bundle.toml`` (:func:`bundle_toml`'s arguments); ``root``, ready for ``build_bundle``."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "bundle.toml").write_text(bundle_toml(name, version, **toml))
    return root


@dataclass(frozen=True)
class SigningKeys:
    """A fresh ed25519 key pair and a directory that trusts only its public key."""

    pair: KeyPair
    trusted: Path


def signing_keys(root: Path, *, trusted: Path | None = None) -> SigningKeys:
    """Generate a key pair under ``root`` and copy its public key into ``trusted`` (default ``root/trusted``)."""
    pair = generate_keypair(root)
    trusted = trusted or root / "trusted"
    trusted.mkdir(parents=True, exist_ok=True)
    (trusted / pair.public_path.name).write_bytes(pair.public_path.read_bytes())
    return SigningKeys(pair, trusted)


@dataclass(frozen=True)
class SignedBundles:
    """Signed ``.kpack`` files of one bundle name: ``files[version]``; ``trusted`` verifies them."""

    name: str
    root: Path
    trusted: Path
    private_key: Path
    files: dict[str, Path]

    def ref(self, version: str) -> str:
        return f"{self.name}@{version}"


def build_signed(root: Path, name: str, versions: Iterable[str], *, aot_archs: list[str] | None = None,
                 cache_dir: Path | None = None, **toml: Any) -> SignedBundles:
    """Write a source per version, build and sign each with one fresh key (``root/keys``, ``root/trusted``)."""
    from kernelpack.build import build_bundle  # imports triton's compiler

    root.mkdir(parents=True, exist_ok=True)
    keys = signing_keys(root / "keys", trusted=root / "trusted")
    files: dict[str, Path] = {}
    for version in versions:
        src = write_source(root / f"src-{version}", name, version, **toml)
        files[version] = root / f"{name}-{version}.kpack"
        build_bundle(src, files[version], keys.pair.private_path, aot_archs=aot_archs, cache_dir=cache_dir)
    return SignedBundles(name, root, keys.trusted, keys.pair.private_path, files)
