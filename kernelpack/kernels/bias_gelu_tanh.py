"""Fused bias add + GELU, tanh approximation: ``y = gelu_tanh(x + bias)`` over a (tokens, hidden) activation.

Owns op ``bias_gelu_tanh``: its Triton kernel, float64 reference and eager PyTorch version. The host code,
domain, shapes, launch configs and the bytes/flops model are shared with the exact erf form, op
``bias_gelu``, in the sibling module ``gelu_common`` (``make_op``; a bundle carries it along).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import kernelpack.kernels.spec as spec

from . import gelu_common as base

NAME = "bias_gelu_tanh"
DEFAULT_CONFIG, TUNING_SPACE = base.DEFAULT_CONFIG, base.TUNING_SPACE  # the erf form's launch configs


@triton.jit
def _bias_gelu_tanh_fwd(x_ptr, b_ptr, y_ptr, n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    h, offs, mask = base.biased_tile(x_ptr, b_ptr, n_rows, n_cols, BLOCK_M, BLOCK_N)
    u = 0.7978845608028654 * (h + 0.044715 * h * h * h)
    th = 1.0 - tl.math.fdiv(2.0, tl.exp(2.0 * u) + 1.0)  # approximate (2 ulp) division
    y = 0.5 * h * (1.0 + th)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def reference(inputs: spec.Inputs) -> spec.Outputs:
    h = inputs["x"].double() + inputs["bias"].double()
    u = (2.0 / torch.pi) ** 0.5 * (h + 0.044715 * h**3)
    return (0.5 * h * (1.0 + torch.tanh(u)),)


def eager(inputs: spec.Inputs) -> spec.Outputs:
    return (torch.nn.functional.gelu(inputs["x"] + inputs["bias"], approximate="tanh"),)


OP = base.make_op(
    NAME, _bias_gelu_tanh_fwd, reference, eager,
    description="y = gelu_tanh(x + bias), one read of x and one write of y",
    form="tanh form of GELU computed in fp32 (tanh via exp)",
)
