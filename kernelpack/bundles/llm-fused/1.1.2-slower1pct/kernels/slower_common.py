"""llm-fused 1.1.2-slower1pct: every op is the stable op whose kernels also read about 1% more bytes.

Not a fault: a candidate slightly slower everywhere (issue 25: "a 1%-slower-everywhere one promoted", inside
the 2% margin), numerically identical to stable. :func:`slowed` takes a stable op module (bundled as
``stable_<op>``) and makes each Triton kernel defined there launch as a wrapper kernel, generated from the
kernel's own signature, that runs the stable kernel's body unchanged (called as a device function: the same
program ids, grid and launch count) and then reads ``EXTRA_N`` elements (1% of the kernel's largest tensor
argument) of that tensor with volatile loads, spread over the grid's programs. The outputs are the stable
kernel's, bit for bit; the extra work is one more memory read of 1% of the bytes on a GPU (at decode sizes,
where a call is latency-bound, it costs next to nothing). The wrapper is compiled where it runs (no AOT).
"""

from __future__ import annotations

import dataclasses
import inspect
import linecache
import math
from types import ModuleType
from typing import Any

import torch
import triton
import triton.language as tl

EXTRA_SHARE = 0.01
"""Extra elements read per launch, as a share of the kernel's largest tensor argument."""
MAX_PER_PROGRAM = 4096
WRAPPED: list[str] = []
"""Names of the kernels launched through a wrapper so far (tests read it)."""


@triton.jit
def extra_read(ptr, n_extra, PER: tl.constexpr):
    """Programs read consecutive ``PER``-element slices of ``ptr[:n_extra]`` (volatile: the loads stay)."""
    pid = tl.program_id(0) + tl.num_programs(0) * (tl.program_id(1) + tl.num_programs(1) * tl.program_id(2))
    offs = pid.to(tl.int64) * PER + tl.arange(0, PER)
    tl.load(ptr + offs, mask=offs < n_extra, other=0, volatile=True)


def _wrapper_source(kernel: Any, name: str) -> str:
    params = inspect.signature(kernel.fn).parameters.values()  # compiled and interpreted kernels alike
    sig = ", ".join(f"{p.name}: tl.constexpr" if "constexpr" in str(p.annotation) else p.name for p in params)
    call = ", ".join(f"{p.name}={p.name}" for p in params)
    return (f"def {name}({sig}, EXTRA_PTR, EXTRA_N, EXTRA_PER: tl.constexpr):\n"
            f"    _stable_kernel({call})\n"
            f"    extra_read(EXTRA_PTR, EXTRA_N, EXTRA_PER)\n")


def _make_wrapper(kernel: Any) -> Any:
    name = f"{kernel.fn.__name__}_slower1pct"
    src = _wrapper_source(kernel, name)
    filename = f"<llm-fused-1.1.2-slower1pct:{name}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)  # Triton reads the source
    scope: dict[str, Any] = {"tl": tl, "extra_read": extra_read, "_stable_kernel": kernel}
    exec(compile(src, filename, "exec"), scope)
    return triton.jit(scope[name])


def _grid_size(grid: Any, kwargs: dict[str, Any]) -> int:
    g = grid(kwargs) if callable(grid) else grid
    return int(math.prod(int(x) for x in (g if isinstance(g, (tuple, list)) else (g,))))


def _slow_class(base: type) -> type:
    """A subclass of the kernel's class whose ``kernel[grid](...)`` launches the wrapper instead."""

    class Slowed(base):  # type: ignore[misc, valid-type]
        def __getitem__(self, grid: Any) -> Any:
            wrapper = self.__dict__.get("_slower_wrapper")
            if wrapper is None:
                wrapper = self.__dict__["_slower_wrapper"] = _make_wrapper(self)

            def launch(*args: Any, **kwargs: Any) -> Any:
                tensors = [a for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)]
                big = max(tensors, key=lambda t: t.numel())
                n_extra = max(1, int(big.numel() * EXTRA_SHARE))
                per = min(MAX_PER_PROGRAM, triton.next_power_of_2(max(1, -(-n_extra // _grid_size(grid, kwargs)))))
                WRAPPED.append(self.fn.__name__)
                return wrapper[grid](*args, EXTRA_PTR=big, EXTRA_N=n_extra, EXTRA_PER=per, **kwargs)

            return launch

    Slowed.__name__ = f"Slowed{base.__name__}"
    return Slowed


def slowed(op: Any, *modules: ModuleType) -> Any:
    """``op`` (unchanged object identity of its functions) with every Triton kernel defined in ``modules``
    launching through its 1%-extra-read wrapper; returns a copy of the op tagged in its ``name`` only."""
    for module in modules:
        for value in vars(module).values():
            if isinstance(value, triton.runtime.jit.KernelInterface) and value.fn.__module__ == module.__name__ \
                    and not type(value).__name__.startswith("Slowed"):
                value.__class__ = _slow_class(type(value))
    return dataclasses.replace(op)
