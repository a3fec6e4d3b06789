"""What this node is: GPU name, compute capability, arch, driver, CUDA, Triton, torch and memory.

Read from torch and NVML (``pynvml``). Without a GPU the node is arch ``cpu`` and kernels run through Triton's
interpreter. A JSON overrides file can replace any inventory field so one machine can pose as a heterogeneous
fleet (e.g. ``{"arch": "sm_90", "compute_capability": "9.0", "driver_version": "550.54.15"}``); an overridden
arch is also handed to the trial child as ``KERNELCTL_ARCH`` so the loader picks that arch's launch config.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kernelctl.vocab import stratum_key
from kernelctl.wire import Inventory

log = logging.getLogger("kernelctl.agent.inventory")

ARCH_ENV = "KERNELCTL_ARCH"  # same name kernelpack.loader reads


class InventoryError(ValueError):
    """The overrides file is unreadable or sets a field to an invalid value."""


@dataclass(frozen=True)
class NodeInventory:
    """The wire inventory plus what the agent itself needs to know about the hardware."""

    inventory: Inventory
    has_gpu: bool
    overridden: frozenset[str] = field(default_factory=frozenset)

    @property
    def arch(self) -> str:
        return self.inventory.arch

    def trial_env(self) -> dict[str, str]:
        """Environment additions for the trial child process."""
        env: dict[str, str] = {}
        if not self.has_gpu:
            env["TRITON_INTERPRET"] = "1"
        if self.inventory.arch != "cpu" and (not self.has_gpu or "arch" in self.overridden):
            env[ARCH_ENV] = self.inventory.arch
        return env

    @property
    def device(self) -> str:
        return "cuda" if self.has_gpu else "cpu"


def _versions() -> tuple[str, str]:
    import torch
    import triton

    return torch.__version__, triton.__version__


def _nvml_info() -> dict[str, Any]:
    """Driver, GPU name and memory from NVML; empty when NVML is unavailable."""
    try:
        import pynvml
    except ImportError:
        return {}
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        log.debug("NVML unavailable: %s", exc)
        return {}
    try:
        out: dict[str, Any] = {}
        drv = pynvml.nvmlSystemGetDriverVersion()
        out["driver_version"] = drv.decode() if isinstance(drv, bytes) else str(drv)
        if pynvml.nvmlDeviceGetCount() > 0:
            h = pynvml.nvmlDeviceGetHandleByIndex(0)
            name = pynvml.nvmlDeviceGetName(h)
            out["gpu_name"] = name.decode() if isinstance(name, bytes) else str(name)
            out["memory_total_mb"] = int(pynvml.nvmlDeviceGetMemoryInfo(h).total // (1024 * 1024))
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
            out["compute_capability"] = f"{major}.{minor}"
            out["arch"] = f"sm_{major}{minor}"
        return out
    except Exception as exc:
        log.warning("NVML query failed: %s", exc)
        return {}
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def _cpu_memory_mb() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) // 1024
    except OSError:
        pass
    return 0


def detect_inventory() -> tuple[dict[str, Any], bool]:
    """Inventory fields of this machine as read from torch/NVML, and whether a CUDA GPU is usable."""
    import torch

    torch_v, triton_v = _versions()
    if torch.cuda.is_available():
        nvml = _nvml_info()  # preferred: reading it creates no CUDA context in the agent
        fields: dict[str, Any] = {"driver_version": "unknown", "cuda_version": torch.version.cuda or "unknown"}
        if "arch" not in nvml:
            major, minor = torch.cuda.get_device_capability(0)
            props = torch.cuda.get_device_properties(0)
            fields.update({"gpu_name": props.name, "compute_capability": f"{major}.{minor}",
                           "arch": f"sm_{major}{minor}", "memory_total_mb": int(props.total_memory // (1024 * 1024))})
        fields.update(nvml)
        has_gpu = True
    else:
        fields = {
            "gpu_name": "cpu (Triton interpreter)",
            "compute_capability": "cpu",
            "arch": "cpu",
            "driver_version": "0",
            "cuda_version": "none",
            "memory_total_mb": _cpu_memory_mb(),
        }
        has_gpu = False
    fields["triton_version"] = triton_v
    fields["torch_version"] = torch_v
    fields["labels"] = {}
    return fields, has_gpu


def load_overrides(path: Path) -> dict[str, Any]:
    """Read and check an overrides JSON object: only Inventory field names are allowed."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InventoryError(f"inventory overrides file {path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InventoryError(f"inventory overrides file {path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InventoryError(f"inventory overrides file {path} must hold a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(Inventory.model_fields))
    if unknown:
        raise InventoryError(
            f"inventory overrides file {path}: unknown field(s) {unknown}; allowed: {sorted(Inventory.model_fields)}"
        )
    return data


def collect_inventory(overrides_path: Path | None = None) -> NodeInventory:
    """Detect the inventory and apply the overrides file (if any); refuses invalid values with the field."""
    fields, has_gpu = detect_inventory()
    overrides = load_overrides(overrides_path) if overrides_path is not None else {}
    merged = {**fields, **overrides}
    if "arch" in overrides and "compute_capability" not in overrides and overrides["arch"] != "cpu":
        digits = str(overrides["arch"]).removeprefix("sm_").rstrip("a")
        if digits.isdigit() and len(digits) >= 2:
            merged["compute_capability"] = f"{digits[:-1]}.{digits[-1]}"
    try:
        inv = Inventory.model_validate(merged)
    except ValidationError as exc:
        errs = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        where = f" (overrides file {overrides_path})" if overrides_path else ""
        raise InventoryError(f"invalid inventory{where}: {errs}") from None
    return NodeInventory(inv, has_gpu, frozenset(overrides))


def memory_free_fraction(has_gpu: bool) -> float | None:
    """Share of (GPU, or on CPU nodes system) memory free right now; None when it cannot be read."""
    if has_gpu:  # NVML, not torch: the agent must not create a CUDA context of its own
        try:
            import pynvml

            pynvml.nvmlInit()
            try:
                info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0))
                return info.free / info.total if info.total else None
            finally:
                pynvml.nvmlShutdown()
        except Exception:
            return None
    try:
        info: dict[str, int] = {}
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                info[k] = int(v.split()[0])
        return info["MemAvailable"] / info["MemTotal"]
    except (OSError, KeyError, ValueError, ZeroDivisionError):
        return None


def stratum_of(inv: Inventory) -> str:
    """``{arch}/drv{driver_major}/triton{triton_version}`` (how the controller groups nodes)."""
    return stratum_key(inv.arch, inv.driver_version, inv.triton_version)


def child_env(node: NodeInventory) -> dict[str, str]:
    """Full environment for the trial child: the agent's own plus :meth:`NodeInventory.trial_env`."""
    env = dict(os.environ)
    env.update(node.trial_env())
    return env
