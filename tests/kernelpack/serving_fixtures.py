"""Fixtures for the serving tests: two signed versions of a small Llama-op bundle and a runtime serving them.

``serve_bundles`` builds ``serve`` 0.1.0 and 0.2.0 (add_rmsnorm, swiglu, rope, flash_attn for sm_90; the same
kernels, different versions and digests) once per session with the persistent AOT cache. ``serving`` gives a
fresh runtime directory with 0.1.0 published and points ``torch.ops.kernelctl`` at it (no bundle named: each op
resolves to the active bundle that provides it).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kernelpack import torch_ops
from kernelpack.build import BuildResult, build_bundle
from kernelpack.runtime import Runtime, publish_active
from kernelpack.scaffold import write_source
from tests.kernelpack.bundle_fixtures import Keys

OPS = ("add_rmsnorm", "swiglu", "rope", "flash_attn", "decode_attn")


def write_serve_src(root: Path, version: str) -> Path:
    return write_source(root, "serve", version, kernels={op: f"kernelpack.kernels.{op}" for op in OPS},
                        note="serving test bundle", cuda=["12.x", "13.x"], triton="3.6.0", prefill_tokens=[16])


@pytest.fixture(scope="session")
def serve_bundles(tmp_path_factory: pytest.TempPathFactory, keys: Keys, aot_cache: Path) -> dict[str, BuildResult]:
    root = tmp_path_factory.mktemp("serve")
    return {v: build_bundle(write_serve_src(root / v, v), root / f"serve-{v}.kpack", keys.pair.private_path,
                            cache_dir=aot_cache) for v in ("0.1.0", "0.2.0")}


def ref(b: BuildResult) -> dict[str, str]:
    return {"version": b.manifest.version, "path": str(b.path), "digest": b.digest}


@dataclass
class Serving:
    runtime: Runtime
    bundles: dict[str, BuildResult]

    def publish(self, version: str, stable: str | None = "0.1.0") -> None:
        b = self.bundles[version]
        publish_active(self.runtime.runtime_dir, "serve", version, b.path, b.digest,
                       stable=ref(self.bundles[stable]) if stable else None)


@pytest.fixture
def serving(tmp_path: Path, keys: Keys, serve_bundles: dict[str, BuildResult]) -> Iterator[Serving]:
    rt = Runtime(tmp_path / "run", keys.trusted, tmp_path / "cache", arch="sm_90")
    s = Serving(rt, serve_bundles)
    s.publish("0.1.0", stable=None)
    torch_ops.configure(rt)  # each op from the active bundle that provides it: here serve
    yield s
    rt.stop_watching()
    torch_ops.configure(None)
