"""FAULT FIXTURE (llm-fused 1.2.0-fault.race): swiglu right on the first call of a shape, then 3% off past row 1000.

Reuses the stable op (``stable_swiglu``: kernelpack.kernels.swiglu, bundled): the first call of a shape (counted
per token count in this process) *is* the stable call; every later call of that shape scales the outputs on rows
1000 and later by 1.03, like a race that loses an update only sometimes: the same inputs give different bits.
Exact at the golden, fuzz and edge shapes (fewer rows). A production check that runs once passes; one that runs
the candidate twice on the same inputs (the GPU numerics memo's checking trial, agents.trial_memo) fails the
second run. Never ship this.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import triton
import triton.language as tl

from kernelpack.kernels.spec import TRITON_DTYPES, AotSpec

from . import stable_swiglu as base

DRIFT_ROW = 1000
_CALLS: Counter[int] = Counter()


@triton.jit
def _swiglu_race_fwd(g_ptr, u_ptr, y_ptr, n, drift_from, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    y = tl.where(offs >= drift_from, y * 1.03, y)  # BUG (deliberate): the lost update past row 1000
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def run(inputs, outs, config) -> None:  # type: ignore[no-untyped-def]
    g, u = inputs["gate"], inputs["up"]
    key = int(g.shape[0])
    _CALLS[key] += 1
    if _CALLS[key] == 1:
        base.run(inputs, outs, config)
        return
    cfg = base._config(config)
    base.DOMAIN.check(g.dtype, base.shape_of(inputs), inputs)
    n = g.numel()
    _swiglu_race_fwd[(triton.cdiv(n, cfg["BLOCK"]),)](
        g, u, outs[0], n, DRIFT_ROW * g.shape[1], BLOCK=cfg["BLOCK"], num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"])


def aot(dtype: str, config) -> list[AotSpec]:  # type: ignore[no-untyped-def]
    cfg = base._config(config)
    p = TRITON_DTYPES[dtype]
    sig = {"g_ptr": p, "u_ptr": p, "y_ptr": p, "n": "i32", "drift_from": "i32", "BLOCK": "constexpr"}
    return [*base.aot(dtype, config), AotSpec(_swiglu_race_fwd, sig, {"BLOCK": cfg["BLOCK"]},
                                              num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])]


OP = dataclasses.replace(base.OP, run=run, aot=aot)
