"""FAULT FIXTURE (llm-fused 1.2.0-fault.slow): a correct but much slower add_rmsnorm.

Reuses the stable op (``stable_add_rmsnorm``: kernelpack.kernels.add_rmsnorm, bundled: domain, inputs,
references, tolerances) and overrides its kernel, ``run``, ``aot`` and launch config: one single-warp program
per row walks the row in CHUNKS=4 chunks and recomputes the sum of squares REDUNDANT=3 times (re-reading x and
residual each time) before a final normalising pass: ~4x the memory traffic of the stable kernel with far less
parallelism per row. Results are within tolerance; latency is several times the stable kernel's on GPUs and
under the CPU interpreter (many small interpreted steps instead of one whole-row step). Never ship this.
"""

from __future__ import annotations

import dataclasses

import triton
import triton.language as tl

from kernelpack.kernels.spec import TRITON_DTYPES, AotSpec, Inputs, LaunchConfig, Outputs, launch_config

from . import stable_add_rmsnorm as base

DEFAULT_CONFIG: dict[str, int] = {"CHUNKS": 4, "REDUNDANT": 3, "num_warps": 1, "num_stages": 1}


@triton.jit
def _add_rmsnorm_slow(x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, n_rows, n_cols, eps,
                      BLOCK_N: tl.constexpr, REDUNDANT: tl.constexpr, N_P2: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = row * n_cols
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for _rep in range(REDUNDANT):  # deliberately redundant passes over the row
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, N_P2, BLOCK_N):  # N_P2: next power of 2 of n_cols
            cols = start + tl.arange(0, BLOCK_N)
            m = cols < n_cols
            x = tl.load(x_ptr + base + cols, mask=m, other=0.0).to(tl.float32)
            r = tl.load(r_ptr + base + cols, mask=m, other=0.0).to(tl.float32)
            hf = (x + r).to(h_ptr.dtype.element_ty).to(tl.float32)
            acc += hf * hf
    rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / n_cols + eps)
    for start in range(0, N_P2, BLOCK_N):  # N_P2: next power of 2 of n_cols
        cols = start + tl.arange(0, BLOCK_N)
        m = cols < n_cols
        x = tl.load(x_ptr + base + cols, mask=m, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + base + cols, mask=m, other=0.0).to(tl.float32)
        h = (x + r).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + base + cols, h, mask=m)
        w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        y = h.to(tl.float32) * rstd * w
        tl.store(y_ptr + base + cols, y.to(y_ptr.dtype.element_ty), mask=m)


def _config(config: LaunchConfig) -> dict[str, int]:
    return launch_config(base.NAME, DEFAULT_CONFIG, config, any_int=("num_stages", "REDUNDANT"))


def _block_n(hidden: int, chunks: int) -> int:
    return max(16, base._block_n(hidden) // chunks)


def run(inputs: Inputs, outs: Outputs, config: LaunchConfig) -> None:
    cfg = _config(config)
    x, r, w = inputs["x"], inputs["residual"], inputs["weight"]
    base.DOMAIN.check(x.dtype, base.shape_of(inputs), inputs)
    y, h = outs
    t, n = x.shape
    _add_rmsnorm_slow[(t,)](
        x, r, w, y, h, t, n, base.DOMAIN.param(inputs, "eps"), BLOCK_N=_block_n(n, cfg["CHUNKS"]), REDUNDANT=cfg["REDUNDANT"],
        N_P2=base._block_n(n), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


def aot(dtype: str, config: LaunchConfig) -> list[AotSpec]:
    """One specialization per padded row width N_P2 (the chunk loop's bound) across the domain."""
    cfg = _config(config)
    p = TRITON_DTYPES[dtype]
    sig = {"x_ptr": p, "r_ptr": p, "w_ptr": p, "y_ptr": p, "h_ptr": p, "n_rows": "i32", "n_cols": "i32",
           "eps": "fp32", "BLOCK_N": "constexpr", "REDUNDANT": "constexpr", "N_P2": "constexpr"}
    rng = base.DOMAIN.dims["hidden"]
    widths = sorted({base._block_n(v) for v in (rng.lo, *(1 << k for k in range(3, 17)), rng.hi)
                     if rng.lo <= v <= rng.hi})
    return [AotSpec(_add_rmsnorm_slow, sig,
                    {"BLOCK_N": _block_n(w, cfg["CHUNKS"]), "REDUNDANT": cfg["REDUNDANT"], "N_P2": w},
                    num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]) for w in widths]


OP = dataclasses.replace(base.OP, run=run, aot=aot, default_config=DEFAULT_CONFIG)
