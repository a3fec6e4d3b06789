"""The trial's latency phase (issue 25): every cell of the profile, both versions, individual calls.

Calls are timed one by one in ABBA quads (contention hits both versions), in fixed windows of 8 quads (16 calls
per arm) on a GPU: one shared warm-up of ``GPU_WARMUP_S`` at the start of the phase (the GPU's clocks settle
under the load once per trial), 10 untimed calls per cell (caches), then up to 32 windows (512 calls per arm),
fewer for a slow cell once it has used ``GPU_CELL_BUDGET_S`` (never under 4 windows, 64 calls per arm). Under
the interpreter: one warm-up call, 6 windows of 1 quad (12 calls per arm), timed by the trial thread's CPU time
(its Python work, which busy neighbours do not inflate as they do wall time). Each quad is ABBA or BAAB at
random; windows in which both arms ran slow (a busy device) are dropped from both
(:func:`kernelpack.harness.bench.drop_contended`). Each cell is
reported as a :class:`kernelctl.wire.CellLatency` document: per arm n, mean, p50, p99 and the window means.
"""

from __future__ import annotations

import math
import time
from typing import Any

GPU_WINDOWS, GPU_QUADS, GPU_WARMUP_S, GPU_CELL_BUDGET_S = 32, 8, 1.0, 0.12
CPU_WINDOWS, CPU_QUADS = 6, 1

TOKEN_DIMS = ("tokens", "q", "seq")


def token_dim(shape: dict[str, int]) -> str:
    """The dimension that scales with traffic (tokens per call); the first dim when none is named so."""
    return next((d for d in TOKEN_DIMS if d in shape), next(iter(shape)))


Plan = list[tuple[str, str, list[dict[str, int]], Any]]  # (op, dtype, latency shapes, capacity shape)
Versions = dict[str, tuple[Any, dict[str, Any]]]  # op name -> (KernelOp, launch config)


def time_cells(plan: Plan, stable: Versions, cand: Versions, *, device: Any, seed: int
               ) -> tuple[list[dict[str, Any]], list[str]]:
    """Every cell of ``plan`` whose op both versions have: (CellLatency documents, notes for the report)."""
    from kernelpack.harness.bench import gc_paused

    with gc_paused():  # one collection for the whole phase, not one per cell
        return _time_cells(plan, stable, cand, device=device, seed=seed)


def _time_cells(plan: Plan, stable: Versions, cand: Versions, *, device: Any, seed: int
                ) -> tuple[list[dict[str, Any]], list[str]]:
    from kernelpack.harness.bench import arm_summary, drop_contended, paired_calls
    from kernelpack.kernels.spec import DomainError

    cuda = device.type == "cuda"
    timing: dict[str, Any] = ({"windows": GPU_WINDOWS, "quads": GPU_QUADS, "warmup_calls": 10,
                               "timer": time.perf_counter, "budget_s": GPU_CELL_BUDGET_S} if cuda else
                              {"windows": CPU_WINDOWS, "quads": CPU_QUADS, "warmup_calls": 1,
                               "timer": time.thread_time})
    cells: list[dict[str, Any]] = []
    notes: list[str] = []
    if cuda:
        notes.extend(warm_up(plan, stable, cand, device=device, seed=seed))
    for k, (name, dtype, shapes, _cap) in enumerate(plan):
        if not shapes:
            notes.append(f"{name}: no profile shape inside the op's domain; latency skipped")
            continue
        if name not in stable:
            continue
        for j, shape in enumerate(shapes):
            try:
                st, ca = paired_calls(stable[name], cand[name], dtype, shape, device=device, seed=seed + 7 * k + j,
                                      **timing)
            except DomainError as exc:
                notes.append(f"{name}: latency shape {shape} skipped: {exc}")
                continue
            st, ca, dropped = drop_contended(st, ca)
            cells.append({"op": name, "tokens": int(shape[token_dim(shape)]), "stable": arm_summary(st),
                          "candidate": arm_summary(ca), "contended_windows": dropped})
    return cells, notes


def warm_up(plan: Plan, stable: Versions, cand: Versions, *, device: Any, seed: int) -> list[str]:
    """``GPU_WARMUP_S`` of calls of the largest cell, both versions alternately (a note of what ran)."""
    import torch

    from kernelpack.harness.bench import call_runner
    from kernelpack.harness.numerics import make_generator, resolve_dtype
    from kernelpack.kernels.spec import DomainError

    cells = [(math.prod(s.values()), name, dtype, s) for name, dtype, shapes, _ in plan if name in stable
             for s in shapes]
    if not cells:
        return []
    _, name, dtype, shape = max(cells, key=lambda c: c[0])
    try:
        inputs = cand[name][0].make_inputs(dict(shape), resolve_dtype(dtype), device, make_generator(device, seed))
    except DomainError:
        return []
    runs = [call_runner(*stable[name], inputs), call_runner(*cand[name], inputs)]
    end = time.perf_counter() + GPU_WARMUP_S
    calls = 0
    while time.perf_counter() < end:
        runs[calls % 2]()
        calls += 1
        if calls % 16 == 0:
            torch.cuda.synchronize(device)
    return [f"latency warm-up: {calls} calls of {name} {shape} in {GPU_WARMUP_S:g} s"]
