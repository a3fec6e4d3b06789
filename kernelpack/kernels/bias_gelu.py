"""Fused bias add + GELU, exact erf form: ``y = gelu(x + bias)`` over a (tokens, hidden) activation.

Owns op ``bias_gelu``: its Triton kernel, float64 reference, eager PyTorch version, domain and tolerances.
The tanh approximation is the separate op ``bias_gelu_tanh`` (module ``bias_gelu_tanh``), which reuses this
module's host code, domain and shapes through :func:`make_op` and differs only in its kernel and references.
Bundle modules import only stdlib, torch, triton, ``kernelpack.kernels.spec`` and their bundle's siblings.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from kernelpack.kernels.spec import (
    TRITON_DTYPES,
    AotSpec,
    DimRange,
    Domain,
    DomainError,
    Inputs,
    KernelOp,
    LaunchConfig,
    Outputs,
    Shape,
    Tolerance,
    launch_config,
    module_op,
)

NAME = "bias_gelu"
DEFAULT_CONFIG: dict[str, int] = {"BLOCK_M": 4, "BLOCK_N": 1024, "num_warps": 4, "num_stages": 1}
# launch configs an arch-specific tuning sweep tries (scripts/bench-kernels --tune); all must be correct
TUNING_SPACE: list[dict[str, int]] = [{"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": 1} for m, n, w in ((4, 1024, 4), (2, 2048, 8), (1, 4096, 8), (2, 1024, 4), (8, 512, 4), (1, 1024, 4), (1, 2048, 4), (2, 512, 4), (1, 512, 2))]


@triton.jit
def _bias_gelu_fwd(x_ptr, b_ptr, y_ptr, n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < n_cols
    mask = (rows[:, None] < n_rows) & cmask[None, :]
    offs = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    h = x + b[None, :]
    # erf by Abramowitz & Stegun 7.1.26 (|error| <= 1.5e-7, at fp32 rounding level): one exp and one fast
    # reciprocal instead of libdevice's erff, which made this kernel ALU-bound on Hopper (68% of copy BW)
    z = tl.abs(h) * 0.7071067811865476
    t = tl.math.fdiv(1.0, 1.0 + 0.3275911 * z)  # approximate (2 ulp) division: div.full.f32
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    erf_abs = 1.0 - poly * tl.exp(-z * z)
    y = 0.5 * h * (1.0 + tl.where(h < 0, -erf_abs, erf_abs))
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def make_op(name: str, kernel: Any, reference: Callable[[Inputs], Outputs], eager: Callable[[Inputs], Outputs], *,
            description: str, form: str, tolerances: dict[str, Tolerance]) -> KernelOp:
    """A bias + GELU op around ``kernel`` (a ``(x, b, y, n_rows, n_cols, BLOCK_M, BLOCK_N)`` Triton kernel): the
    host code, domain, shapes and launch configs both GELU forms share (``bias_gelu_tanh`` reuses this)."""

    def shape_of(inputs: Inputs) -> Shape:
        x, b = inputs["x"], inputs["bias"]
        if x.dim() != 2:
            raise DomainError(f"{name}: x must be 2-D (tokens, hidden), got shape {tuple(x.shape)}")
        if b.shape != (x.shape[1],):
            raise DomainError(f"{name}: bias must have shape ({x.shape[1]},) to match x, got {tuple(b.shape)}")
        if b.dtype != x.dtype or b.device != x.device:
            raise DomainError(f"{name}: bias ({b.dtype}, {b.device}) must match x ({x.dtype}, {x.device})")
        return {"tokens": x.shape[0], "hidden": x.shape[1]}

    domain = Domain(
        dtypes=("fp16", "bf16", "fp32"),
        dims={"tokens": DimRange(1, 1 << 20), "hidden": DimRange(8, 65536, 8)},
        notes=f"x (tokens, hidden) and bias (hidden,) of one dtype, contiguous; hidden a multiple of 8 "
        f"(16-byte rows); {form}.",
    )

    def run(inputs: Inputs, outs: Outputs, config: LaunchConfig) -> None:
        cfg = launch_config(name, DEFAULT_CONFIG, config)
        x, b = inputs["x"], inputs["bias"]
        domain.check(x.dtype, shape_of(inputs), inputs)
        (y,) = outs
        if y.shape != x.shape or y.dtype != x.dtype or not y.is_contiguous():
            raise ValueError(f"{name}: output must be a contiguous {x.dtype} tensor of shape {tuple(x.shape)}")
        t, h = x.shape
        bm = min(cfg["BLOCK_M"], triton.next_power_of_2(t))  # BLOCK_M is an upper bound: few tokens, short tiles
        grid = (triton.cdiv(t, bm), triton.cdiv(h, cfg["BLOCK_N"]))
        kernel[grid](
            x, b, y, t, h, BLOCK_M=bm, BLOCK_N=cfg["BLOCK_N"],
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )

    def aot(dtype: str, config: LaunchConfig) -> list[AotSpec]:
        cfg = launch_config(name, DEFAULT_CONFIG, config)
        p = TRITON_DTYPES[dtype]
        sig = {"x_ptr": p, "b_ptr": p, "y_ptr": p, "n_rows": "i32", "n_cols": "i32",
               "BLOCK_M": "constexpr", "BLOCK_N": "constexpr"}
        return [AotSpec(kernel, sig, {"BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"]},
                        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])]

    return module_op(
        {"NAME": name, "DOMAIN": domain, "DEFAULT_CONFIG": DEFAULT_CONFIG, "make_inputs": make_inputs,
         "shape_of": shape_of, "alloc_outputs": alloc_outputs, "run": run, "reference": reference, "eager": eager,
         "bytes_moved": bytes_moved, "flops": flops, "fuzz": fuzz, "aot": aot},
        description=description,
        tolerances=tolerances,
        test_shapes=({"tokens": 3, "hidden": 40}, {"tokens": 5, "hidden": 1032}),
        decode_shapes=tuple({"tokens": t, "hidden": 14336} for t in (1, 16, 64, 256)),
        prefill_shapes=tuple({"tokens": t, "hidden": 14336} for t in (2048, 8192, 16384)),
    )


def make_inputs(shape: Shape, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> Inputs:
    t, h = shape["tokens"], shape["hidden"]
    x = torch.randn(t, h, generator=gen, device=gen.device) * 2.0
    b = torch.randn(h, generator=gen, device=gen.device) * 0.5
    return {"x": x.to(device, dtype), "bias": b.to(device, dtype)}


def alloc_outputs(inputs: Inputs) -> Outputs:
    return (torch.empty_like(inputs["x"]),)


def reference(inputs: Inputs) -> Outputs:
    h = inputs["x"].double() + inputs["bias"].double()
    return (0.5 * h * (1.0 + torch.erf(h / 2.0**0.5)),)


def eager(inputs: Inputs) -> Outputs:
    return (torch.nn.functional.gelu(inputs["x"] + inputs["bias"]),)


def bytes_moved(shape: Shape, dtype: torch.dtype) -> int:
    es = torch.empty((), dtype=dtype).element_size()
    return (2 * shape["tokens"] * shape["hidden"] + shape["hidden"]) * es


def flops(shape: Shape) -> int:
    return 8 * shape["tokens"] * shape["hidden"]


def fuzz(rng: random.Random) -> Shape:
    return {"tokens": rng.randint(1, 9), "hidden": 8 * rng.randint(1, 40)}


OP = make_op(
    NAME, _bias_gelu_fwd, reference, eager,
    description="y = gelu_erf(x + bias), one read of x and one write of y",
    form="erf form of GELU computed in fp32 (erf to 1.5e-7 absolute, Abramowitz-Stegun 7.1.26)",
    tolerances={"fp32": Tolerance(1e-5, 1e-5), "fp16": Tolerance(1e-3, 2e-3), "bf16": Tolerance(8e-3, 1.6e-2)},
)
DOMAIN = OP.domain
shape_of, run, aot = OP.shape_of, OP.run, OP.aot
