"""Shared bundle fixtures for the kernelpack tests: keys, a tiny bundle, and the shipped llm-fused bundles.

Import the fixtures into a test module with ``from tests.kernelpack.bundle_fixtures import *``.

The shipped bundles are built once per session with the persistent ahead-of-time compile cache (the same
content-keyed cache ``kernelctl bundle build`` uses; ``$KERNELCTL_TEST_AOT_CACHE`` overrides it). A cold cache
compiles every kernel for three archs and takes minutes; warm builds take seconds.
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from kernelpack.aot import default_cache_dir
from kernelpack.build import BuildResult, build_bundle
from kernelpack.scaffold import signing_keys, write_source
from kernelpack.signing import KeyPair

REPO = Path(__file__).resolve().parents[2]
BUNDLES = REPO / "kernelpack" / "bundles" / "llm-fused"
FAULTS = ("drift", "slow", "oom", "crash")
SHIPPED = ("1.0.0", "1.1.0", *(f"1.2.0-fault.{f}" for f in FAULTS))

TINY_CONFIGS = {"bias_gelu": {"default": {}, "sm_90": {"BLOCK_M": 2, "BLOCK_N": 64}}}


@dataclass(frozen=True)
class Keys:
    pair: KeyPair
    trusted: Path  # directory holding only the public key


def make_keys(root: Path) -> Keys:
    made = signing_keys(root / "private", trusted=root / "trusted")
    return Keys(made.pair, made.trusted)


def write_tiny_src(root: Path, *, name: str = "tiny", version: str = "0.1.0", marker: bool = False) -> Path:
    """A one-op bundle source (bias_gelu for sm_90); ``marker`` uses a local copy that records its import."""
    root.mkdir(parents=True, exist_ok=True)
    source = "kernelpack.kernels.bias_gelu"
    if marker:
        (root / "kernels").mkdir(exist_ok=True)
        body = (REPO / "kernelpack" / "kernels" / "bias_gelu.py").read_text()
        head = textwrap.dedent(
            """\
            import os as _os

            if _os.environ.get("KPACK_TEST_MARKER"):
                with open(_os.environ["KPACK_TEST_MARKER"], "a") as _f:
                    _f.write("imported\\n")
            """
        )
        future = "from __future__ import annotations\n"
        assert future in body
        (root / "kernels" / "bias_gelu_marker.py").write_text(body.replace(future, future + head, 1))
        source = "kernels/bias_gelu_marker.py"
    return write_source(root, name, version, kernels={"bias_gelu": source}, note="tiny test bundle", triton="3.6.0",
                        prefill_tokens=[2048], configs=TINY_CONFIGS)


@pytest.fixture(scope="session")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    return make_keys(tmp_path_factory.mktemp("keys"))


@pytest.fixture(scope="session")
def other_keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    return make_keys(tmp_path_factory.mktemp("other-keys"))


@pytest.fixture(scope="session")
def aot_cache() -> Path:
    env = os.environ.get("KERNELCTL_TEST_AOT_CACHE")
    return Path(env) if env else default_cache_dir()


@pytest.fixture(scope="session")
def tiny_bundle(tmp_path_factory: pytest.TempPathFactory, keys: Keys, aot_cache: Path) -> BuildResult:
    root = tmp_path_factory.mktemp("tiny")
    src = write_tiny_src(root / "src")
    return build_bundle(src, root / "tiny.kpack", keys.pair.private_path, cache_dir=aot_cache)


@pytest.fixture(scope="session")
def shipped(tmp_path_factory: pytest.TempPathFactory, keys: Keys, aot_cache: Path) -> Callable[[str], BuildResult]:
    """``shipped("1.1.0")`` builds (once per session) a bundle from kernelpack/bundles/llm-fused."""
    out = tmp_path_factory.mktemp("shipped")
    built: dict[str, BuildResult] = {}

    def get(version: str) -> BuildResult:
        if version not in built:
            built[version] = build_bundle(BUNDLES / version, out / f"llm-fused-{version}.kpack",
                                          keys.pair.private_path, cache_dir=aot_cache)
        return built[version]

    return get
