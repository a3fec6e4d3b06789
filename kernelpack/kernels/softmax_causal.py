"""Fused scale + causal mask + softmax over attention scores of shape (batch*heads, q, k).

Owns op ``softmax_causal``: Triton kernel, float64 reference, eager PyTorch version, domain and tolerances.
``y[b, i, j] = softmax_j(scale * s[b, i, j])`` over keys ``j <= i + (k - q)`` (bottom-right aligned causal
mask, as with a KV cache; k >= q), and 0 for masked keys. The mask is computed from indices: no mask tensor,
and masked scores are not read (past the causal limit, at most the 7 of its 16-byte vector). ``scale``
is a 0-d float32 tensor input (no host sync). One row per
program, held in registers (k <= 16384), or streamed in pieces (launch config ``CHUNK`` for every row,
``WIDE_CHUNK`` for rows wider than ``WIDE``). Imports only torch, triton and ``kernelpack.kernels.spec``.
"""

from __future__ import annotations

import functools
import random

import torch
import triton
import triton.language as tl

import kernelpack.kernels.spec as spec

NAME = "softmax_causal"
# CHUNK 1: a row held in registers (one pass); CHUNK > 1: the row streamed in CHUNK-wide pieces, two passes
# (running max and sum, then normalise and store; the second read of a row mostly hits L2), small programs
# WIDE_WARPS: num_warps for rows wider than WIDE (8192) columns; WIDE_CHUNK > 1: those rows streamed in
# WIDE_CHUNK-wide pieces (a register-resident 16k row fits two programs per SM: too few bytes in flight on an H200)
WIDE = 8192
DEFAULT_CONFIG: dict[str, int] = {"BLOCK_M": 1, "CHUNK": 1, "WIDE_CHUNK": 1, "WIDE_WARPS": 8, "num_warps": 8,
                                  "num_stages": 1}
# launch configs an arch-specific tuning sweep tries (scripts/bench-kernels --tune); all must be correct
TUNING_SPACE: list[dict[str, int]] = (
    [{"BLOCK_M": m, "CHUNK": 1, "WIDE_CHUNK": 1, "WIDE_WARPS": w, "num_warps": w, "num_stages": 1}
     for m in (1, 2) for w in (4, 8, 16)]
    + [{"BLOCK_M": 1, "CHUNK": 1, "WIDE_CHUNK": 1, "WIDE_WARPS": 16, "num_warps": 4, "num_stages": 1}]
    + [{"BLOCK_M": 1, "CHUNK": 1, "WIDE_CHUNK": c, "WIDE_WARPS": w, "num_warps": 4, "num_stages": st}
       for c, w, st in ((2048, 4, 3), (2048, 8, 1), (4096, 8, 1), (4096, 8, 3))]
    + [{"BLOCK_M": 1, "CHUNK": c, "WIDE_CHUNK": 1, "WIDE_WARPS": w, "num_warps": w, "num_stages": st}
       for c, w, st in ((1024, 4, 1), (2048, 4, 3), (2048, 8, 1), (4096, 8, 3))])


DOMAIN = spec.Domain(
    dtypes=("fp16", "bf16", "fp32"),
    dims={"bh": spec.DimRange(1, 1 << 16), "q": spec.DimRange(1, 16384), "k": spec.DimRange(1, 16384)},
    notes="scores (batch*heads, q, k) contiguous with k >= q (bottom-right causal alignment), k <= 16384 "
    "(a row lives in registers), bh*q*k < 2**31; scale a 0-d float32 tensor on the same device.",
)


@triton.jit
def _softmax_causal_fwd(s_ptr, scale_ptr, y_ptr, n_rows, n_q, n_k,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # per element: one load, one multiply, one select, one subtract, one exp2, one multiply, one store. The
    # scale and log2(e) fold into one factor, the row's sum is inverted once (an fp32 division per element costs
    # a dozen instructions: on an H200 that made the kernel ALU-bound at ~3 TB/s), and each mask is one compare
    # against a per-row bound (rows past the end get bounds of 0)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    rmask = rows < n_rows
    limit = rows % n_q + (n_k - n_q)  # last unmasked key of each row; always < n_k
    # the load mask ends on a multiple of 8 elements, so it is uniform over each 16-byte vector and the loads
    # stay vectorized (a mask ending at the causal limit itself made every load scalar); the up to 7 extra
    # scores read are causally masked below
    load_end = tl.where(rmask, tl.minimum((limit // 8 + 1) * 8, n_k), 0)
    store_end = tl.where(rmask, n_k, 0)
    offs = rows[:, None].to(tl.int64) * n_k + cols[None, :]
    k2 = tl.load(scale_ptr) * 1.4426950408889634  # scale * log2(e): exp(scale*s - m) = exp2(k2*s - m2)
    x = tl.load(s_ptr + offs, mask=cols[None, :] < load_end[:, None], other=0.0).to(tl.float32)
    x = tl.where(cols[None, :] <= limit[:, None], x * k2, float("-inf"))
    m = tl.max(x, axis=1)
    p = tl.exp2(x - m[:, None])
    inv = 1.0 / tl.sum(p, axis=1)
    tl.store(y_ptr + offs, (p * inv[:, None]).to(y_ptr.dtype.element_ty), mask=cols[None, :] < store_end[:, None])


@triton.jit
def _softmax_causal_stream(s_ptr, scale_ptr, y_ptr, n_q, n_k, CHUNK: tl.constexpr, INTERPRETED: tl.constexpr):
    """One row per program in CHUNK-wide pieces, for rows too wide to hold many in registers: a first pass
    keeps the row's running max (one reduction per piece) and per-lane sums (one exp2 per score), a second
    normalises and writes the unmasked pieces (their second read mostly hits L2), then the pieces past the
    causal limit are written as zeros without a read. Small programs, many per SM, and the loops software-
    pipelined (num_stages) keep more bytes in flight than a register-resident 16k row (two per SM)."""
    row = tl.program_id(0)
    limit = row % n_q + (n_k - n_q)
    load_end = tl.minimum((limit // 8 + 1) * 8, n_k)  # vector-uniform load mask, as in _softmax_causal_fwd
    live_end = (limit // CHUNK + 1) * CHUNK  # the pieces that hold an unmasked score
    base = row.to(tl.int64) * n_k
    cols = tl.arange(0, CHUNK)
    k2 = tl.load(scale_ptr) * 1.4426950408889634
    m = tl.max(tl.full([CHUNK], float("-inf"), tl.float32), axis=0)
    lsum = tl.zeros([CHUNK], tl.float32)
    if INTERPRETED:
        c0 = 0
        while c0 < live_end:
            m, lsum = _stream_stats(s_ptr, base, c0 + cols, limit, load_end, k2, m, lsum)
            c0 += CHUNK
    else:
        for c0 in range(0, live_end, CHUNK):
            m, lsum = _stream_stats(s_ptr, base, c0 + cols, limit, load_end, k2, m, lsum)
    inv = 1.0 / tl.sum(lsum, axis=0)
    if INTERPRETED:
        c0 = 0
        while c0 < live_end:
            _stream_store(s_ptr, y_ptr, base, c0 + cols, limit, load_end, n_k, k2, m, inv)
            c0 += CHUNK
        while c0 < n_k:
            tl.store(y_ptr + base + c0 + cols, tl.zeros([CHUNK], y_ptr.dtype.element_ty), mask=c0 + cols < n_k)
            c0 += CHUNK
    else:
        for c0 in range(0, live_end, CHUNK):
            _stream_store(s_ptr, y_ptr, base, c0 + cols, limit, load_end, n_k, k2, m, inv)
        for c0 in range(live_end, n_k, CHUNK):
            tl.store(y_ptr + base + c0 + cols, tl.zeros([CHUNK], y_ptr.dtype.element_ty), mask=c0 + cols < n_k)


@triton.jit
def _stream_stats(s_ptr, base, c, limit, load_end, k2, m, lsum):
    x = tl.load(s_ptr + base + c, mask=c < load_end, other=0.0).to(tl.float32)
    x = tl.where(c <= limit, x * k2, float("-inf"))
    m_new = tl.maximum(m, tl.max(x, axis=0))  # finite: every piece before live_end holds an unmasked score
    return m_new, lsum * tl.exp2(m - m_new) + tl.exp2(x - m_new)


@triton.jit
def _stream_store(s_ptr, y_ptr, base, c, limit, load_end, n_k, k2, m, inv):
    x = tl.load(s_ptr + base + c, mask=c < load_end, other=0.0).to(tl.float32)
    y = tl.where(c <= limit, tl.exp2(x * k2 - m) * inv, 0.0)
    tl.store(y_ptr + base + c, y.to(y_ptr.dtype.element_ty), mask=c < n_k)


_config = functools.partial(spec.launch_config, NAME, DEFAULT_CONFIG)  # validated launch config of a call


def shape_of(inputs: spec.Inputs) -> spec.Shape:
    s, sc = inputs["scores"], inputs["scale"]
    if s.dim() != 3:
        raise spec.DomainError(f"{NAME}: scores must be 3-D (batch*heads, q, k), got shape {tuple(s.shape)}")
    if sc.dim() != 0 or sc.dtype != torch.float32 or sc.device != s.device:
        raise spec.DomainError(f"{NAME}: scale must be a 0-d float32 tensor on {s.device}, got "
                          f"shape {tuple(sc.shape)} {sc.dtype} on {sc.device}")
    bh, q, k = s.shape
    if k < q:
        raise spec.DomainError(f"{NAME}: k={k} < q={q}: the causal mask is bottom-right aligned and needs k >= q")
    return {"bh": bh, "q": q, "k": k}


def make_inputs(shape: spec.Shape, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> spec.Inputs:
    s = 3.0 * torch.randn(shape["bh"], shape["q"], shape["k"], generator=gen, device=gen.device)
    scale = 0.5 + torch.rand((), generator=gen, device=gen.device)
    return {"scores": s.to(device, dtype), "scale": scale.to(device, torch.float32)}


def alloc_outputs(inputs: spec.Inputs) -> spec.Outputs:
    return (torch.empty_like(inputs["scores"]),)


def _block_n(k: int) -> int:
    return max(16, triton.next_power_of_2(k))


def run(inputs: spec.Inputs, outs: spec.Outputs, config: spec.LaunchConfig) -> None:
    cfg = _config(config)
    s, sc = inputs["scores"], inputs["scale"]
    DOMAIN.check(s.dtype, shape_of(inputs), inputs)
    (y,) = outs
    spec.check_outputs(NAME, outs, s)
    bh, q, k = s.shape
    bn = _block_n(k)
    chunk, warps = (cfg["WIDE_CHUNK"], cfg["WIDE_WARPS"]) if bn > WIDE and cfg["WIDE_CHUNK"] > 1 else (
        cfg["CHUNK"], cfg["num_warps"])
    if chunk > 1:
        _softmax_causal_stream[(bh * q,)](s, sc, y, q, k, CHUNK=chunk, INTERPRETED=s.device.type == "cpu",
                                          num_warps=warps, num_stages=cfg["num_stages"])
        return
    bm = min(cfg["BLOCK_M"], triton.next_power_of_2(bh * q))  # BLOCK_M is an upper bound
    _softmax_causal_fwd[(triton.cdiv(bh * q, bm),)](
        s, sc, y, bh * q, q, k, BLOCK_M=bm, BLOCK_N=bn,
        num_warps=cfg["WIDE_WARPS"] if bn > WIDE else cfg["num_warps"], num_stages=cfg["num_stages"],
    )


def _mask(q: int, k: int, device: torch.device) -> torch.Tensor:
    return torch.ones(q, k, dtype=torch.bool, device=device).tril(k - q)


def reference(inputs: spec.Inputs) -> spec.Outputs:
    s = inputs["scores"].double() * inputs["scale"].double()
    s = s.masked_fill(~_mask(s.shape[1], s.shape[2], s.device), float("-inf"))
    return (torch.softmax(s, dim=-1),)


def eager(inputs: spec.Inputs) -> spec.Outputs:
    s = inputs["scores"] * inputs["scale"]
    s = s.masked_fill(~_mask(s.shape[1], s.shape[2], s.device), float("-inf"))
    return (torch.softmax(s, dim=-1),)


def bytes_moved(shape: spec.Shape, dtype: torch.dtype) -> int:
    """Causal-aware minimum: only unmasked scores are read; every output element is written."""
    q, k = shape["q"], shape["k"]
    read = q * (k - q) + q * (q + 1) // 2
    return shape["bh"] * (read + q * k) * torch.empty((), dtype=dtype).element_size()


def flops(shape: spec.Shape) -> int:
    return 4 * shape["bh"] * shape["q"] * shape["k"]


def fuzz(rng: random.Random) -> spec.Shape:
    q = rng.randint(1, 12)
    return {"bh": rng.randint(1, 3), "q": q, "k": q + rng.choice((0, 0, rng.randint(1, 40)))}


def aot(dtype: str, config: spec.LaunchConfig) -> list[spec.AotSpec]:
    """One specialization per row width BLOCK_N (next power of 2 of k) across the domain that runs the
    register-resident kernel, and the streaming kernel for the widths that stream (CHUNK, WIDE_CHUNK)."""
    cfg = _config(config)
    p = spec.TRITON_DTYPES[dtype]
    stream_sig = {"s_ptr": p, "scale_ptr": "*fp32", "y_ptr": p, "n_q": "i32", "n_k": "i32", "CHUNK": "constexpr",
                  "INTERPRETED": "constexpr"}
    if cfg["CHUNK"] > 1:
        return [spec.AotSpec(_softmax_causal_stream, stream_sig, {"CHUNK": cfg["CHUNK"], "INTERPRETED": False},
                             num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])]
    sig = {"s_ptr": p, "scale_ptr": "*fp32", "y_ptr": p, "n_rows": "i32", "n_q": "i32", "n_k": "i32",
           "BLOCK_M": "constexpr", "BLOCK_N": "constexpr"}
    rng = DOMAIN.dims["k"]
    blocks = sorted({_block_n(v) for v in (rng.lo, *(1 << j for j in range(4, 15)), rng.hi) if rng.lo <= v <= rng.hi})
    wide_stream = [spec.AotSpec(_softmax_causal_stream, stream_sig, {"CHUNK": cfg["WIDE_CHUNK"], "INTERPRETED": False},
                                num_warps=cfg["WIDE_WARPS"], num_stages=cfg["num_stages"])] if cfg["WIDE_CHUNK"] > 1 else []
    return [spec.AotSpec(_softmax_causal_fwd, sig, {"BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": b},
                         num_warps=cfg["WIDE_WARPS"] if b > WIDE else cfg["num_warps"], num_stages=cfg["num_stages"])
            for b in blocks if not (b > WIDE and cfg["WIDE_CHUNK"] > 1)] + wide_stream


OP = spec.module_op(
    globals(),
    description="y = softmax(scale * s) under an index-computed causal mask; masked scores are not read",
    # against float64 on the same (rounded) scores: outputs lie in [0, 1], so an fp16 output's own rounding is at
    # most 4.9e-4 relative (2.0e-3 in bf16) and fp32 exp/sum add ~1e-6; edge values are judged on finiteness only
    tolerances={"fp32": spec.Tolerance(1e-6, 1e-5), "fp16": spec.Tolerance(1e-4, 2e-3), "bf16": spec.Tolerance(1e-3, 1.6e-2)},
    test_shapes=({"bh": 2, "q": 5, "k": 5}, {"bh": 1, "q": 3, "k": 70}),
    decode_shapes=tuple({"bh": 32, "q": t, "k": 2048} for t in (1, 16, 64, 256)),
    prefill_shapes=({"bh": 8, "q": 2048, "k": 2048}, {"bh": 2, "q": 8192, "k": 8192},
                    {"bh": 1, "q": 16384, "k": 16384}),
)
