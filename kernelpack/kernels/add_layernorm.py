"""Fused residual add + LayerNorm: ``h = x + residual``; ``y = (h - mean) / sqrt(var + eps) * weight + bias``.

Owns op ``add_layernorm``: Triton kernel, float64 reference and eager PyTorch version, tolerances. Returns
``(y, h)`` like ``add_rmsnorm`` (h rounded to the input dtype is what gets normalized, as in the eager code);
eps is a run-time argument (input ``"eps"``, default 1e-5, the value older versions had fixed). The row
tile, host code, domain, shapes and launch configs are shared with
``add_rmsnorm`` in the sibling module ``norm_common`` (``make_norm_op``; a bundle carries it along).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import kernelpack.kernels.spec as spec

from . import norm_common as norm

NAME = "add_layernorm"
EPS = 1e-5  # the default eps (the value older versions had fixed)
DEFAULT_CONFIG = norm.DEFAULT_CONFIG
TUNING_SPACE = norm.TUNING_SPACE  # launch configs an arch-specific tuning sweep tries; all must be correct


@triton.jit
def _add_layernorm_fwd(x_ptr, r_ptr, w_ptr, b_ptr, y_ptr, h_ptr, n_rows, n_cols, eps,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    hf, offs, mask, cols, cmask = norm.residual_tile(x_ptr, r_ptr, h_ptr, n_rows, n_cols, BLOCK_M, BLOCK_N)
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


def reference(inputs: spec.Inputs) -> spec.Outputs:
    h = inputs["x"].double() + inputs["residual"].double()
    d = h - h.mean(-1, keepdim=True)
    y = d * torch.rsqrt(d.pow(2).mean(-1, keepdim=True) + DOMAIN.param(inputs, "eps")) * inputs["weight"].double()
    y = y + inputs["bias"].double()
    return (y, h)


def eager(inputs: spec.Inputs) -> spec.Outputs:
    h = inputs["x"] + inputs["residual"]
    y = torch.nn.functional.layer_norm(h, (h.shape[-1],), inputs["weight"], inputs["bias"],
                                       DOMAIN.param(inputs, "eps"))
    return (y, h)


OP = norm.make_norm_op(
    NAME, _add_layernorm_fwd, norm.eps_param(EPS), ("weight", "bias"), reference, eager,
    description="h = x + residual; y = layernorm(h) * weight + bias; returns (y, h) in one pass",
    notes="x, residual (tokens, hidden), weight and bias (hidden,) of one dtype, contiguous; hidden <= 16384 "
    "(a row lives in registers) and a multiple of 8; eps a run-time float in [1e-12, 0.1] (default 1e-5); "
    "biased variance as torch.layer_norm.",
    tolerances={"fp32": spec.Tolerance(1e-5, 1e-5), "fp16": spec.Tolerance(2e-3, 2e-3),
                "bf16": spec.Tolerance(1.6e-2, 1.6e-2)},
    bytes_moved=lambda shape, dtype: (4 * shape["tokens"] * shape["hidden"] + 2 * shape["hidden"])
    * torch.empty((), dtype=dtype).element_size(),
    flops=lambda shape: 8 * shape["tokens"] * shape["hidden"],
)
DOMAIN = OP.domain
