"""Fused bias add + GELU, tanh approximation: ``y = gelu_tanh(x + bias)`` over a (tokens, hidden) activation.

Owns op ``bias_gelu_tanh``: its Triton kernel, float64 reference and eager PyTorch version. The host code,
domain, shapes, launch configs and the bytes/flops model are those of the exact erf form, op ``bias_gelu``
(module ``bias_gelu``, imported as a sibling: a bundle carries it along), through ``bias_gelu.make_op``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernelpack.kernels.spec import Inputs, Outputs, Tolerance

from . import bias_gelu as base

NAME = "bias_gelu_tanh"
DEFAULT_CONFIG = base.DEFAULT_CONFIG
TUNING_SPACE = base.TUNING_SPACE  # launch configs an arch-specific tuning sweep tries; all must be correct


@triton.jit
def _bias_gelu_tanh_fwd(x_ptr, b_ptr, y_ptr, n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < n_cols
    mask = (rows[:, None] < n_rows) & cmask[None, :]
    offs = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    h = x + b[None, :]
    u = 0.7978845608028654 * (h + 0.044715 * h * h * h)
    th = 1.0 - tl.math.fdiv(2.0, tl.exp(2.0 * u) + 1.0)  # approximate (2 ulp) division
    y = 0.5 * h * (1.0 + th)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def reference(inputs: Inputs) -> Outputs:
    h = inputs["x"].double() + inputs["bias"].double()
    u = (2.0 / torch.pi) ** 0.5 * (h + 0.044715 * h**3)
    return (0.5 * h * (1.0 + torch.tanh(u)),)


def eager(inputs: Inputs) -> Outputs:
    return (torch.nn.functional.gelu(inputs["x"] + inputs["bias"], approximate="tanh"),)


OP = base.make_op(
    NAME, _bias_gelu_tanh_fwd, reference, eager,
    description="y = gelu_tanh(x + bias), one read of x and one write of y",
    form="tanh form of GELU computed in fp32 (tanh via exp)",
    tolerances={"fp32": Tolerance(1e-5, 1e-5), "fp16": Tolerance(1e-3, 2e-3), "bf16": Tolerance(8e-3, 1.6e-2)},
)
DOMAIN = OP.domain
