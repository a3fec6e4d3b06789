"""Inventory detection and overrides (one CPU machine posing as a heterogeneous fleet)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import triton

from agents.inventory import InventoryError, collect_inventory, stratum_of


def test_detects_this_machine() -> None:
    node = collect_inventory()
    inv = node.inventory
    assert inv.triton_version == triton.__version__
    assert inv.torch_version == torch.__version__
    if not torch.cuda.is_available():
        assert (inv.arch, inv.compute_capability, node.has_gpu) == ("cpu", "cpu", False)
        assert node.trial_env() == {"TRITON_INTERPRET": "1"}
        assert inv.memory_total_mb > 0


@pytest.mark.parametrize(("arch", "driver", "cc"), [("sm_80", "535.104.05", "8.0"), ("sm_90", "550.54.15", "9.0")])
def test_overrides_pose_as_gpu(tmp_path: Path, arch: str, driver: str, cc: str) -> None:
    p = tmp_path / "o.json"
    p.write_text(json.dumps({"arch": arch, "driver_version": driver, "labels": {"rack": "r1"}}))
    node = collect_inventory(p)
    assert node.inventory.arch == arch
    assert node.inventory.compute_capability == cc  # derived from the arch
    assert node.inventory.labels == {"rack": "r1"}
    assert stratum_of(node.inventory) == f"{arch}/drv{driver.split('.')[0]}/triton{triton.__version__}"
    if not torch.cuda.is_available():
        assert node.trial_env() == {"TRITON_INTERPRET": "1", "KERNELCTL_ARCH": arch}


def test_unknown_field_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "o.json"
    p.write_text(json.dumps({"arch": "sm_90", "gpu_count": 8}))
    with pytest.raises(InventoryError, match=r"unknown field\(s\) \['gpu_count'\]"):
        collect_inventory(p)


def test_invalid_value_names_the_field(tmp_path: Path) -> None:
    p = tmp_path / "o.json"
    p.write_text(json.dumps({"arch": "hopper"}))
    with pytest.raises(InventoryError, match="arch"):
        collect_inventory(p)


@pytest.mark.parametrize("content", ["{not json", "[1, 2]"])
def test_malformed_file(tmp_path: Path, content: str) -> None:
    p = tmp_path / "o.json"
    p.write_text(content)
    with pytest.raises(InventoryError, match=str(p)):
        collect_inventory(p)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(InventoryError, match="does not exist"):
        collect_inventory(tmp_path / "nope.json")
