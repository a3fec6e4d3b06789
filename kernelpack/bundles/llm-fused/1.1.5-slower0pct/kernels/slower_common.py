"""llm-fused 1.1.5-slower0pct: 1.1.5-slower1pct with no wait (``SLOW_PERCENT = 0``): the baseline it is 1% slower than.

The same wrapper kernels as 1.1.5-slower1pct's, compiled to the same code (the wait is a run-time fraction,
here 0), so a fleet that makes this bundle stable judges 1.1.5-slower1pct on its wait alone. What follows
is 1.1.5-slower1pct's description.

Not a fault: a candidate slightly slower everywhere (issue 25: "a 1%-slower-everywhere one promoted", inside
the 2% margin), numerically identical to stable. :func:`slowed` takes a stable op module (bundled as
``stable_<op>``) and makes each Triton kernel defined there launch as a wrapper kernel, generated from the
kernel's own signature, that runs the stable kernel's body unchanged (called as a device function: the same
program ids, grid and launch count) and then makes the launch last :data:`SLOW_PERCENT` % longer, on the
GPU's global nanosecond timer: program 0 records when it started, every program counts itself done on a
device counter (one atomic add), and the program that finishes last waits the fraction of the time since that
start, then resets the counter for the next launch. The fraction is a run-time argument; the counter is 16
bytes of device memory per device, allocated once and shared by the two twins of a process (:func:`_state`).
Nothing else happens on the host: no calibration launches, copies or synchronisation that a trial's launch
count, peak memory or phase time would see.

An earlier form of this bundle (run AL, docs/gpu.md) spun 1% of each program's own cycles (``%clock64``): it
measured 1.0026 in the median cell, since where programs of one SM overlap their memory traffic, one program's
spin hides behind another's loads. Only a wait after the last program is a wait of the whole launch.

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
import sys
from types import ModuleType
from typing import Any

import triton
import triton.language as tl

SLOW_PERCENT = 0
"""How much longer each launch runs, in percent of the time from its first program's start to its last one's end."""
WRAPPED: list[str] = []
"""Names of the kernels launched through a wrapper so far (tests read it)."""


@triton.jit
def _now():
    """The GPU's global timer (``%globaltimer``, nanoseconds; the same clock on every SM)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                     pack=1)


@triton.jit
def wait_ns(ns):
    """Wait ``ns`` nanoseconds: the loop is written in PTX, so the compiler sees one instruction and compiles
    the kernel around it as it compiles the stable kernel (a loop in Triton changed the body's code and its time
    in some cells, docs/gpu.md runs AE-AF)."""
    tl.inline_asm_elementwise(
        "{ .reg .u64 end, now; .reg .pred p; mov.u64 end, %globaltimer; add.u64 end, end, $1; "
        "SPIN: mov.u64 now, %globaltimer; setp.lt.u64 p, now, end; @p bra SPIN; mov.u32 $0, 0; }",
        "=r,l", [ns.to(tl.int64)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def mark_start(state):
    """Program 0 records the launch's start in ``state[0]`` (before its body)."""
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0) & (tl.program_id(2) == 0):
        tl.atomic_xchg(state, _now())


@triton.jit
def finish(state, fraction):
    """Count this program done in ``state[1]``; the last one waits ``fraction`` of the time since the start,
    at most 100 ms (a start not yet visible reads 0 and waits nothing), then resets both for the next launch."""
    total = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
    done = tl.atomic_add(state + 1, 1, sem="acq_rel")
    if done == total - 1:
        start = tl.atomic_xchg(state, 0)
        elapsed = tl.where(start > 0, _now() - start, 0)
        wait_ns(tl.minimum(tl.maximum(elapsed, 0), 100_000_000).to(tl.float32) * fraction)
        tl.atomic_xchg(state + 1, 0)


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _wrapper_source(kernel: Any, name: str, *, timed: bool) -> str:
    params = inspect.signature(kernel.fn).parameters.values()  # compiled and interpreted kernels alike
    sig = ", ".join(f"{p.name}: tl.constexpr" if "constexpr" in str(p.annotation) else p.name for p in params)
    call = ", ".join(f"{p.name}={p.name}" for p in params)
    if not timed:
        return f"def {name}({sig}):\n    _stable_kernel({call})\n"
    return (f"def {name}({sig}, _slow_state, _slow_fraction):\n"
            f"    mark_start(_slow_state)\n"
            f"    _stable_kernel({call})\n"
            f"    finish(_slow_state, _slow_fraction)\n")


def _make_wrapper(kernel: Any, *, timed: bool) -> Any:
    name = f"{kernel.fn.__name__}_slower1pct"
    src = _wrapper_source(kernel, name, timed=timed)
    filename = f"<llm-fused-1.1.5-slower wrapper:{name}>"  # the same in both bundles: the same code
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)  # Triton reads the source
    scope: dict[str, Any] = {"tl": tl, "mark_start": mark_start, "finish": finish, "_stable_kernel": kernel}
    exec(compile(src, filename, "exec"), scope)
    return triton.jit(scope[name], do_not_specialize=["_slow_fraction"] if timed else ())


def _state() -> Any:
    """The launch counter of the current CUDA device: int64 [start ns, programs done], zero between launches.

    One per device for both twins of a process (kept in a module of their own in ``sys.modules``): with a
    counter each, the two counters' places in device memory differed from process to process, and 1-token
    launches, which pay the counter's atomics, measured 2.6-2.8% apart from trial to trial either way (runs
    AM, AN; 0.33% without a counter, run AL). Launches on one stream never overlap, so they can share it."""
    import torch

    home = sys.modules.setdefault("_llm_fused_slower_state", ModuleType("_llm_fused_slower_state"))
    states: dict[int, Any] = home.__dict__.setdefault("states", {})
    device = torch.cuda.current_device()
    if device not in states:
        states[device] = torch.zeros(2, dtype=torch.int64, device=f"cuda:{device}")
    return states[device]


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
                return wrapper[grid](*args, _slow_state=_state(), _slow_fraction=SLOW_PERCENT / 100, **kwargs)

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
