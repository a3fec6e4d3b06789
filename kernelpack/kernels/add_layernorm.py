"""Fused residual add + LayerNorm: ``h = x + residual``; ``y = (h - mean) / sqrt(var + eps) * weight + bias``.

Owns op ``add_layernorm``: Triton kernel, float64 reference, eager PyTorch version, domain and tolerances.
Returns ``(y, h)``: the normalized output and the updated residual (h rounded to the input dtype, which is
also what gets normalized, as in the eager code). eps is fixed at 1e-5. Each program holds whole
rows in registers (one read of x and residual, one write of y and h). Self-contained bundle module.
"""

from __future__ import annotations

import random

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
    LaunchConfig,
    Outputs,
    Shape,
    Tolerance,
    launch_config,
    module_op,
)

NAME = "add_layernorm"
EPS = 1e-5
DEFAULT_CONFIG: dict[str, int] = {"BLOCK_M": 1, "num_warps": 8, "num_stages": 1}
# launch configs an arch-specific tuning sweep tries (scripts/bench-kernels --tune); all must be correct
TUNING_SPACE: list[dict[str, int]] = [{"BLOCK_M": m, "num_warps": w, "num_stages": 1} for m in (1, 2) for w in (4, 8, 16)]


@triton.jit
def _add_layernorm_fwd(x_ptr, r_ptr, w_ptr, b_ptr, y_ptr, h_ptr, n_rows, n_cols, eps,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < n_cols
    mask = (rows[:, None] < n_rows) & cmask[None, :]
    offs = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    h = (x + r).to(h_ptr.dtype.element_ty)
    tl.store(h_ptr + offs, h, mask=mask)
    hf = h.to(tl.float32)
    # Statistics of the row scaled by its largest magnitude, so that rows near the dtype's limits neither
    # overflow the sum nor the squares (y = d_s / sqrt(var_s + eps / scale^2), exactly the unscaled formula).
    amax = tl.max(tl.where(mask, tl.abs(hf), 0.0), axis=1)
    scale = tl.where(amax > 0.0, amax, 1.0)
    hs = hf / scale[:, None]
    mean = tl.sum(tl.where(mask, hs, 0.0), axis=1) / n_cols
    d = tl.where(mask, hs - mean[:, None], 0.0)
    var = tl.sum(d * d, axis=1) / n_cols
    rstd = 1.0 / tl.sqrt(var + eps / (scale * scale))
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    y = d * rstd[:, None] * w[None, :] + b[None, :]
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def _config(config: LaunchConfig) -> dict[str, int]:
    return launch_config(NAME, DEFAULT_CONFIG, config)


def shape_of(inputs: Inputs) -> Shape:
    x, r, w, b = inputs["x"], inputs["residual"], inputs["weight"], inputs["bias"]
    if x.dim() != 2:
        raise DomainError(f"{NAME}: x must be 2-D (tokens, hidden), got shape {tuple(x.shape)}")
    if r.shape != x.shape:
        raise DomainError(f"{NAME}: residual shape {tuple(r.shape)} must equal x shape {tuple(x.shape)}")
    if w.shape != (x.shape[1],):
        raise DomainError(f"{NAME}: weight must have shape ({x.shape[1]},), got {tuple(w.shape)}")
    if b.shape != (x.shape[1],):
        raise DomainError(f"{NAME}: bias must have shape ({x.shape[1]},), got {tuple(b.shape)}")
    for name, t in (("residual", r), ("weight", w), ("bias", b)):
        if t.dtype != x.dtype or t.device != x.device:
            raise DomainError(f"{NAME}: {name} ({t.dtype}, {t.device}) must match x ({x.dtype}, {x.device})")
    return {"tokens": x.shape[0], "hidden": x.shape[1]}


def make_inputs(shape: Shape, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> Inputs:
    t, h = shape["tokens"], shape["hidden"]
    g = gen.device
    return {
        "x": torch.randn(t, h, generator=gen, device=g).to(device, dtype),
        "residual": torch.randn(t, h, generator=gen, device=g).to(device, dtype),
        "weight": (1.0 + 0.1 * torch.randn(h, generator=gen, device=g)).to(device, dtype),
        "bias": (0.1 * torch.randn(h, generator=gen, device=g)).to(device, dtype),
    }


def alloc_outputs(inputs: Inputs) -> Outputs:
    return (torch.empty_like(inputs["x"]), torch.empty_like(inputs["x"]))


def _block_n(hidden: int) -> int:
    return max(16, triton.next_power_of_2(hidden))


def run(inputs: Inputs, outs: Outputs, config: LaunchConfig) -> None:
    cfg = _config(config)
    x, r, w, b = inputs["x"], inputs["residual"], inputs["weight"], inputs["bias"]
    DOMAIN.check(x.dtype, shape_of(inputs), inputs)
    y, h = outs
    for o in outs:
        if o.shape != x.shape or o.dtype != x.dtype or not o.is_contiguous():
            raise ValueError(f"{NAME}: outputs must be contiguous {x.dtype} tensors of shape {tuple(x.shape)}")
    t, n = x.shape
    bm = min(cfg["BLOCK_M"], triton.next_power_of_2(t))  # BLOCK_M is an upper bound: few tokens, fewer rows
    _add_layernorm_fwd[(triton.cdiv(t, bm),)](
        x, r, w, b, y, h, t, n, EPS, BLOCK_M=bm, BLOCK_N=_block_n(n),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


def reference(inputs: Inputs) -> Outputs:
    h = inputs["x"].double() + inputs["residual"].double()
    d = h - h.mean(-1, keepdim=True)
    y = d * torch.rsqrt(d.pow(2).mean(-1, keepdim=True) + EPS) * inputs["weight"].double()
    y = y + inputs["bias"].double()
    return (y, h)


def eager(inputs: Inputs) -> Outputs:
    h = inputs["x"] + inputs["residual"]
    y = torch.nn.functional.layer_norm(h, (h.shape[-1],), inputs["weight"], inputs["bias"], EPS)
    return (y, h)


def bytes_moved(shape: Shape, dtype: torch.dtype) -> int:
    es = torch.empty((), dtype=dtype).element_size()
    return (4 * shape["tokens"] * shape["hidden"] + 2 * shape["hidden"]) * es


def flops(shape: Shape) -> int:
    return 8 * shape["tokens"] * shape["hidden"]


def fuzz(rng: random.Random) -> Shape:
    return {"tokens": rng.randint(1, 9), "hidden": 8 * rng.randint(1, 64)}


def aot(dtype: str, config: LaunchConfig) -> list[AotSpec]:
    """One specialization per row-block width BLOCK_N (next power of 2 of hidden) across the domain."""
    cfg = _config(config)
    p = TRITON_DTYPES[dtype]
    sig = {"x_ptr": p, "r_ptr": p, "w_ptr": p, "b_ptr": p, "y_ptr": p, "h_ptr": p, "n_rows": "i32", "n_cols": "i32",
           "eps": "fp32", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr"}
    rng = DOMAIN.dims["hidden"]
    blocks = sorted({_block_n(v) for v in (rng.lo, *(1 << k for k in range(3, 17)), rng.hi) if rng.lo <= v <= rng.hi})
    return [AotSpec(_add_layernorm_fwd, sig, {"BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": b},
                    num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]) for b in blocks]


DOMAIN = Domain(
    dtypes=("fp16", "bf16", "fp32"),
    dims={"tokens": DimRange(1, 1 << 20), "hidden": DimRange(8, 16384, 8)},
    notes="x, residual (tokens, hidden), weight and bias (hidden,) of one dtype, contiguous; hidden <= 16384 "
    "(a row lives in registers) and a multiple of 8; eps = 1e-5; biased variance as torch.layer_norm.",
)

OP = module_op(
    globals(),
    description="h = x + residual; y = layernorm(h) * weight + bias; returns (y, h) in one pass",
    tolerances={"fp32": Tolerance(1e-5, 1e-5), "fp16": Tolerance(2e-3, 2e-3), "bf16": Tolerance(1.6e-2, 1.6e-2)},
    test_shapes=({"tokens": 3, "hidden": 40}, {"tokens": 6, "hidden": 1032}),
    decode_shapes=tuple({"tokens": t, "hidden": 4096} for t in (1, 16, 64, 256)),
    prefill_shapes=tuple({"tokens": t, "hidden": 4096} for t in (2048, 8192, 16384)),
)
