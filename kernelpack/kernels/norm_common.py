"""What every fused residual-add + norm op shares: the row tile (``residual_tile``), the host code, domain,
shapes and launch configs (:func:`make_norm_op`). Not an op itself: ``add_rmsnorm`` and ``add_layernorm`` import
it as a sibling module (a bundle carries it along, and a fault fixture that replaces one of them keeps it).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

import kernelpack.kernels.spec as spec

DEFAULT_CONFIG: dict[str, int] = {"BLOCK_M": 1, "num_warps": 8, "num_stages": 1}
# launch configs an arch-specific tuning sweep tries (scripts/bench-kernels --tune); all must be correct
TUNING_SPACE: list[dict[str, int]] = [{"BLOCK_M": m, "num_warps": w, "num_stages": 1} for m in (1, 2) for w in (4, 8, 16)]


@triton.jit
def residual_tile(x_ptr, r_ptr, h_ptr, n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's rows: loads x and residual, stores ``h = x + residual`` (rounded to h's dtype) and returns
    (h in fp32, offsets, mask, columns, column mask). Inlined into each norm kernel by the compiler."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < n_cols
    mask = (rows[:, None] < n_rows) & cmask[None, :]
    offs = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    h = (x + r).to(h_ptr.dtype.element_ty)
    tl.store(h_ptr + offs, h, mask=mask)
    return h.to(tl.float32), offs, mask, cols, cmask


ROW_SCALES = (1.0, 1e-2, 2e-3)  # magnitudes of the rows make_inputs draws, cycled over the tokens


def block_n(hidden: int) -> int:
    return max(16, triton.next_power_of_2(hidden))


# the per-column parameters a norm op may take: input name -> (kernel pointer argument, initial values)
PARAMS: dict[str, tuple[str, Callable[[torch.Tensor], torch.Tensor]]] = {
    "weight": ("w_ptr", lambda z: 1.0 + 0.1 * z),
    "bias": ("b_ptr", lambda z: 0.1 * z),
}


def eps_param(default: float) -> spec.Param:
    """The norm's eps, a run-time argument (Llama-3 checkpoints use 1e-5, Llama-2 and Qwen 1e-6, BERT 1e-12)."""
    return spec.Param(default=default, lo=1e-12, hi=0.1, samples=(default, 1e-5 if default != 1e-5 else 1e-6))


def make_norm_op(name: str, kernel: Any, eps: spec.Param, params: tuple[str, ...],
                 reference: Callable[[spec.Inputs], spec.Outputs], eager: Callable[[spec.Inputs], spec.Outputs],
                 **fields: Any) -> spec.KernelOp:
    """A fused residual-add + norm op: ``kernel(x, r, *params, y, h, n_rows, n_cols, eps, BLOCK_M, BLOCK_N)``
    with per-column ``params`` (keys of :data:`PARAMS`) and the run-time parameter ``eps`` (input ``"eps"``, a
    float; :func:`eps_param`), returning ``(y, h)``. ``fields``: the op's description, domain notes (``notes``),
    tolerances, ``bytes_moved`` and ``flops``."""

    def shape_of(inputs: spec.Inputs) -> spec.Shape:
        shape = spec.same_layout(name, {"x": inputs["x"], "residual": inputs["residual"]}, ("tokens", "hidden"))
        for p in params:  # (hidden,) vectors of x's dtype, on x's device
            t = inputs[p]
            if t.shape != (shape["hidden"],):
                raise spec.DomainError(f"{name}: {p} must have shape ({shape['hidden']},), got {tuple(t.shape)}")
            x = inputs["x"]
            if t.dtype != x.dtype or t.device != x.device:
                raise spec.DomainError(f"{name}: {p} ({t.dtype}, {t.device}) must match x ({x.dtype}, {x.device})")
        return shape

    def make_inputs(shape: spec.Shape, dtype: torch.dtype, device: torch.device,
                    gen: torch.Generator) -> spec.Inputs:
        t, h = shape["tokens"], shape["hidden"]
        g = gen.device
        # rows of three magnitudes: at 1e-2 and 2e-3 a row's mean square is near eps, so the output depends on
        # the eps the kernel is given (an op that ignored it would pass on unit-scale rows alone)
        scale = torch.tensor(ROW_SCALES, device=g)[torch.arange(t, device=g) % len(ROW_SCALES)][:, None]
        inputs = {k: (scale * torch.randn(t, h, generator=gen, device=g)).to(device, dtype) for k in ("x", "residual")}
        for p in params:
            inputs[p] = PARAMS[p][1](torch.randn(h, generator=gen, device=g)).to(device, dtype)
        return {**inputs, **spec.draw_params(domain, gen)}

    domain = spec.Domain(
        dtypes=("fp16", "bf16", "fp32"),
        dims={"tokens": spec.DimRange(1, 1 << 20), "hidden": spec.DimRange(8, 16384, 8)},
        notes=fields.pop("notes"),
        params={"eps": eps},
    )

    def run(inputs: spec.Inputs, outs: spec.Outputs, config: spec.LaunchConfig) -> None:
        cfg = spec.launch_config(name, DEFAULT_CONFIG, config)
        x = inputs["x"]
        domain.check(x.dtype, shape_of(inputs), inputs)
        y, h = outs
        spec.check_outputs(name, outs, x)
        t, n = x.shape
        bm = min(cfg["BLOCK_M"], triton.next_power_of_2(t))  # BLOCK_M is an upper bound: few tokens, fewer rows
        kernel[(triton.cdiv(t, bm),)](
            x, inputs["residual"], *(inputs[p] for p in params), y, h, t, n, domain.param(inputs, "eps"), BLOCK_M=bm,
            BLOCK_N=block_n(n), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )

    def aot(dtype: str, config: spec.LaunchConfig) -> list[spec.AotSpec]:
        """One specialization per row-block width BLOCK_N (next power of 2 of hidden) across the domain."""
        cfg = spec.launch_config(name, DEFAULT_CONFIG, config)
        p = spec.TRITON_DTYPES[dtype]
        sig = {"x_ptr": p, "r_ptr": p, **{PARAMS[k][0]: p for k in params}, "y_ptr": p, "h_ptr": p,
               "n_rows": "i32", "n_cols": "i32", "eps": "fp32", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr"}
        rng = domain.dims["hidden"]
        blocks = sorted({block_n(v) for v in (rng.lo, *(1 << k for k in range(3, 17)), rng.hi)
                         if rng.lo <= v <= rng.hi})
        return [spec.AotSpec(kernel, sig, {"BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": b},
                             num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]) for b in blocks]

    def alloc_outputs(inputs: spec.Inputs) -> spec.Outputs:
        return (torch.empty_like(inputs["x"]), torch.empty_like(inputs["x"]))

    def fuzz(rng: random.Random) -> spec.Shape:
        return {"tokens": rng.randint(1, 9), "hidden": 8 * rng.randint(1, 64)}

    return spec.module_op(
        {"NAME": name, "DOMAIN": domain, "DEFAULT_CONFIG": DEFAULT_CONFIG, "make_inputs": make_inputs,
         "shape_of": shape_of, "alloc_outputs": alloc_outputs, "run": run, "reference": reference, "eager": eager,
         "fuzz": fuzz, "aot": aot},
        test_shapes=({"tokens": 3, "hidden": 40}, {"tokens": 6, "hidden": 1032}),
        decode_shapes=tuple({"tokens": t, "hidden": 4096} for t in (1, 16, 64, 256)),
        prefill_shapes=tuple({"tokens": t, "hidden": 4096} for t in (2048, 8192, 16384)),
        **fields,
    )
