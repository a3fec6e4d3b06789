"""FAULT FIXTURE (llm-fused 1.2.0-fault.warmup): swiglu normal for its first 4 calls of a shape, then twice the work.

Reuses the stable op (``stable_swiglu``: kernelpack.kernels.swiglu, bundled): a normal call *is* the stable call.
A slow call launches a kernel whose grid holds each block ``REP`` times (the copies compute and store the same
values): one launch, the same memory and output, ``REP`` times the work on a GPU and under the interpreter
alike. Here the first 4 calls of a shape (counted per token count) run normally, every later call runs its blocks twice over. Never ship this.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import triton
import triton.language as tl

from kernelpack.kernels.spec import TRITON_DTYPES, AotSpec

from . import stable_swiglu as base

_CALLS: Counter[int] = Counter()


def _key(inputs) -> int:  # type: ignore[no-untyped-def]
    return int(inputs["gate"].shape[0])


def _tick(key: int) -> int:
    """This call's index among the calls of its shape (0 for the first)."""
    _CALLS[key] += 1
    return _CALLS[key] - 1


@triton.jit
def _swiglu_rep_fwd(g_ptr, u_ptr, y_ptr, n, blocks, BLOCK: tl.constexpr):
    # BUG (deliberate): the grid holds every block several times; program p computes block p % blocks
    offs = (tl.program_id(0) % blocks).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0, volatile=True).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0, volatile=True).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def run(inputs, outs, config) -> None:  # type: ignore[no-untyped-def]
    rep = 1 if _tick(_key(inputs)) < 4 else 2
    if rep == 1:
        base.run(inputs, outs, config)
        return
    g = inputs["gate"]
    cfg = base._config(config)
    base.DOMAIN.check(g.dtype, base.shape_of(inputs), inputs)
    n = g.numel()
    blocks = triton.cdiv(n, cfg["BLOCK"])
    _swiglu_rep_fwd[(rep * blocks,)](g, inputs["up"], outs[0], n, blocks, BLOCK=cfg["BLOCK"],
                                     num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def aot(dtype: str, config) -> list[AotSpec]:  # type: ignore[no-untyped-def]
    cfg = base._config(config)
    p = TRITON_DTYPES[dtype]
    sig = {"g_ptr": p, "u_ptr": p, "y_ptr": p, "n": "i32", "blocks": "i32", "BLOCK": "constexpr"}
    return [*base.aot(dtype, config), AotSpec(_swiglu_rep_fwd, sig, {"BLOCK": cfg["BLOCK"]}, num_warps=cfg["num_warps"],
                                              num_stages=cfg["num_stages"])]


OP = dataclasses.replace(base.OP, run=run, aot=aot)
