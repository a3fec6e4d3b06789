"""Latency, launch count and memory of kernel versions, measured the way the judge needs them.

* ``median_time``: CUDA uses ``triton.testing.do_bench`` (CUDA events, L2 flushed, median); CPU (Triton
  interpreter) uses the median of ``time.perf_counter`` around repeated calls after a warm-up call.
* ``interleaved_calls`` / ``paired_calls`` (what the trial's latency phase uses, issue 25): after a warm-up,
  individual calls of both versions timed in ABBA quads (so contention hits both), grouped into fixed windows;
  per arm :class:`ArmTimes` (every call's time and the per-window means) and :func:`arm_summary` (n, mean,
  p50, p99, window means) for the judge. CUDA: the stream is held by a ``torch.cuda._sleep`` while a window
  is enqueued, so the CUDA events around each call measure the kernel, not the host's launch gap. A window
  whose sleep ended before its last call was enqueued (the device ran dry: host time leaked into the events)
  is dropped and the sleep doubled (``SLEEP_CYCLES`` per call to start; run T on an H100 measured 5 us
  kernels at p50 50-65 us before this check, and a Python wrapper's extra host time as +14-25%); CPU: the
  ``timer`` around each call (the trial passes ``time.thread_time``: the interpreter's Python work).
  Each quad is ABBA or BAAB at random (and a GPU window's hold jittered), so nothing periodic on the device
  falls on one arm window after window. :func:`drop_contended` removes, from both arms, the windows in which
  *both* arms ran slower than ``CONTENDED`` x their median window (a busy device hits both; a candidate's own
  slowness never gets its windows dropped, and contention that hit one arm only stays, as noise of either
  sign); the count travels with the report.
* ``launches_per_call``: on CUDA, Triton's ``knobs.runtime.launch_enter_hook`` (fires once per real kernel
  launch from the compiled launcher). The interpreter never calls that hook, so under ``TRITON_INTERPRET=1``
  the fallback counts calls of ``triton.runtime.interpreter.GridExecutor.__call__`` (one per grid launch)
  by wrapping it for the duration of the call.
* ``peak_memory_bytes``: CUDA ``max_memory_allocated`` delta. On CPU a best effort: the peak of the running
  sum of torch CPU allocations/frees recorded by ``torch.profiler`` with ``profile_memory=True`` (it sees
  tensors the op allocates, which is what would be device memory on a GPU; not the interpreter's numpy
  scratch, not the Python heap).
"""

from __future__ import annotations

import contextlib
import gc
import math
import random
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import triton

from kernelpack.harness.numerics import (
    HarnessError,
    alloc_poisoned,
    make_generator,
    merged_config,
    resolve_device,
    resolve_dtype,
)
from kernelpack.kernels.spec import KernelOp, Shape


@dataclass
class BenchResult:
    op: str
    dtype: str
    shape: dict[str, int]
    device: str
    median_s: float
    bytes_moved: int
    gbps: float  # achieved bandwidth: bytes_moved / median_s / 1e9
    tflops: float  # achieved compute: op.flops(shape) / median_s / 1e12 (0 when the op declares no flops)
    launches_per_call: int
    launch_overhead_s: float  # host time of one call (CUDA: CPU time to enqueue; CPU: the whole call)
    peak_memory_bytes: int


def _is_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def _sync(device: torch.device) -> None:
    if _is_cuda(device):
        torch.cuda.synchronize(device)


def median_time(
    fn: Callable[[], object],
    *,
    device: str | torch.device,
    warmup_ms: float = 25.0,
    rep_ms: float = 100.0,
    min_reps: int = 5,
    max_reps: int = 1000,
    timer: Callable[[], float] = time.perf_counter,
) -> float:
    """Median wall time of ``fn()`` in seconds (CPU: as read by ``timer``, e.g. ``time.thread_time`` for the
    calling thread's CPU time, which neighbours on a shared machine do not inflate).

    CUDA: ``triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")``.
    CPU: one warm-up call, then repeated calls until ``rep_ms`` has elapsed and at least ``min_reps`` calls
    ran (at most ``max_reps``); the median of their ``perf_counter`` times.
    """
    dev = resolve_device(device)
    if _is_cuda(dev):
        with torch.cuda.device(dev):
            ms = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
        return float(ms) / 1e3
    fn()
    times: list[float] = []
    budget = rep_ms / 1e3
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() - start < budget):
        t0 = timer()
        fn()
        times.append(timer() - t0)
    return statistics.median(times)


@dataclass
class ArmTimes:
    """Every timed call of one version (seconds, measurement order, the same number per window) and its
    per-window means."""

    calls: list[float]
    windows: list[float]


CONTENDED = 1.5
"""A window in which *both* arms' means are over this multiple of their median window means is contended."""


def drop_contended(stable: ArmTimes, candidate: ArmTimes, factor: float = CONTENDED
                   ) -> tuple[ArmTimes, ArmTimes, int]:
    """Both arms without the contended windows (see the module docstring); the count."""
    if len(stable.windows) < 3:
        return stable, candidate, 0
    ls, lc = factor * statistics.median(stable.windows), factor * statistics.median(candidate.windows)
    keep = [w for w, (ts, tc) in enumerate(zip(stable.windows, candidate.windows, strict=True))
            if ts <= ls or tc <= lc]
    if len(keep) == len(stable.windows):
        return stable, candidate, 0

    def pick(arm: ArmTimes) -> ArmTimes:
        per = len(arm.calls) // len(arm.windows)
        return ArmTimes([c for w in keep for c in arm.calls[w * per:(w + 1) * per]], [arm.windows[w] for w in keep])

    return pick(stable), pick(candidate), len(stable.windows) - len(keep)


def quantile(sorted_times: Sequence[float], q: float) -> float:
    """The ``ceil(q n)``-th smallest value (an order statistic: no interpolation past the largest call)."""
    n = len(sorted_times)
    return float(sorted_times[min(n - 1, max(0, math.ceil(q * n) - 1))])


def arm_summary(arm: ArmTimes) -> dict[str, object]:
    """What the report carries per arm: n, mean, p50, p99 (order statistics) and the window means."""
    if not arm.calls:
        raise HarnessError("an arm needs at least one timed call")
    st = sorted(arm.calls)
    return {"n": len(st), "mean_s": max(statistics.fmean(st), 1e-9), "p50_s": max(quantile(st, 0.5), 1e-9),
            "p99_s": max(quantile(st, 0.99), 1e-9), "windows_s": [max(w, 1e-9) for w in arm.windows]}


def interleaved_calls(
    run_a: Callable[[], object],
    run_b: Callable[[], object],
    *,
    device: str | torch.device,
    windows: int,
    quads: int,
    warmup_calls: int = 1,
    timer: Callable[[], float] = time.perf_counter,
    budget_s: float | None = None,
    min_windows: int = 4,
    seed: int = 0,
) -> tuple[ArmTimes, ArmTimes]:
    """Individual calls of A and B, timed in ``windows`` windows of ``quads`` ABBA quads (2 * quads calls per
    arm and window), after ``warmup_calls`` untimed calls of each. See the module docstring for the clocks.
    ``budget_s``: stop after the window that passes this much wall time, once ``min_windows`` are done (a slow
    cell gets fewer calls, never fewer than ``min_windows * 2 * quads`` per arm)."""
    if windows < 1 or quads < 1:
        raise HarnessError(f"windows and quads must be >= 1, got {windows} and {quads}")
    with gc_paused():
        return _interleaved(run_a, run_b, device=device, windows=windows, quads=quads, warmup_calls=warmup_calls,
                            timer=timer, budget_s=budget_s, min_windows=min_windows, seed=seed)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No garbage collection inside timed calls (as timeit): a collection is triggered by the allocation count,
    so it would fall on the same call of the same ABBA position trial after trial, always one arm's. One full
    collection first, then the collector off until the block ends; a block inside another collects nothing
    (the outer one did). The trial's latency phase pauses it once for all its cells: a full collection in an
    agent's trial process (torch, Triton, the bundles: ~200,000 objects) took 0.3-0.7 s on this CPU machine,
    and it ran once per cell (45 cells in gpu-fleet's profile)."""
    if not gc.isenabled():
        yield
        return
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _interleaved(run_a: Callable[[], object], run_b: Callable[[], object], *, device: str | torch.device,
                 windows: int, quads: int, warmup_calls: int, timer: Callable[[], float], budget_s: float | None,
                 min_windows: int, seed: int) -> tuple[ArmTimes, ArmTimes]:
    start = time.perf_counter()
    dev = resolve_device(device)
    for _ in range(max(0, warmup_calls)):
        run_a()
        run_b()
    a, b = ArmTimes([], []), ArmTimes([], [])
    rng = random.Random(seed)
    cycles, doublings = SLEEP_CYCLES, 0
    for _ in range(windows):
        # each quad ABBA or BAAB at random: nothing periodic on the device (a time slice of another process,
        # a clock step) can fall on the same arm window after window
        order = [arm for _q in range(quads) for arm in ((0, 1, 1, 0) if rng.random() < 0.5 else (1, 0, 0, 1))]
        if _is_cuda(dev):
            got = None
            while got is None:
                got = _cuda_window((run_a, run_b), order, dev, rng, cycles,
                                   keep_dry=doublings >= MAX_SLEEP_DOUBLINGS)
                if got is None:  # the host was slower than the sleep: sleep longer, for the rest of the cell too
                    cycles, doublings = 2 * cycles, doublings + 1
            times = got
        else:
            times = []
            for arm in order:
                fn = run_b if arm else run_a
                t0 = timer()
                fn()
                times.append(timer() - t0)
        for arm, acc in ((0, a), (1, b)):
            mine = [t for o, t in zip(order, times, strict=True) if o == arm]
            acc.calls.extend(mine)
            acc.windows.append(statistics.fmean(mine))
        if budget_s is not None and len(a.windows) >= min_windows and time.perf_counter() - start >= budget_s:
            break
    return a, b


SLEEP_CYCLES = 50_000
"""GPU clock cycles of sleep per call that hold the stream while a window is enqueued (~25 us), to start with."""
MAX_SLEEP_DOUBLINGS = 6
"""A window that ran dry doubles the sleep, at most this many times per cell (64x); past it the window counts."""


def _cuda_window(fns: tuple[Callable[[], object], Callable[[], object]], order: Sequence[int],
                 dev: torch.device, rng: random.Random, cycles: int, keep_dry: bool = False) -> list[float] | None:
    """One window on the GPU: the stream held by a sleep kernel (``cycles`` per call, jittered so that windows
    do not lock onto another process's time slices) while every call is enqueued between events. None when the
    sleep was over before the last call was enqueued (unless ``keep_dry``): the device may have run dry, so a
    call's events may hold host time (the caller sleeps longer)."""
    with torch.cuda.device(dev):
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in order]
        slept = torch.cuda.Event()
        torch.cuda._sleep(int(cycles * len(order) * rng.uniform(0.5, 1.5)))
        slept.record()
        for arm, (start, end) in zip(order, ev, strict=True):
            start.record()
            fns[arm]()
            end.record()
        ran_dry = slept.query()
        torch.cuda.synchronize(dev)
        if ran_dry and not keep_dry:
            return None
        return [max(s.elapsed_time(e), 1e-6) / 1e3 for s, e in ev]


def paired_calls(
    stable: tuple[KernelOp, Mapping],
    candidate: tuple[KernelOp, Mapping],
    dtype: str,
    shape: Shape,
    *,
    device: str | torch.device,
    seed: int,
    windows: int,
    quads: int,
    warmup_calls: int = 1,
    timer: Callable[[], float] = time.perf_counter,
    budget_s: float | None = None,
) -> tuple[ArmTimes, ArmTimes]:
    """:func:`interleaved_calls` of one op's stable and candidate versions on the same seeded inputs, writing into
    the same output buffers where both versions allocate the same (shapes and dtypes): a buffer's placement in
    device memory is then common to both arms rather than a per-trial difference between them."""
    s_op, c_op = stable[0], candidate[0]
    if s_op.name != c_op.name:
        raise HarnessError(f"cannot pair different ops: stable {s_op.name!r} vs candidate {c_op.name!r}")
    tdtype = resolve_dtype(dtype)
    dev = resolve_device(device)
    for op in (s_op, c_op):
        op.domain.check(tdtype, shape)
    inputs = s_op.make_inputs(dict(shape), tdtype, dev, make_generator(dev, seed))
    s_outs, c_outs = alloc_poisoned(s_op, inputs), alloc_poisoned(c_op, inputs)
    if [(o.shape, o.dtype) for o in s_outs] == [(o.shape, o.dtype) for o in c_outs]:
        c_outs = s_outs
    return interleaved_calls(call_runner(s_op, stable[1], inputs, s_outs),
                             call_runner(c_op, candidate[1], inputs, c_outs), device=dev, windows=windows,
                             quads=quads, warmup_calls=warmup_calls, timer=timer, budget_s=budget_s, seed=seed)


def call_runner(op: KernelOp, config: Mapping | None, inputs: Mapping[str, torch.Tensor],
                outs: Sequence[torch.Tensor] | None = None) -> Callable[[], None]:
    """One call of ``op`` on ``inputs`` into ``outs`` (default: poisoned outputs allocated once): what every timing
    times."""
    outs = alloc_poisoned(op, inputs) if outs is None else tuple(outs)
    cfg = merged_config(op, config)
    inp = dict(inputs)

    def call() -> None:
        op.run(inp, outs, cfg)

    return call


@contextlib.contextmanager
def count_launches() -> Iterator[list[int]]:
    """Context manager yielding a one-element list holding the number of Triton kernel launches so far."""
    counter = [0]
    from triton import knobs

    def hook(metadata: object) -> None:
        counter[0] += 1

    knobs.runtime.launch_enter_hook.add(hook)
    patched = None
    if knobs.runtime.interpret:
        from triton.runtime import interpreter

        original = interpreter.GridExecutor.__call__

        def counting_call(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            counter[0] += 1
            return original(self, *args, **kwargs)

        interpreter.GridExecutor.__call__ = counting_call  # type: ignore[method-assign]
        patched = (interpreter.GridExecutor, original)
    try:
        yield counter
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
        if patched is not None:
            patched[0].__call__ = patched[1]  # type: ignore[method-assign]


def launches_per_call(op: KernelOp, config: Mapping | None, inputs: Mapping[str, torch.Tensor]) -> int:
    """Number of Triton kernel launches one ``op.run`` makes (CUDA: warmed up first, so compilation and
    autotuning runs are not counted)."""
    call = call_runner(op, config, inputs)
    dev = next((t.device for t in inputs.values() if isinstance(t, torch.Tensor)), torch.device("cpu"))
    if _is_cuda(dev):
        call()
        _sync(dev)
    with count_launches() as counter:
        call()
        _sync(dev)
    return counter[0]


def _cpu_peak_bytes(fn: Callable[[], object]) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    deltas = sorted(
        ((e.time_range.start, e.self_cpu_memory_usage) for e in prof.events() if e.self_cpu_memory_usage),
        key=lambda x: x[0],
    )
    running = peak = 0
    for _, d in deltas:
        running += d
        peak = max(peak, running)
    return int(peak)


def peak_memory_bytes(fn: Callable[[], object], *, device: str | torch.device) -> int:
    """Peak memory ``fn()`` allocates above what was allocated before it (see the module docstring)."""
    dev = resolve_device(device)
    if _is_cuda(dev):
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        fn()
        torch.cuda.synchronize(dev)
        return max(0, int(torch.cuda.max_memory_allocated(dev) - base))
    return _cpu_peak_bytes(fn)


def launch_overhead(fn: Callable[[], object], *, device: str | torch.device, reps: int = 5) -> float:
    """Median host time of one call. CUDA: the CPU time to return from ``fn()`` (kernel enqueued, not
    finished), synchronising between calls so the queue never backs up. CPU: the whole call."""
    dev = resolve_device(device)
    times = []
    for _ in range(max(1, reps)):
        _sync(dev)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    _sync(dev)
    return statistics.median(times)


def bench_op(
    op: KernelOp,
    config: Mapping | None,
    dtype: str,
    shape: Shape,
    *,
    device: str | torch.device,
    seed: int = 0,
    rep_ms: float | None = None,
) -> BenchResult:
    """Median latency, bandwidth, launches, host launch overhead and peak memory of one op on one shape."""
    tdtype = resolve_dtype(dtype)
    dev = resolve_device(device)
    op.domain.check(tdtype, shape)
    inputs = op.make_inputs(dict(shape), tdtype, dev, make_generator(dev, seed))
    call = call_runner(op, config, inputs)
    if rep_ms is None:
        rep_ms = 100.0 if _is_cuda(dev) else 0.0
    median_s = median_time(call, device=dev, rep_ms=rep_ms, min_reps=3)
    cfg = merged_config(op, config)
    inp = dict(inputs)
    peak = peak_memory_bytes(lambda: op.run(inp, op.alloc_outputs(inp), cfg), device=dev)
    nbytes = int(op.bytes_moved(dict(shape), tdtype))
    flops = int(op.flops(dict(shape)))
    return BenchResult(
        op=op.name,
        dtype=dtype,
        shape=dict(shape),
        device=str(dev),
        median_s=median_s,
        bytes_moved=nbytes,
        gbps=nbytes / median_s / 1e9 if median_s > 0 else 0.0,
        tflops=flops / median_s / 1e12 if median_s > 0 else 0.0,
        launches_per_call=launches_per_call(op, config, inputs),
        launch_overhead_s=launch_overhead(call, device=dev, reps=3 if not _is_cuda(dev) else 20),
        peak_memory_bytes=peak,
    )
