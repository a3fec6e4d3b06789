"""Per-token FP8 (e4m3fn) quantization: ``scale = max(|x_row|) / 448``; ``q = clamp(x / scale) -> fp8``.

Owns op ``fp8_quant``: Triton kernel, float64 reference, eager PyTorch version, domain and tolerances.
Returns ``(q, scales)``: q (tokens, hidden) float8_e4m3fn and scales (tokens,) float32, so x ~= q * scale.
An all-zero row gets scale 1e-12 / 448 floor (no division by zero). The reference returns the *unrounded*
x / scale in float64, so the tolerance (rtol 1/16 + fp32 slack) is the half-ulp of e4m3's 3-bit mantissa.
One row per program, held in registers. Imports only torch, triton and ``kernelpack.kernels.spec``.
"""

from __future__ import annotations

import functools
import random

import torch
import triton
import triton.language as tl

import kernelpack.kernels.spec as spec

NAME = "fp8_quant"
FP8_MAX = 448.0
MIN_SCALE = 1e-12 / 448.0
DEFAULT_CONFIG: dict[str, int] = {"BLOCK_M": 1, "num_warps": 4, "num_stages": 1}
# launch configs an arch-specific tuning sweep tries (scripts/bench-kernels --tune); all must be correct
TUNING_SPACE: list[dict[str, int]] = [{"BLOCK_M": m, "num_warps": w, "num_stages": 1} for m in (1, 2) for w in (4, 8, 16)]


@triton.jit
def _fp8_quant_fwd(x_ptr, q_ptr, s_ptr, n_rows, n_cols, fp8_max, min_scale,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROUND_IN_FP32: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    rmask = rows < n_rows
    mask = rmask[:, None] & (cols[None, :] < n_cols)
    offs = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.maximum(amax / fp8_max, min_scale)
    q = tl.minimum(tl.maximum(x / scale[:, None], -fp8_max), fp8_max)
    if ROUND_IN_FP32:
        # Triton's CPU interpreter truncates fp32->fp8 without carrying the rounding into the exponent,
        # so round to the e4m3 grid (3 mantissa bits, subnormal step 2^-9) here; the cast is then exact.
        a = tl.abs(q)
        e = tl.floor(tl.log2(tl.maximum(a, 0.015625)))
        e = tl.where(tl.exp2(e) > tl.maximum(a, 0.015625), e - 1.0, e)
        ulp = tl.exp2(e - 3.0)
        r = ((a / ulp + 12582912.0) - 12582912.0) * ulp
        q = tl.where(q < 0, -r, r)
    tl.store(q_ptr + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + rows, scale, mask=rmask)


_config = functools.partial(spec.launch_config, NAME, DEFAULT_CONFIG)  # validated launch config of a call


def shape_of(inputs: spec.Inputs) -> spec.Shape:
    x = inputs["x"]
    if x.dim() != 2:
        raise spec.DomainError(f"{NAME}: x must be 2-D (tokens, hidden), got shape {tuple(x.shape)}")
    return {"tokens": x.shape[0], "hidden": x.shape[1]}


def make_inputs(shape: spec.Shape, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> spec.Inputs:
    t, h = shape["tokens"], shape["hidden"]
    x = torch.randn(t, h, generator=gen, device=gen.device)
    x = x * torch.exp(torch.randn(t, 1, generator=gen, device=gen.device))  # rows of different magnitude
    return {"x": x.to(device, dtype)}


def alloc_outputs(inputs: spec.Inputs) -> spec.Outputs:
    x = inputs["x"]
    return (torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device),
            torch.empty(x.shape[0], dtype=torch.float32, device=x.device))


def _block_n(hidden: int) -> int:
    return max(16, triton.next_power_of_2(hidden))


def run(inputs: spec.Inputs, outs: spec.Outputs, config: spec.LaunchConfig) -> None:
    cfg = _config(config)
    x = inputs["x"]
    DOMAIN.check(x.dtype, shape_of(inputs), inputs)
    q, s = outs
    if q.shape != x.shape or q.dtype != torch.float8_e4m3fn or not q.is_contiguous():
        raise ValueError(f"{NAME}: q must be a contiguous float8_e4m3fn tensor of shape {tuple(x.shape)}")
    if s.shape != (x.shape[0],) or s.dtype != torch.float32:
        raise ValueError(f"{NAME}: scales must be a float32 tensor of shape ({x.shape[0]},)")
    t, n = x.shape
    bm = min(cfg["BLOCK_M"], triton.next_power_of_2(t))  # BLOCK_M is an upper bound: few tokens, fewer rows
    _fp8_quant_fwd[(triton.cdiv(t, bm),)](
        x, q, s, t, n, FP8_MAX, MIN_SCALE, BLOCK_M=bm, BLOCK_N=_block_n(n),
        ROUND_IN_FP32=x.device.type == "cpu", num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


def reference(inputs: spec.Inputs) -> spec.Outputs:
    x = inputs["x"].double()
    scale = (x.abs().amax(-1) / FP8_MAX).clamp(min=MIN_SCALE)
    return ((x / scale[:, None]).clamp(-FP8_MAX, FP8_MAX), scale)


def eager(inputs: spec.Inputs) -> spec.Outputs:
    x = inputs["x"].float()
    scale = (x.abs().amax(-1) / FP8_MAX).clamp(min=MIN_SCALE)
    return ((x / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale)


def bytes_moved(shape: spec.Shape, dtype: torch.dtype) -> int:
    es = torch.empty((), dtype=dtype).element_size()
    return shape["tokens"] * shape["hidden"] * (es + 1) + 4 * shape["tokens"]



def fuzz(rng: random.Random) -> spec.Shape:
    return {"tokens": rng.randint(1, 9), "hidden": 16 * rng.randint(1, 40)}


def aot(dtype: str, config: spec.LaunchConfig) -> list[spec.AotSpec]:
    """One specialization per row-block width BLOCK_N (next power of 2 of hidden) across the domain."""
    cfg = _config(config)
    sig = {"x_ptr": spec.TRITON_DTYPES[dtype], "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "n_rows": "i32",
           "n_cols": "i32", "fp8_max": "fp32", "min_scale": "fp32", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "ROUND_IN_FP32": "constexpr"}
    rng = DOMAIN.dims["hidden"]
    blocks = sorted({_block_n(v) for v in (rng.lo, *(1 << k for k in range(4, 17)), rng.hi) if rng.lo <= v <= rng.hi})
    return [spec.AotSpec(_fp8_quant_fwd, sig, {"BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": b, "ROUND_IN_FP32": False},
                    num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]) for b in blocks]


DOMAIN = spec.Domain(
    dtypes=("fp16", "bf16", "fp32"),
    dims={"tokens": spec.DimRange(1, 1 << 20), "hidden": spec.DimRange(16, 16384, 16)},
    notes="x (tokens, hidden) contiguous; hidden <= 16384 (a row lives in registers), a multiple of 16 "
    "(16-byte fp8 rows); fp8 output needs sm_89+ on GPU (e4m3fn, saturating at +-448).",
)

_TOL = spec.Tolerance(2.0**-10, 2.0**-4 + 1e-4)
OP = spec.module_op(
    globals(),
    flops=lambda shape: 4 * shape["tokens"] * shape["hidden"],
    description="per-token dynamic FP8 e4m3 quantization: (q, scales) with x ~= q * scales[:, None]",
    tolerances={"fp32": _TOL, "fp16": _TOL, "bf16": _TOL},
    test_shapes=({"tokens": 3, "hidden": 48}, {"tokens": 6, "hidden": 1040}),
    decode_shapes=tuple({"tokens": t, "hidden": 4096} for t in (1, 16, 64, 256)),
    prefill_shapes=tuple({"tokens": t, "hidden": 4096} for t in (2048, 8192, 16384)),
)
