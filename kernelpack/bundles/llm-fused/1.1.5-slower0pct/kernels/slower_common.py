"""llm-fused 1.1.5-slower0pct: 1.1.5-slower1pct with no wait (``SLOW_PERCENT = 0``): the baseline it is 1% slower than.

The same wrapper kernels as 1.1.5-slower1pct's, compiled to the same code (the wait is a run-time argument,
here 0 cycles), so a fleet that makes this bundle stable judges 1.1.5-slower1pct on its wait alone. What follows
is 1.1.5-slower1pct's description.

Not a fault: a candidate slightly slower everywhere (issue 25: "a 1%-slower-everywhere one promoted", inside
the 2% margin), numerically identical to stable. :func:`slowed` takes a stable op module (bundled as
``stable_<op>``) and makes each Triton kernel defined there launch as a wrapper kernel, generated from the
kernel's own signature, that runs the stable kernel's body unchanged (called as a device function: the same
program ids, grid and launch count) and then, in every program, spins a number of SM cycles given as a kernel
argument. That number is calibrated on the GPU once per argument key (shapes, strides, dtypes, scalars), at
the key's :data:`CALIBRATE_AT`-th launch (earlier ones wait nothing: the trial's numeric checks launch most
shapes once or twice, and the timed phases warm each shape up first), so that the *launch* takes 1% longer
than the same wrapper waiting 0 cycles. A probe wait (10% of the no-wait time, in cycles at the SM clock
measured on the same device, :func:`cycles_per_ns`) gives a first wait by linear scaling; the wait is then
corrected on what it measures (up to :data:`CALIBRATION_ROUNDS` times, by at most a factor 2 each), because spinning programs overlap
with other programs' memory traffic, so the added time is not linear in the wait. Each timing is CUDA events
around :data:`CALIBRATION_CALLS` launches back to back, enqueued while a sleep kernel holds the stream, on
the launch's own arguments, which are put back from host copies afterwards (so in-place kernels change
nothing, and the device allocates nothing the trial's memory measurement would see).

An earlier form waited in the launch's last program only, 1% of the stable kernel's time: on an H200 (run AH,
docs/gpu.md) it measured 1.000 against 1.1.5-slower0pct in the median cell and flash_attn@8192 1.000 (a 1.2 ms
launch): where a launch has several waves, its last program is not the last to finish (causal attention runs
its heaviest blocks first), so its wait hid behind the others.

Why this shape (docs/gpu.md, runs V-AG on an H200): every earlier way of making a launch 1% longer changed
some cells by 4-16% either way against 1.1.1: 1% more bytes read (1.1.2), every program waiting 1% of its own
time (1.1.3), the last program waiting 1% of the launch's time read from a start word in memory (1.1.4). With
the wait set to 0, this wrapper still measured bias_gelu@32 +8% and softmax_causal@8192 -15% against 1.1.1
(run AE): code added to a kernel changes how the body compiles, whatever it waits. So the wait here is one
PTX loop the compiler sees as a single instruction (:func:`spin`), no branch and nothing live across the body,
and the fixture's baseline is **1.1.5-slower0pct**: the same wrapper kernels, compiled to the same code, with a
wait of 0. Against it, this bundle differs by its wait alone. Under the Triton interpreter (no GPU clock) the
wrapper only runs the stable body: same bits, same launches, no slowdown. The wrapper is compiled where it runs
(no AOT). Under CUDA graph capture an argument key not calibrated yet waits nothing (capture cannot
synchronise); every harness warms up before it captures.
"""

from __future__ import annotations

import dataclasses
import inspect
import linecache
import os
import threading
from types import ModuleType
from typing import Any

import torch
import triton
import triton.language as tl

SLOW_PERCENT = 0
"""How much longer each launch runs, in percent of the same wrapper's launch with no wait."""
PROBE_PERCENT = 10
"""The calibration's probe wait, in percent of the no-wait launch time (one wave's worth)."""
CALIBRATION_CALLS = 50
"""Launches of the wrapper timed back to back per timing."""
CALIBRATION_ROUNDS = 3
"""Corrections of the wait on what it measured, at most."""
CALIBRATE_AT = 3
"""The launch of an argument key at which its wait is calibrated (the ones before it wait nothing)."""
HOLD_CYCLES = 20_000_000
"""SM cycles the calibration's sleep kernel holds the stream while its launches are enqueued (~10 ms: 50 Triton
launches take 1-2 ms to enqueue; a shorter hold timed the host, run AJ)."""
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




@triton.jit(do_not_specialize=["cycles"])
def _spin_kernel(cycles):
    spin(cycles)


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _wrapper_source(kernel: Any, name: str, *, timed: bool) -> str:
    params = inspect.signature(kernel.fn).parameters.values()  # compiled and interpreted kernels alike
    sig = ", ".join(f"{p.name}: tl.constexpr" if "constexpr" in str(p.annotation) else p.name for p in params)
    call = ", ".join(f"{p.name}={p.name}" for p in params)
    if not timed:
        return f"def {name}({sig}):\n    _stable_kernel({call})\n"
    return (f"def {name}({sig}, _slow_cycles):\n"
            f"    _stable_kernel({call})\n"
            f"    spin(_slow_cycles)\n")


def _make_wrapper(kernel: Any, *, timed: bool) -> Any:
    name = f"{kernel.fn.__name__}_slower1pct"
    src = _wrapper_source(kernel, name, timed=timed)
    filename = f"<llm-fused-1.1.5-slower wrapper:{name}>"  # the same in both bundles: the same code
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)  # Triton reads the source
    scope: dict[str, Any] = {"tl": tl, "spin": spin, "_stable_kernel": kernel}
    exec(compile(src, filename, "exec"), scope)
    return triton.jit(scope[name], do_not_specialize=["_slow_cycles"] if timed else ())


_LOCK = threading.Lock()
_WAITS: dict[tuple, int] = {}
_SEEN: dict[tuple, int] = {}
_RATES: dict[torch.device, float] = {}


def _elapsed_ms(launch: Any, calls: int) -> float:
    """Milliseconds of one ``launch()`` on the current stream, back to back as the trial times calls: the stream
    is held by a sleep kernel while the launches are enqueued, so the host's launch time is not counted."""
    launch()  # warm-up (compiles on the first call)
    torch.cuda.current_stream().synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(HOLD_CYCLES)
    start.record()
    for _ in range(calls):
        launch()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def cycles_per_ns(device: torch.device) -> float:
    """The SM clock of ``device`` under a spin, measured: a known number of cycles timed with CUDA events."""
    with _LOCK:
        if device not in _RATES:
            n = 2_000_000
            ms = _elapsed_ms(lambda: _spin_kernel[(1,)](n), 5)
            _RATES[device] = n / (ms * 1e6)
        return _RATES[device]


def _key(name: str, grid: Any, args: tuple, kwargs: dict) -> tuple:
    def one(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return ("T", tuple(a.shape), a.stride(), a.dtype, a.device)
        return ("S", repr(a))
    return (name, None if callable(grid) else repr(grid), tuple(one(a) for a in args),
            tuple((k, one(v)) for k, v in sorted(kwargs.items())))


def calibrated_wait(name: str, wrapper: Any, grid: Any, args: tuple, kwargs: dict) -> int:
    """SM cycles each program of ``wrapper`` (the wrapper's launcher for ``grid``) waits so that its launch with
    these arguments takes ``SLOW_PERCENT`` % longer than with no wait (0 at 0 %, before the key's
    :data:`CALIBRATE_AT`-th launch, and while a CUDA graph is being captured and the key was never calibrated)."""
    if SLOW_PERCENT == 0:
        return 0
    key = _key(name, grid, args, kwargs)
    if key in _WAITS:
        return _WAITS[key]
    with _LOCK:
        _SEEN[key] = seen = _SEEN.get(key, 0) + 1
    if seen < CALIBRATE_AT or torch.cuda.is_current_stream_capturing():
        return 0
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    rate = cycles_per_ns(tensors[0].device)
    # The calibration launches on the real arguments and puts them back from host copies afterwards: copies on
    # the device would show in the trial's peak-memory measurement of the launch (run AJ: 4x at 1 token).
    saved = [(t, t.to("cpu", copy=True)) for t in tensors]

    def added(cycles: int) -> float:
        """Launch time with ``cycles`` over the time with none, as a fraction of the latter."""
        return _elapsed_ms(lambda: wrapper(*args, _slow_cycles=cycles, **kwargs), CALIBRATION_CALLS) / base - 1.0

    try:
        base = _elapsed_ms(lambda: wrapper(*args, _slow_cycles=0, **kwargs), CALIBRATION_CALLS)
        target = SLOW_PERCENT / 100
        probe = max(1, round(base * 1e6 * rate * PROBE_PERCENT / 100))
        slope = added(probe) / probe  # fraction of the launch per waited cycle (waves / clock / base)
        wait = round(target / slope) if slope > 0 else round(probe * target * 100 / PROBE_PERCENT)
        for _ in range(CALIBRATION_ROUNDS):
            got = added(wait)
            if abs(got - target) <= 0.1 * target:
                break
            wait = max(1, round(wait * min(2.0, max(0.5, target / got)))) if got > 0 else wait * 2
    finally:
        torch.cuda.current_stream().synchronize()
        for t, host in saved:
            t.copy_(host)
    with _LOCK:
        _WAITS[key] = wait
    return wait


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
                cycles = calibrated_wait(self.fn.__name__, wrapper[grid], grid, args, kwargs)
                return wrapper[grid](*args, _slow_cycles=cycles, **kwargs)

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
