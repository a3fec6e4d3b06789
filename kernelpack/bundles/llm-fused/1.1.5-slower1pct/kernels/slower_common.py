"""llm-fused 1.1.5-slower1pct: every op is the stable op, each of whose kernel launches takes about 1% longer on a GPU.

Not a fault: a candidate slightly slower everywhere (issue 25: "a 1%-slower-everywhere one promoted", inside
the 2% margin), numerically identical to stable. :func:`slowed` takes a stable op module (bundled as
``stable_<op>``) and makes each Triton kernel defined there launch as a wrapper kernel, generated from the
kernel's own signature, that reads the SM's cycle counter, runs the stable kernel's body unchanged (called as
a device function: the same program ids, grid and launch count), and then spins a fraction of the cycles the
body took in that program: :data:`SLOW_PERCENT` %, passed as a run-time argument. Every program is 1% longer,
so a launch of one wave (or of waves that run back to back) is too; where programs of one SM overlap their
memory traffic, the spin partly hides behind another program's loads and the launch is a little less than 1%
longer (``scripts/gpu-cells --pairs 1.1.5-slower1pct:1.1.5-slower0pct`` measures each cell). Nothing happens
on the host: no calibration launches, copies or synchronisation that a trial's launch count, peak memory or
phase time would see.

Earlier forms of this bundle (docs/gpu.md, runs AH-AK on an H200): the launch's last program waiting 1% of the
stable kernel's time measured 1.000 in the median cell (where a launch has several waves its last program is
not the last to finish); a wait calibrated on the host per argument key measured 1.008 in the median cell but
+4-8% in some 1-token cells, and its calibration showed in the trial's peak memory (device clones) and launch
counts (the calibration's own launches): the judge rolled it back on those gates, as it should.

Why a twin baseline (docs/gpu.md, runs V-AG): every way of making a launch 1% longer changed some cells by
4-16% either way against 1.1.1, because code added to a kernel changes how the body compiles, whatever it
waits (run AE). So the wait here is one PTX loop the compiler sees as a single instruction (:func:`spin`),
and the fixture's baseline is **1.1.5-slower0pct**: the same wrapper kernels, compiled to the same code, with
a fraction of 0. Against it, this bundle differs by its wait alone. Under the Triton interpreter (no GPU
clock) the wrapper only runs the stable body: same bits, same launches, no slowdown. The wrapper is compiled
where it runs (no AOT).
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
"""How much longer each program runs, in percent of the cycles its stable body took."""
WRAPPED: list[str] = []
"""Names of the kernels launched through a wrapper so far (tests read it)."""


@triton.jit
def _cycles():
    """This SM's cycle counter (``%clock64``)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False,
                                     pack=1)


@triton.jit
def spin(cycles):
    """Wait ``cycles`` SM cycles: the loop is written in PTX, so the compiler sees one instruction and compiles
    the kernel around it as it compiles the stable kernel (a loop in Triton changed the body's code and its time
    in some cells, docs/gpu.md runs AE-AF)."""
    tl.inline_asm_elementwise(
        "{ .reg .u64 end, now; .reg .pred p; mov.u64 end, %clock64; add.u64 end, end, $1; "
        "SPIN: mov.u64 now, %clock64; setp.lt.u64 p, now, end; @p bra SPIN; mov.u32 $0, 0; }",
        "=r,l", [cycles.to(tl.int64)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def spin_share(start, fraction):
    """Spin ``fraction`` of the cycles since ``start`` (this program's cycle counter before the stable body)."""
    spin(((_cycles() - start).to(tl.float32) * fraction).to(tl.int64))


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _wrapper_source(kernel: Any, name: str, *, timed: bool) -> str:
    params = inspect.signature(kernel.fn).parameters.values()  # compiled and interpreted kernels alike
    sig = ", ".join(f"{p.name}: tl.constexpr" if "constexpr" in str(p.annotation) else p.name for p in params)
    call = ", ".join(f"{p.name}={p.name}" for p in params)
    if not timed:
        return f"def {name}({sig}):\n    _stable_kernel({call})\n"
    return (f"def {name}({sig}, _slow_fraction):\n"
            f"    _slow_start = _cycles()\n"
            f"    _stable_kernel({call})\n"
            f"    spin_share(_slow_start, _slow_fraction)\n")


def _make_wrapper(kernel: Any, *, timed: bool) -> Any:
    name = f"{kernel.fn.__name__}_slower1pct"
    src = _wrapper_source(kernel, name, timed=timed)
    filename = f"<llm-fused-1.1.5-slower wrapper:{name}>"  # the same in both bundles: the same code
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)  # Triton reads the source
    scope: dict[str, Any] = {"tl": tl, "_cycles": _cycles, "spin_share": spin_share, "_stable_kernel": kernel}
    exec(compile(src, filename, "exec"), scope)
    return triton.jit(scope[name], do_not_specialize=["_slow_fraction"] if timed else ())


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
                if not timed:
                    return wrapper[grid](*args, **kwargs)
                return wrapper[grid](*args, _slow_fraction=SLOW_PERCENT / 100, **kwargs)

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
