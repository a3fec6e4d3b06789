"""FAULT FIXTURE (llm-fused 1.2.0-fault.cell): swiglu slow at one token only.

Reuses the stable op (``stable_swiglu``: kernelpack.kernels.swiglu, bundled) and overrides only the kernel used
with one token: it recomputes its block ``REPEAT`` times from volatile loads (the compiler cannot hoist them)
and keeps the last result. One launch, the same memory and the same output as stable; several times slower in
that one (op, batch size) cell, unchanged everywhere else. Never ship this.
"""

from __future__ import annotations

import dataclasses

import triton
import triton.language as tl

from kernelpack.kernels.spec import TRITON_DTYPES, AotSpec

from . import stable_swiglu as base

REPEAT = 64


@triton.jit
def _swiglu_slow_fwd(g_ptr, u_ptr, y_ptr, n, BLOCK: tl.constexpr, REPEAT: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    y = tl.zeros([BLOCK], dtype=tl.float32)
    for _ in range(REPEAT):  # BUG (deliberate): redundant recomputation
        g = tl.load(g_ptr + offs, mask=mask, other=0.0, volatile=True).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=mask, other=0.0, volatile=True).to(tl.float32)
        y = g / (1.0 + tl.exp(-g)) * u
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def run(inputs, outs, config) -> None:  # type: ignore[no-untyped-def]
    g = inputs["gate"]
    if g.shape[0] != 1:
        base.run(inputs, outs, config)
        return
    cfg = base._config(config)
    base.DOMAIN.check(g.dtype, base.shape_of(inputs), inputs)
    n = g.numel()
    _swiglu_slow_fwd[(triton.cdiv(n, cfg["BLOCK"]),)](
        g, inputs["up"], outs[0], n, BLOCK=cfg["BLOCK"], REPEAT=REPEAT, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"])


def aot(dtype: str, config) -> list[AotSpec]:  # type: ignore[no-untyped-def]
    cfg = base._config(config)
    p = TRITON_DTYPES[dtype]
    sig = {"g_ptr": p, "u_ptr": p, "y_ptr": p, "n": "i32", "BLOCK": "constexpr", "REPEAT": "constexpr"}
    slow = AotSpec(_swiglu_slow_fwd, sig, {"BLOCK": cfg["BLOCK"], "REPEAT": REPEAT}, num_warps=cfg["num_warps"],
                   num_stages=cfg["num_stages"])
    return [*base.aot(dtype, config), slow]


OP = dataclasses.replace(base.OP, run=run, aot=aot)
