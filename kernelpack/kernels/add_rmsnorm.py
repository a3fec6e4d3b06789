"""Fused residual add + RMSNorm: ``h = x + residual``; ``y = h / sqrt(mean(h^2) + eps) * weight``.

Owns op ``add_rmsnorm``: Triton kernel, float64 reference, eager PyTorch version and tolerances. Returns
``(y, h)``: the normalized output and the updated residual (h rounded to the input dtype, which is also what
gets normalized, as in vLLM's fused_add_rms_norm). eps is a run-time argument (input ``"eps"``, default 1e-6;
an older bundle's op, which had it fixed at 1e-6, serves only that value). Each program holds whole rows in
registers (one read of x and residual, one write of y and h). The row tile, host code, domain, shapes and
launch configs are shared with ``add_layernorm`` in the sibling module ``norm_common``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

import kernelpack.kernels.spec as spec

from . import norm_common

NAME = "add_rmsnorm"
EPS = 1e-6  # the default eps (the value older versions had fixed)
DEFAULT_CONFIG = norm_common.DEFAULT_CONFIG
TUNING_SPACE = norm_common.TUNING_SPACE  # launch configs an arch-specific tuning sweep tries; all must be correct


@triton.jit
def _add_rmsnorm_fwd(x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, n_rows, n_cols, eps,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    hf, offs, mask, cols, cmask = norm_common.residual_tile(x_ptr, r_ptr, h_ptr, n_rows, n_cols, BLOCK_M, BLOCK_N)
    var = tl.sum(hf * hf, axis=1) / n_cols
    rstd = 1.0 / tl.sqrt(var + eps)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    y = hf * rstd[:, None] * w[None, :]
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


_config = functools.partial(spec.launch_config, NAME, DEFAULT_CONFIG)  # validated launch config of a call


_block_n = norm_common.block_n


def reference(inputs: spec.Inputs) -> spec.Outputs:
    h = inputs["x"].double() + inputs["residual"].double()
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + DOMAIN.param(inputs, "eps")) * inputs["weight"].double()
    return (y, h)


def eager(inputs: spec.Inputs) -> spec.Outputs:
    h = inputs["x"] + inputs["residual"]
    hf = h.float()
    y = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + DOMAIN.param(inputs, "eps"))).to(h.dtype) * inputs["weight"]
    return (y, h)


OP = norm_common.make_norm_op(
    NAME, _add_rmsnorm_fwd, norm_common.eps_param(EPS), ("weight",), reference, eager,
    description="h = x + residual; y = rmsnorm(h) * weight; returns (y, h) in one pass",
    notes="x, residual (tokens, hidden) and weight (hidden,) of one dtype, contiguous; hidden <= 16384 "
    "(a row lives in registers) and a multiple of 8; eps a run-time float in [1e-12, 0.1] (default 1e-6).",
    tolerances={"fp32": spec.Tolerance(1e-5, 1e-5), "fp16": spec.Tolerance(2e-3, 2e-3),
                "bf16": spec.Tolerance(1.6e-2, 1.6e-2)},
    bytes_moved=lambda shape, dtype: (4 * shape["tokens"] * shape["hidden"] + shape["hidden"])
    * torch.empty((), dtype=dtype).element_size(),
    flops=lambda shape: 5 * shape["tokens"] * shape["hidden"],
)
DOMAIN = OP.domain
shape_of, make_inputs, alloc_outputs, run, aot = OP.shape_of, OP.make_inputs, OP.alloc_outputs, OP.run, OP.aot
