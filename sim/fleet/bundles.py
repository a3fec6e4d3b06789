"""Signed ``llm-fused`` bundles for the fleet simulator, built once with :mod:`kernelpack.build` and cached."""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from sim.fleet.config import BUNDLE, VERSIONS


@dataclass
class SimBundles:
    trusted_dir: Path
    files: dict[str, Path]

    def digest(self, version: str) -> str:
        return hashlib.sha256(self.files[version].read_bytes()).hexdigest()


def default_bundle_cache() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("kernelctl")) / "sim-fleet-bundles"


def prepare_bundles(cache: Path) -> SimBundles:
    """Signed ``llm-fused`` bundles for the simulation, built once with kernelpack.build and cached.

    The simulated agents never run kernels, so each bundle holds one fused op (bias_gelu, compiled ahead of
    time for sm_80 and sm_90): same format, signature and verification as a full bundle, seconds to build.
    """
    from importlib.metadata import version as dist_version

    cache = Path(cache) / f"triton{dist_version('triton')}"
    trusted = cache / "trusted"
    files = {v: cache / f"{BUNDLE}-{v}.kpack" for v in VERSIONS}
    if trusted.is_dir() and all(f.exists() for f in files.values()):
        return SimBundles(trusted, files)
    from kernelpack.build import build_bundle
    from kernelpack.scaffold import write_source
    from kernelpack.signing import generate_keypair

    cache.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix="sim-bundles-", dir=cache))
    key = generate_keypair(stage / "keys")
    (stage / "trusted").mkdir()
    (stage / "trusted" / key.public_path.name).write_bytes(key.public_path.read_bytes())
    for v in VERSIONS:
        src = stage / f"src-{v}"
        write_source(src, BUNDLE, v, kernels={"bias_gelu": "kernelpack.kernels.bias_gelu"},
                     note=f"fleet simulator bundle {v}", archs=("sm_80", "sm_90"), cuda=("12.x", "13.x"))
        build_bundle(src, stage / files[v].name, key.private_path)
    # publish atomically-enough: files first, the trusted dir last (its presence marks a complete cache)
    for v in VERSIONS:
        os.replace(stage / files[v].name, files[v])
    if trusted.exists():
        import shutil

        shutil.rmtree(trusted)
    os.replace(stage / "trusted", trusted)
    return SimBundles(trusted, files)
