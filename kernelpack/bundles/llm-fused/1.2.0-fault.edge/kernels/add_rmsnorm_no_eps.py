"""FAULT FIXTURE (llm-fused 1.2.0-fault.edge): add_rmsnorm launched with eps = 0.

Reuses the stable op (``stable_add_rmsnorm``: kernelpack.kernels.add_rmsnorm, bundled) and overrides only
``run``: the kernel gets eps = 0, so an all-zero row (a padding token) computes 0 * 1/sqrt(0) = NaN. On random
inputs the outputs agree with the reference to ~1e-7. Never ship this.
"""

from __future__ import annotations

import dataclasses

import triton

from . import stable_add_rmsnorm as base


def run(inputs, outs, config) -> None:  # type: ignore[no-untyped-def]
    cfg = base._config(config)
    x, r, w = inputs["x"], inputs["residual"], inputs["weight"]
    base.DOMAIN.check(x.dtype, base.shape_of(inputs), inputs)
    y, h = outs
    t, n = x.shape
    bm = min(cfg["BLOCK_M"], triton.next_power_of_2(t))
    base._add_rmsnorm_fwd[(triton.cdiv(t, bm),)](
        x, r, w, y, h, t, n, 0.0,  # BUG (deliberate): eps dropped
        BLOCK_M=bm, BLOCK_N=base._block_n(n), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


OP = dataclasses.replace(base.OP, run=run)
