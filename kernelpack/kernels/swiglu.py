"""Fused SwiGLU: ``y = silu(gate) * up`` over two (tokens, hidden) tensors.

Owns op ``swiglu``: Triton kernel, float64 reference, eager PyTorch version, domain and tolerances. gate and
up are separate contiguous tensors (Liger's layout); an elementwise kernel over the flattened tensors with
one read of each and one write of y. Imports only torch, triton and ``kernelpack.kernels.spec``.
"""

from __future__ import annotations

import functools
import random

import torch
import triton
import triton.language as tl

import kernelpack.kernels.spec as spec

NAME = "swiglu"
DEFAULT_CONFIG: dict[str, int] = {"BLOCK": 2048, "num_warps": 8, "num_stages": 1}
# launch configs an arch-specific tuning sweep tries (scripts/bench-kernels --tune); all must be correct
TUNING_SPACE: list[dict[str, int]] = [{"BLOCK": b, "num_warps": w, "num_stages": 1} for b, w in ((2048, 8), (1024, 4), (2048, 4), (4096, 8), (512, 2), (1024, 2), (512, 4))]


@triton.jit
def _swiglu_fwd(g_ptr, u_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


_config = functools.partial(spec.launch_config, NAME, DEFAULT_CONFIG)  # validated launch config of a call


def shape_of(inputs: spec.Inputs) -> spec.Shape:
    return spec.same_layout(NAME, {"gate": inputs["gate"], "up": inputs["up"]}, ("tokens", "hidden"))


def make_inputs(shape: spec.Shape, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> spec.Inputs:
    t, h = shape["tokens"], shape["hidden"]
    return {
        "gate": (2.0 * torch.randn(t, h, generator=gen, device=gen.device)).to(device, dtype),
        "up": torch.randn(t, h, generator=gen, device=gen.device).to(device, dtype),
    }


def alloc_outputs(inputs: spec.Inputs) -> spec.Outputs:
    return (torch.empty_like(inputs["gate"]),)


def run(inputs: spec.Inputs, outs: spec.Outputs, config: spec.LaunchConfig) -> None:
    g, u = inputs["gate"], inputs["up"]
    DOMAIN.check(g.dtype, shape_of(inputs), inputs)
    spec.check_outputs(NAME, outs, g)
    cfg, n = _config(config), g.numel()
    _swiglu_fwd[(triton.cdiv(n, cfg["BLOCK"]),)](
        g, u, outs[0], n, BLOCK=cfg["BLOCK"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]
    )


def reference(inputs: spec.Inputs) -> spec.Outputs:
    g, u = inputs["gate"].double(), inputs["up"].double()
    return (g * torch.sigmoid(g) * u,)


def eager(inputs: spec.Inputs) -> spec.Outputs:
    return (torch.nn.functional.silu(inputs["gate"]) * inputs["up"],)


def bytes_moved(shape: spec.Shape, dtype: torch.dtype) -> int:
    return 3 * shape["tokens"] * shape["hidden"] * torch.empty((), dtype=dtype).element_size()



def fuzz(rng: random.Random) -> spec.Shape:
    return {"tokens": rng.randint(1, 9), "hidden": 8 * rng.randint(1, 300)}


def aot(dtype: str, config: spec.LaunchConfig) -> list[spec.AotSpec]:
    cfg = _config(config)
    p = spec.TRITON_DTYPES[dtype]
    sig = {"g_ptr": p, "u_ptr": p, "y_ptr": p, "n": "i32", "BLOCK": "constexpr"}
    return [spec.AotSpec(_swiglu_fwd, sig, {"BLOCK": cfg["BLOCK"]}, num_warps=cfg["num_warps"],
                    num_stages=cfg["num_stages"])]


DOMAIN = spec.Domain(
    dtypes=("fp16", "bf16", "fp32"),
    dims={"tokens": spec.DimRange(1, 1 << 20), "hidden": spec.DimRange(8, 65536, 8)},
    notes="gate and up (tokens, hidden) of one dtype, contiguous, tokens*hidden < 2**31; hidden a multiple of 8.",
)

OP = spec.module_op(
    globals(),
    flops=lambda shape: 5 * shape["tokens"] * shape["hidden"],
    description="y = silu(gate) * up, one read of each input and one write",
    tolerances={"fp32": spec.Tolerance(1e-5, 1e-5), "fp16": spec.Tolerance(1e-3, 2e-3), "bf16": spec.Tolerance(8e-3, 1.6e-2)},
    test_shapes=({"tokens": 3, "hidden": 40}, {"tokens": 5, "hidden": 1032}),
    decode_shapes=tuple({"tokens": t, "hidden": 14336} for t in (1, 16, 64, 256)),
    prefill_shapes=tuple({"tokens": t, "hidden": 14336} for t in (2048, 8192, 16384)),
)
