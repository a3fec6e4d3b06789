"""Test bundles: the real llm-fused sources (stable, tuned, fault fixtures) trimmed to a few ops and one arch.

The op modules and fault kernels are the real ones from ``kernelpack/bundles/llm-fused``; only the op list
and target archs are cut down so the session build (kernelpack's real build: AOT compile, golden vectors,
ed25519 signature) and the CPU-interpreter trials stay fast.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import tomllib

from kernelpack.build import build_bundle
from kernelpack.signing import KeyPair, generate_keypair

REPO = Path(__file__).resolve().parents[2]
SOURCES = REPO / "kernelpack" / "bundles" / "llm-fused"
TEST_OPS = ("add_rmsnorm", "bias_gelu")
TEST_ARCHS = ("sm_90",)


def _inline(table: dict) -> str:
    return "{ " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in table.items()) + " }"


def trimmed_source(version: str, dest: Path, ops: tuple[str, ...] = TEST_OPS,
                   archs: tuple[str, ...] = TEST_ARCHS) -> Path:
    """Write a copy of bundle ``version`` with only ``ops`` and ``archs`` to ``dest``; returns the dir."""
    src = SOURCES / version
    doc = tomllib.loads((src / "bundle.toml").read_text())
    dest.mkdir(parents=True, exist_ok=True)
    if (src / "kernels").is_dir():
        shutil.copytree(src / "kernels", dest / "kernels", dirs_exist_ok=True)
    lines = [f"schema_version = {doc['schema_version']}"]
    for key in ("name", "version", "parent", "note", "fault_fixture"):
        if key in doc:
            lines.append(f"{key} = {json.dumps(doc[key])}")
    t = doc["targets"]
    lines += ["", "[targets]", f"archs = {json.dumps(list(archs))}", f"min_driver = {json.dumps(t['min_driver'])}",
              f"cuda = {json.dumps(t['cuda'])}", f"triton = {json.dumps(t['triton'])}",
              f"torch = {json.dumps(t['torch'])}", "", "[traffic]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in doc["traffic"].items()]
    for k in doc["kernels"]:
        if k["op"] not in ops:
            continue
        lines += ["", "[[kernels]]", f"op = {json.dumps(k['op'])}", f"source = {json.dumps(k['source'])}"]
        configs = {c: v for c, v in k.get("configs", {"default": {}}).items() if c == "default" or c in archs}
        lines.append("[kernels.configs]")
        lines += [f"{c} = {_inline(v)}" for c, v in configs.items()]
    (dest / "bundle.toml").write_text("\n".join(lines) + "\n")
    return dest


@dataclass
class BuiltBundles:
    keys: KeyPair
    trusted_dir: Path  # holds only the public key
    paths: dict[str, Path]  # version -> .kpack
    digests: dict[str, str]


def build_test_bundles(root: Path, versions: tuple[str, ...], aot_cache: Path | None = None,
                       ops: tuple[str, ...] = TEST_OPS) -> BuiltBundles:
    keys = generate_keypair(root / "keys")
    trusted = root / "trusted"
    trusted.mkdir(parents=True, exist_ok=True)
    shutil.copy(keys.public_path, trusted / keys.public_path.name)
    paths, digests = {}, {}
    for v in versions:
        src = trimmed_source(v, root / "src" / v, ops)
        res = build_bundle(src, root / "kpack" / f"{v}.kpack", keys.private_path, cache_dir=aot_cache)
        paths[v], digests[v] = res.path, res.digest
    return BuiltBundles(keys, trusted, paths, digests)
