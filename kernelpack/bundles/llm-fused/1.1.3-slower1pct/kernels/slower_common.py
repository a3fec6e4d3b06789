"""llm-fused 1.1.3-slower1pct: every op is the stable op whose kernel programs each take 1% longer on a GPU.

Not a fault: a candidate slightly slower everywhere (issue 25: "a 1%-slower-everywhere one promoted", inside
the 2% margin), numerically identical to stable. 1.1.2-slower1pct made its kernels read 1% more bytes, which
is 1% of the time only where a kernel is bound by memory bandwidth. This version slows in *time*:
:func:`slowed` takes a stable op module (bundled as ``stable_<op>``) and makes each Triton kernel defined there
launch as a wrapper kernel, generated from the kernel's own signature, that reads the GPU's global timer, runs
the stable kernel's body unchanged (called as a device function: the same program ids, grid and launch count),
reads the timer again and spins until 1% of the time its program took has passed again. Every program is 1%
longer, so a call is at most 1% longer (less where the launch's fixed cost dominates). Under the Triton
interpreter (no GPU timer) the wrapper only runs the stable body: same bits, same launches, no slowdown. The
wrapper is compiled where it runs (no AOT).
"""

from __future__ import annotations

import dataclasses
import inspect
import linecache
import os
from types import ModuleType
from typing import Any

import triton
import triton.language as tl

SLOW_PERCENT = 1
"""How much longer each program runs, in percent of its own time."""
WRAPPED: list[str] = []
"""Names of the kernels launched through a wrapper so far (tests read it)."""


@triton.jit
def _now():
    """The GPU's global nanosecond timer (``%globaltimer``)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                     pack=1)


@triton.jit
def spin_after(t0, PERCENT: tl.constexpr):
    """Wait until ``PERCENT`` % of the time since ``t0`` has passed once more."""
    t1 = _now()
    end = t1 + (t1 - t0) * PERCENT // 100
    t = t1
    while t < end:
        t = _now()


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _wrapper_source(kernel: Any, name: str, *, timed: bool) -> str:
    params = inspect.signature(kernel.fn).parameters.values()  # compiled and interpreted kernels alike
    sig = ", ".join(f"{p.name}: tl.constexpr" if "constexpr" in str(p.annotation) else p.name for p in params)
    call = ", ".join(f"{p.name}={p.name}" for p in params)
    if not timed:
        return f"def {name}({sig}):\n    _stable_kernel({call})\n"
    return (f"def {name}({sig}, SLOW_PERCENT: tl.constexpr):\n"
            f"    _t0 = _now()\n"
            f"    _stable_kernel({call})\n"
            f"    spin_after(_t0, SLOW_PERCENT)\n")


def _make_wrapper(kernel: Any, *, timed: bool) -> Any:
    name = f"{kernel.fn.__name__}_slower1pct"
    src = _wrapper_source(kernel, name, timed=timed)
    filename = f"<llm-fused-1.1.3-slower1pct:{name}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)  # Triton reads the source
    scope: dict[str, Any] = {"tl": tl, "_now": _now, "spin_after": spin_after, "_stable_kernel": kernel}
    exec(compile(src, filename, "exec"), scope)
    return triton.jit(scope[name])


def _slow_class(base: type) -> type:
    """A subclass of the kernel's class whose ``kernel[grid](...)`` launches the wrapper instead."""

    class Slowed(base):  # type: ignore[misc, valid-type]
        def __getitem__(self, grid: Any) -> Any:
            timed = not interpreted()
            key = f"_slower_wrapper_{'timed' if timed else 'interpreted'}"
            wrapper = self.__dict__.get(key)
            if wrapper is None:
                wrapper = self.__dict__[key] = _make_wrapper(self, timed=timed)

            def launch(*args: Any, **kwargs: Any) -> Any:
                WRAPPED.append(self.fn.__name__)
                extra = {"SLOW_PERCENT": SLOW_PERCENT} if timed else {}
                return wrapper[grid](*args, **extra, **kwargs)

            return launch

    Slowed.__name__ = f"Slowed{base.__name__}"
    return Slowed


def slowed(op: Any, *modules: ModuleType) -> Any:
    """``op`` (unchanged object identity of its functions) with every Triton kernel defined in ``modules``
    launching through its wrapper; returns a copy of the op tagged in its ``name`` only."""
    for module in modules:
        for value in vars(module).values():
            if isinstance(value, triton.runtime.jit.KernelInterface) and value.fn.__module__ == module.__name__ \
                    and not type(value).__name__.startswith("Slowed"):
                value.__class__ = _slow_class(type(value))
    return dataclasses.replace(op)

