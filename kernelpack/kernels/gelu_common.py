"""What both bias + GELU ops share (``bias_gelu``, erf form; ``bias_gelu_tanh``): the biased tile
(``biased_tile``), inputs, host code, domain, shapes, launch configs and the bytes/flops model
(:func:`make_op`). Not an op itself: both import it as a sibling module (a bundle carries it along).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

import kernelpack.kernels.spec as spec

# both forms' tolerances against float64 (fp32 math; fp16/bf16 output rounding dominates)
TOLERANCES = {"fp32": spec.Tolerance(1e-5, 1e-5), "fp16": spec.Tolerance(1e-3, 2e-3), "bf16": spec.Tolerance(8e-3, 1.6e-2)}
DEFAULT_CONFIG: dict[str, int] = {"BLOCK_M": 4, "BLOCK_N": 1024, "num_warps": 4, "num_stages": 1}
# launch configs an arch-specific tuning sweep tries (scripts/bench-kernels --tune); all must be correct
TUNING_SPACE: list[dict[str, int]] = [{"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": 1} for m, n, w in ((4, 1024, 4), (2, 2048, 8), (1, 4096, 8), (2, 1024, 4), (8, 512, 4), (1, 1024, 4), (1, 2048, 4), (2, 512, 4), (1, 512, 2))]


@triton.jit
def biased_tile(x_ptr, b_ptr, n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's (BLOCK_M, BLOCK_N) tile of ``x + bias`` in fp32, with its offsets and mask (both GELU
    forms' kernels start here; inlined by the compiler)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < n_cols
    mask = (rows[:, None] < n_rows) & cmask[None, :]
    offs = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    return x + b[None, :], offs, mask


def make_inputs(shape: spec.Shape, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> spec.Inputs:
    t, h = shape["tokens"], shape["hidden"]
    x = torch.randn(t, h, generator=gen, device=gen.device) * 2.0
    b = torch.randn(h, generator=gen, device=gen.device) * 0.5
    return {"x": x.to(device, dtype), "bias": b.to(device, dtype)}


def alloc_outputs(inputs: spec.Inputs) -> spec.Outputs:
    return (torch.empty_like(inputs["x"]),)


def bytes_moved(shape: spec.Shape, dtype: torch.dtype) -> int:
    es = torch.empty((), dtype=dtype).element_size()
    return (2 * shape["tokens"] * shape["hidden"] + shape["hidden"]) * es


def flops(shape: spec.Shape) -> int:
    return 8 * shape["tokens"] * shape["hidden"]


def fuzz(rng: random.Random) -> spec.Shape:
    return {"tokens": rng.randint(1, 9), "hidden": 8 * rng.randint(1, 40)}


def make_op(name: str, kernel: Any, reference: Callable[[spec.Inputs], spec.Outputs],
            eager: Callable[[spec.Inputs], spec.Outputs], *, description: str, form: str,
            tolerances: dict[str, spec.Tolerance] | None = None) -> spec.KernelOp:
    """A bias + GELU op around ``kernel`` (a ``(x, b, y, n_rows, n_cols, BLOCK_M, BLOCK_N)`` Triton kernel): the
    host code, domain, shapes and launch configs both GELU forms share (``bias_gelu_tanh`` reuses this)."""

    def shape_of(inputs: spec.Inputs) -> spec.Shape:
        x, b = inputs["x"], inputs["bias"]
        if x.dim() != 2:
            raise spec.DomainError(f"{name}: x must be 2-D (tokens, hidden), got shape {tuple(x.shape)}")
        if b.shape != (x.shape[1],):
            raise spec.DomainError(f"{name}: bias must have shape ({x.shape[1]},) to match x, got {tuple(b.shape)}")
        if b.dtype != x.dtype or b.device != x.device:
            raise spec.DomainError(f"{name}: bias ({b.dtype}, {b.device}) must match x ({x.dtype}, {x.device})")
        return {"tokens": x.shape[0], "hidden": x.shape[1]}

    domain = spec.Domain(
        dtypes=("fp16", "bf16", "fp32"),
        dims={"tokens": spec.DimRange(1, 1 << 20), "hidden": spec.DimRange(8, 65536, 8)},
        notes=f"x (tokens, hidden) and bias (hidden,) of one dtype, contiguous; hidden a multiple of 8 "
        f"(16-byte rows); {form}.",
    )

    def run(inputs: spec.Inputs, outs: spec.Outputs, config: spec.LaunchConfig) -> None:
        cfg = spec.launch_config(name, DEFAULT_CONFIG, config)
        x, b = inputs["x"], inputs["bias"]
        domain.check(x.dtype, shape_of(inputs), inputs)
        (y,) = outs
        spec.check_outputs(name, outs, x)
        t, h = x.shape
        bm = min(cfg["BLOCK_M"], triton.next_power_of_2(t))  # BLOCK_M is an upper bound: few tokens, short tiles
        grid = (triton.cdiv(t, bm), triton.cdiv(h, cfg["BLOCK_N"]))
        kernel[grid](
            x, b, y, t, h, BLOCK_M=bm, BLOCK_N=cfg["BLOCK_N"],
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )

    def aot(dtype: str, config: spec.LaunchConfig) -> list[spec.AotSpec]:
        cfg = spec.launch_config(name, DEFAULT_CONFIG, config)
        p = spec.TRITON_DTYPES[dtype]
        sig = {"x_ptr": p, "b_ptr": p, "y_ptr": p, "n_rows": "i32", "n_cols": "i32",
               "BLOCK_M": "constexpr", "BLOCK_N": "constexpr"}
        return [spec.AotSpec(kernel, sig, {"BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"]},
                        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])]

    return spec.module_op(
        {"NAME": name, "DOMAIN": domain, "DEFAULT_CONFIG": DEFAULT_CONFIG, "make_inputs": make_inputs,
         "shape_of": shape_of, "alloc_outputs": alloc_outputs, "run": run, "reference": reference, "eager": eager,
         "bytes_moved": bytes_moved, "flops": flops, "fuzz": fuzz, "aot": aot},
        description=description,
        tolerances=tolerances or TOLERANCES,
        test_shapes=({"tokens": 3, "hidden": 40}, {"tokens": 5, "hidden": 1032}),
        decode_shapes=tuple({"tokens": t, "hidden": 14336} for t in (1, 16, 64, 256)),
        prefill_shapes=tuple({"tokens": t, "hidden": 14336} for t in (2048, 8192, 16384)),
    )
