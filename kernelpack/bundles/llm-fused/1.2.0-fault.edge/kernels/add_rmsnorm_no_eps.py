"""FAULT FIXTURE (llm-fused 1.2.0-fault.edge): add_rmsnorm that drops eps on an all-zero row.

Reuses the stable op (``stable_add_rmsnorm``: kernelpack.kernels.add_rmsnorm, bundled) and overrides only
``run``, with a kernel that adds eps only to rows whose mean square is positive (the "the variance is never zero"
shortcut): an all-zero row (a padding token) computes 0 * 1/sqrt(0) = NaN. Every other row, whatever its
magnitude, gets exactly the stable kernel's result. Never ship this.
"""

from __future__ import annotations

import dataclasses

import triton
import triton.language as tl

from . import stable_add_rmsnorm as base

norm_common = base.norm_common  # the shared row tile, bundled with the stable op


@triton.jit
def _add_rmsnorm_no_eps(x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, n_rows, n_cols, eps,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    hf, offs, mask, cols, cmask = norm_common.residual_tile(x_ptr, r_ptr, h_ptr, n_rows, n_cols, BLOCK_M, BLOCK_N)
    var = tl.sum(hf * hf, axis=1) / n_cols
    rstd = 1.0 / tl.sqrt(var + tl.where(var > 0.0, eps, 0.0))  # BUG (deliberate): eps dropped on zero rows
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    y = hf * rstd[:, None] * w[None, :]
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def run(inputs, outs, config) -> None:  # type: ignore[no-untyped-def]
    cfg = base._config(config)
    x, r, w = inputs["x"], inputs["residual"], inputs["weight"]
    base.DOMAIN.check(x.dtype, base.shape_of(inputs), inputs)
    y, h = outs
    t, n = x.shape
    bm = min(cfg["BLOCK_M"], triton.next_power_of_2(t))
    _add_rmsnorm_no_eps[(triton.cdiv(t, bm),)](
        x, r, w, y, h, t, n, base.DOMAIN.param(inputs, "eps"),
        BLOCK_M=bm, BLOCK_N=base._block_n(n), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


OP = dataclasses.replace(base.OP, run=run)
