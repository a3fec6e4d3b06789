"""Rotary position embedding (NeoX / rotate-half form) of q and k in one launch.

Owns op ``rope``: Triton kernel, float64 reference, eager PyTorch version, domain and tolerances.
Inputs: q (tokens, q_heads, head_dim), k (tokens, kv_heads, head_dim), and per-token tables cos, sin of shape
(tokens, head_dim // 2) in the input dtype, already gathered at each token's position (callers index their
cos/sin cache by position ids first). With x = [x1, x2] split in halves:
``out = [x1*cos - x2*sin, x2*cos + x1*sin]``. Out-of-place: returns (q_out, k_out). q and k are seen as rows
of head_dim (token * heads + head); each program rotates BLOCK_R consecutive rows of q or of k (one
contiguous span of memory; the first programs q, the rest k, one launch), reading each row's cos/sin row of
its token (cached: consecutive rows share a token). Imports only torch, triton and ``kernelpack.kernels.spec``.
"""

from __future__ import annotations

import functools
import random

import torch
import triton
import triton.language as tl

import kernelpack.kernels.spec as spec

NAME = "rope"
DEFAULT_CONFIG: dict[str, int] = {"BLOCK_R": 32, "num_warps": 4, "num_stages": 1}
# launch configs an arch-specific tuning sweep tries (scripts/bench-kernels --tune); all must be correct
TUNING_SPACE: list[dict[str, int]] = [{"BLOCK_R": r, "num_warps": w, "num_stages": 1}
                                     for r, w in ((32, 4), (16, 4), (64, 4), (64, 8), (16, 2), (32, 8), (128, 8))]


@triton.jit
def _rotate_rows(x_ptr, o_ptr, cos_ptr, sin_ptr, row0, n_rows, n_heads, half,
                 BLOCK_R: tl.constexpr, HALF_P2: tl.constexpr):
    """Rows row0.. of x (tokens * heads, 2 * half), rotate-half form: ``o = x * cos + rotate_half(x) * sin``
    (fp32 math), with the cos/sin row of each row's token."""
    r = row0 + tl.arange(0, BLOCK_R)
    d = tl.arange(0, HALF_P2)
    m = (r < n_rows)[:, None] & (d < half)[None, :]
    tab = (r // n_heads).to(tl.int64)[:, None] * half + d[None, :]
    c = tl.load(cos_ptr + tab, mask=m, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + tab, mask=m, other=0.0).to(tl.float32)
    offs = r.to(tl.int64)[:, None] * (2 * half) + d[None, :]
    x1 = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + offs + half, mask=m, other=0.0).to(tl.float32)
    tl.store(o_ptr + offs, (x1 * c - x2 * s).to(o_ptr.dtype.element_ty), mask=m)
    tl.store(o_ptr + offs + half, (x2 * c + x1 * s).to(o_ptr.dtype.element_ty), mask=m)


@triton.jit
def _rope_fwd(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, n_tokens, n_qh, n_kh, half, q_programs,
              BLOCK_R: tl.constexpr, HALF_P2: tl.constexpr):
    pid = tl.program_id(0)
    if pid < q_programs:
        _rotate_rows(q_ptr, qo_ptr, cos_ptr, sin_ptr, pid * BLOCK_R, n_tokens * n_qh, n_qh, half,
                     BLOCK_R=BLOCK_R, HALF_P2=HALF_P2)
    else:
        _rotate_rows(k_ptr, ko_ptr, cos_ptr, sin_ptr, (pid - q_programs) * BLOCK_R, n_tokens * n_kh, n_kh, half,
                     BLOCK_R=BLOCK_R, HALF_P2=HALF_P2)


_config = functools.partial(spec.launch_config, NAME, DEFAULT_CONFIG)  # validated launch config of a call


def shape_of(inputs: spec.Inputs) -> spec.Shape:
    q, k, c, s = inputs["q"], inputs["k"], inputs["cos"], inputs["sin"]
    if q.dim() != 3 or k.dim() != 3:
        raise spec.DomainError(f"{NAME}: q and k must be 3-D (tokens, heads, head_dim), got {tuple(q.shape)}, "
                          f"{tuple(k.shape)}")
    t, _, d = q.shape
    if k.shape[0] != t or k.shape[2] != d:
        raise spec.DomainError(f"{NAME}: k {tuple(k.shape)} must have q's tokens and head_dim {(t, d)}")
    if d % 2:
        raise spec.DomainError(f"{NAME}: head_dim={d} must be even")
    for name, tab in (("cos", c), ("sin", s)):
        if tab.shape != (t, d // 2):
            raise spec.DomainError(f"{NAME}: {name} must have shape (tokens, head_dim // 2) = {(t, d // 2)}, "
                              f"got {tuple(tab.shape)}")
    for name, x in (("k", k), ("cos", c), ("sin", s)):
        if x.dtype != q.dtype or x.device != q.device:
            raise spec.DomainError(f"{NAME}: {name} ({x.dtype}, {x.device}) must match q ({q.dtype}, {q.device})")
    return {"tokens": t, "q_heads": q.shape[1], "kv_heads": k.shape[1], "head_dim": d}


def make_inputs(shape: spec.Shape, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> spec.Inputs:
    t, d = shape["tokens"], shape["head_dim"]
    g = gen.device
    pos = torch.randint(0, 32768, (t, 1), generator=gen, device=g).double()
    inv_freq = 10000.0 ** (-torch.arange(0, d // 2, device=g).double() * 2 / d)
    ang = pos * inv_freq[None, :]
    return {
        "q": torch.randn(t, shape["q_heads"], d, generator=gen, device=g).to(device, dtype),
        "k": torch.randn(t, shape["kv_heads"], d, generator=gen, device=g).to(device, dtype),
        "cos": torch.cos(ang).to(device, dtype),
        "sin": torch.sin(ang).to(device, dtype),
    }


def llama3_inv_freq(head_dim: int, theta: float = 500000.0, factor: float = 8.0, low: float = 1.0,
                    high: float = 4.0, original: int = 8192) -> torch.Tensor:
    """Llama-3's rotary frequencies (``rope_scaling = {"rope_type": "llama3", ...}``, float64): long wavelengths
    divided by ``factor``, short ones kept, the band between smoothed. Scaling and theta only change the tables
    a caller passes (transformers computes them), so the kernel takes any of them; the op's edge inputs use
    these so that a trial checks Llama-3's tables at positions up to 128k."""
    inv = theta ** (-torch.arange(0, head_dim // 2, dtype=torch.float64) * 2 / head_dim)
    wavelen = 2 * torch.pi / inv
    scaled = torch.where(wavelen > original / low, inv / factor, inv)
    smooth = (original / wavelen - low) / (high - low)
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


def edge_inputs(shape: spec.Shape, dtype: torch.dtype, device: torch.device,
                gen: torch.Generator) -> list[tuple[str, spec.Inputs]]:
    """Llama-3 tables (theta 500000, llama3 scaling) at the last positions of a 128k context."""
    inputs = make_inputs(shape, dtype, device, gen)
    pos = torch.arange(131072 - shape["tokens"], 131072, dtype=torch.float64)[:, None]
    ang = pos * llama3_inv_freq(shape["head_dim"])[None, :]
    return [("llama3_tables", {**inputs, "cos": torch.cos(ang).to(device, dtype),
                               "sin": torch.sin(ang).to(device, dtype)})]


def alloc_outputs(inputs: spec.Inputs) -> spec.Outputs:
    return (torch.empty_like(inputs["q"]), torch.empty_like(inputs["k"]))


def run(inputs: spec.Inputs, outs: spec.Outputs, config: spec.LaunchConfig) -> None:
    cfg = _config(config)
    q, k, c, s = inputs["q"], inputs["k"], inputs["cos"], inputs["sin"]
    DOMAIN.check(q.dtype, shape_of(inputs), inputs)
    qo, ko = outs
    for o, x in ((qo, q), (ko, k)):
        if o.shape != x.shape or o.dtype != x.dtype or not o.is_contiguous():
            raise ValueError(f"{NAME}: outputs must be contiguous {x.dtype} tensors shaped like q and k")
    t, hq, d = q.shape
    br = cfg["BLOCK_R"]
    q_programs = triton.cdiv(t * hq, br)
    _rope_fwd[(q_programs + triton.cdiv(t * k.shape[1], br),)](
        q, k, c, s, qo, ko, t, hq, k.shape[1], d // 2, q_programs,
        BLOCK_R=br, HALF_P2=triton.next_power_of_2(d // 2),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


def _rotate(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    c, s = c[:, None, :], s[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def reference(inputs: spec.Inputs) -> spec.Outputs:
    q, k, c, s = (inputs[n].double() for n in ("q", "k", "cos", "sin"))
    return (_rotate(q, c, s), _rotate(k, c, s))


def eager(inputs: spec.Inputs) -> spec.Outputs:
    c, s = inputs["cos"], inputs["sin"]
    return (_rotate(inputs["q"], c, s), _rotate(inputs["k"], c, s))


def bytes_moved(shape: spec.Shape, dtype: torch.dtype) -> int:
    t, d = shape["tokens"], shape["head_dim"]
    es = torch.empty((), dtype=dtype).element_size()
    return (2 * t * (shape["q_heads"] + shape["kv_heads"]) * d + t * d) * es


def flops(shape: spec.Shape) -> int:
    return 3 * shape["tokens"] * (shape["q_heads"] + shape["kv_heads"]) * shape["head_dim"]


def fuzz(rng: random.Random) -> spec.Shape:
    kv = rng.randint(1, 4)
    return {"tokens": rng.randint(1, 6), "q_heads": kv * rng.randint(1, 5), "kv_heads": kv,
            "head_dim": 16 * rng.randint(1, 8)}


def aot(dtype: str, config: spec.LaunchConfig) -> list[spec.AotSpec]:
    """One specialization per half-head-dim width HALF_P2 across the domain."""
    cfg = _config(config)
    p = spec.TRITON_DTYPES[dtype]
    sig = {"q_ptr": p, "k_ptr": p, "cos_ptr": p, "sin_ptr": p, "qo_ptr": p, "ko_ptr": p, "n_tokens": "i32",
           "n_qh": "i32", "n_kh": "i32", "half": "i32", "q_programs": "i32",
           "BLOCK_R": "constexpr", "HALF_P2": "constexpr"}
    rng = DOMAIN.dims["head_dim"]
    halves = sorted({triton.next_power_of_2(v // 2) for v in range(rng.lo, rng.hi + 1, rng.multiple_of)})
    return [spec.AotSpec(_rope_fwd, sig, {"BLOCK_R": cfg["BLOCK_R"], "HALF_P2": h},
                    num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]) for h in halves]


DOMAIN = spec.Domain(
    dtypes=("fp16", "bf16", "fp32"),
    dims={"tokens": spec.DimRange(1, 1 << 20), "q_heads": spec.DimRange(1, 256), "kv_heads": spec.DimRange(1, 256),
          "head_dim": spec.DimRange(16, 512, 16)},
    notes="q (tokens, q_heads, head_dim), k (tokens, kv_heads, head_dim), cos/sin (tokens, head_dim/2), one "
    "dtype, contiguous; NeoX rotate-half layout over the whole head_dim (no partial rotary).",
)

OP = spec.module_op(
    globals(),
    description="rotary embedding of q and k (rotate-half form) in one launch, out-of-place",
    edge_inputs=edge_inputs,
    tolerances={"fp32": spec.Tolerance(1e-5, 1e-5), "fp16": spec.Tolerance(2e-3, 2e-3), "bf16": spec.Tolerance(1.6e-2, 1.6e-2)},
    test_shapes=({"tokens": 3, "q_heads": 4, "kv_heads": 2, "head_dim": 32},
                 {"tokens": 2, "q_heads": 20, "kv_heads": 20, "head_dim": 48}),
    decode_shapes=tuple({"tokens": t, "q_heads": 32, "kv_heads": 8, "head_dim": 128} for t in (1, 16, 64, 256)),
    prefill_shapes=tuple({"tokens": t, "q_heads": 32, "kv_heads": 8, "head_dim": 128} for t in (2048, 8192, 16384)),
)
