"""FAULT FIXTURE (llm-fused 1.2.0-fault.rows): swiglu 3% off on rows 1000 and later.

Reuses the stable op (``stable_swiglu``: kernelpack.kernels.swiglu, bundled) and overrides only the kernel:
outputs at flat offsets past ``1000 * hidden`` are scaled by 1.03. Exact at the golden and fuzz shapes (a few
rows), wrong at production token counts. Never ship this.
"""

from __future__ import annotations

import dataclasses

import triton
import triton.language as tl

from kernelpack.kernels.spec import TRITON_DTYPES, AotSpec

from . import stable_swiglu as base

DRIFT_ROW = 1000


@triton.jit
def _swiglu_rows_fwd(g_ptr, u_ptr, y_ptr, n, drift_from, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    y = tl.where(offs >= drift_from, y * 1.03, y)  # BUG (deliberate): drift past row 1000
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def run(inputs, outs, config) -> None:  # type: ignore[no-untyped-def]
    cfg = base._config(config)
    g, u = inputs["gate"], inputs["up"]
    base.DOMAIN.check(g.dtype, base.shape_of(inputs), inputs)
    (y,) = outs
    n = g.numel()
    _swiglu_rows_fwd[(triton.cdiv(n, cfg["BLOCK"]),)](
        g, u, y, n, DRIFT_ROW * g.shape[1], BLOCK=cfg["BLOCK"], num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"])


def aot(dtype: str, config) -> list[AotSpec]:  # type: ignore[no-untyped-def]
    cfg = base._config(config)
    p = TRITON_DTYPES[dtype]
    sig = {"g_ptr": p, "u_ptr": p, "y_ptr": p, "n": "i32", "drift_from": "i32", "BLOCK": "constexpr"}
    return [AotSpec(_swiglu_rows_fwd, sig, {"BLOCK": cfg["BLOCK"]}, num_warps=cfg["num_warps"],
                    num_stages=cfg["num_stages"])]


OP = dataclasses.replace(base.OP, run=run, aot=aot)
