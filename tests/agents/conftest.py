"""Agent test fixtures: real bundles built once per session, real agent processes (``kernelctl agent``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.agents.bundles import BuiltBundles, build_test_bundles

VERSIONS = ("1.0.0", "1.1.0", "1.2.0-fault.drift", "1.2.0-fault.oom", "1.2.0-fault.crash")


@pytest.fixture(scope="session")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> BuiltBundles:
    """llm-fused stable, tuned and fault versions (trimmed), built and signed with a fresh key.

    The AOT compile cache is the user's default (content-addressed, shared by every kernelctl build), so
    only the first session on a machine pays for compilation.
    """
    return build_test_bundles(tmp_path_factory.mktemp("bundles"), VERSIONS)


@pytest.fixture
def sm90_overrides(tmp_path: Path) -> Path:
    """Inventory overrides posing this CPU machine as an H100 node (sm_90, driver 550, CUDA 12.4)."""
    p = tmp_path / "inventory.json"
    p.write_text('{"arch": "sm_90", "driver_version": "550.54.15", "cuda_version": "12.4"}')
    return p
