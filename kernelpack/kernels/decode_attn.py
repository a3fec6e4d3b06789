"""Decode attention over a KV cache: one query token per sequence against a masked cache (flash-decoding).

Owns op ``decode_attn``: Triton kernels, float64 reference, eager PyTorch version (SDPA, what transformers
runs), domain and tolerances. Inputs: q (batch, q_heads, head_dim), the cache k and v (batch, kv_heads,
cache_len, head_dim) as transformers' static cache holds them, and mask (batch, cache_len) bool, True where a
key takes part (the written prefix of a static cache, minus left padding). GQA: q_heads a multiple of
kv_heads; each program loads a block of keys once for the ``q_heads // kv_heads`` query heads that share it.
``o = softmax(q k^T / sqrt(head_dim) + mask) v``, (batch, q_heads, head_dim).

Split over the keys (flash-decoding): a first launch has (batch * kv_heads, splits) programs, each walking
its share of the cache in BLOCK_N key blocks with an online softmax in fp32 and writing partial (max, sum,
accumulator); key blocks with no unmasked key read nothing from k or v (a static cache is mostly
unwritten early in a generation: SDPA reads all of it). A second launch combines the splits. The number of
splits fills the GPU: about TARGET_PROGRAMS programs, at least one key block each. Every sequence needs at
least one unmasked key (as with SDPA, a fully masked row has no softmax).

On CPU (Triton interpreter) the key loop is a ``while`` loop and the dot operands are upcast to fp32 (see
``flash_attn``). Imports only torch, triton and ``kernelpack.kernels.spec``.
"""

from __future__ import annotations

import functools
import random

import torch
import triton
import triton.language as tl

import kernelpack.kernels.spec as spec

NAME = "decode_attn"
LOG2E = 1.4426950408889634
HEAD_DIMS = (64, 128)
MAX_GROUP = 16  # query heads per kv head: the rows of the score tile (BLOCK_G, padded with masked rows)
MAX_SPLITS = 256
COMBINE_BLOCK = 16  # splits the combine kernel reads at a time
DEFAULT_CONFIG: dict[str, int] = {"BLOCK_N": 64, "TARGET_PROGRAMS": 256, "num_warps": 4, "num_stages": 2}
# launch configs an arch-specific tuning sweep tries (scripts/bench-kernels --tune); all must be correct
TUNING_SPACE: list[dict[str, int]] = [
    {"BLOCK_N": n, "TARGET_PROGRAMS": p, "num_warps": w, "num_stages": s}
    for n, p, w, s in ((64, 256, 4, 2), (32, 256, 4, 2), (128, 256, 4, 2), (64, 512, 4, 2), (64, 128, 4, 2),
                       (64, 256, 4, 3), (128, 256, 8, 2), (32, 512, 2, 2))]


@triton.jit
def _decode_block(acc, m_i, l_i, q, k_ptr, v_ptr, mask_ptr, n, hi, offs_d, qk_scale,
                  HEAD_DIM: tl.constexpr, DOT_F32: tl.constexpr):
    nmask = n < hi
    keep = tl.load(mask_ptr + n, mask=nmask, other=0) != 0
    # a block with no unmasked key loads nothing from k and v (predicated off); the loads stay unconditional so
    # that the loop is software-pipelined
    kvmask = nmask[:, None] & (tl.max(keep.to(tl.int32), axis=0) > 0)
    kv_offs = n[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :]
    k = tl.load(k_ptr + kv_offs, mask=kvmask, other=0.0)
    v = tl.load(v_ptr + kv_offs, mask=kvmask, other=0.0)
    if DOT_F32:  # noqa: SIM108 (kept as a constexpr branch for the Triton frontend)
        qk = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))
    else:
        qk = tl.dot(q, tl.trans(k))
    qk = tl.where(keep[None, :], qk * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: p and alpha 0, not NaN
    p = tl.math.exp2(qk - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    if DOT_F32:
        acc += tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32))
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_new, l_i


@triton.jit
def _decode_attn_split(q_ptr, k_ptr, v_ptr, mask_ptr, m_ptr, l_ptr, acc_ptr, group, n_kvh, cache_len,
                       keys_per_split, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
                       BLOCK_N: tl.constexpr, INTERPRETED: tl.constexpr):
    bh = tl.program_id(0)  # batch * kv_heads + kv head
    split = tl.program_id(1)
    n_splits = tl.num_programs(1)
    b = bh // n_kvh
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    rows = bh * group + offs_g  # query heads kvh*group + g of batch b, as rows of q (batch*q_heads, head_dim)
    gmask = offs_g < group
    q = tl.load(q_ptr + rows[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :], mask=gmask[:, None], other=0.0)
    kv_base = bh.to(tl.int64) * cache_len * HEAD_DIM
    k_ptr += kv_base
    v_ptr += kv_base
    mask_ptr += b.to(tl.int64) * cache_len
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    lo = split * keys_per_split
    hi = tl.minimum(lo + keys_per_split, cache_len)
    if INTERPRETED:
        start = lo
        while start < hi:
            acc, m_i, l_i = _decode_block(acc, m_i, l_i, q, k_ptr, v_ptr, mask_ptr, start + offs_n, hi, offs_d,
                                          qk_scale, HEAD_DIM=HEAD_DIM, DOT_F32=True)
            start += BLOCK_N
    else:
        for start in range(lo, hi, BLOCK_N):
            acc, m_i, l_i = _decode_block(acc, m_i, l_i, q, k_ptr, v_ptr, mask_ptr, start + offs_n, hi, offs_d,
                                          qk_scale, HEAD_DIM=HEAD_DIM, DOT_F32=False)
    part = rows.to(tl.int64) * n_splits + split  # partials (batch*q_heads, splits[, head_dim])
    tl.store(m_ptr + part, m_i, mask=gmask)
    tl.store(l_ptr + part, l_i, mask=gmask)
    tl.store(acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=gmask[:, None])


@triton.jit
def _combine_chunk(m_ptr, l_ptr, acc_ptr, row, s0, n_splits, m_max, l_sum, o, offs_s, offs_d,
                   HEAD_DIM: tl.constexpr):
    s = s0 + offs_s
    smask = s < n_splits
    m = tl.load(m_ptr + row * n_splits + s, mask=smask, other=float("-inf"))
    w = tl.where(m > float("-inf"), tl.math.exp2(m - m_max), 0.0)
    l_sum += tl.sum(w * tl.load(l_ptr + row * n_splits + s, mask=smask, other=0.0), axis=0)
    acc = tl.load(acc_ptr + (row * n_splits + s)[:, None] * HEAD_DIM + offs_d[None, :], mask=smask[:, None],
                  other=0.0)
    return l_sum, o + tl.sum(acc * w[:, None], axis=0)


@triton.jit
def _decode_attn_combine(m_ptr, l_ptr, acc_ptr, o_ptr, n_splits, HEAD_DIM: tl.constexpr,
                         BLOCK_S: tl.constexpr, INTERPRETED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # batch * q_heads + head
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    m_max = tl.max(tl.load(m_ptr + row * n_splits + offs_s, mask=offs_s < n_splits, other=float("-inf")), axis=0)
    l_sum = tl.sum(tl.zeros([BLOCK_S], tl.float32), axis=0)
    o = tl.zeros([HEAD_DIM], tl.float32)
    if INTERPRETED:
        s0 = BLOCK_S
        while s0 < n_splits:
            m_max = tl.maximum(m_max, tl.max(tl.load(m_ptr + row * n_splits + s0 + offs_s,
                                                     mask=s0 + offs_s < n_splits, other=float("-inf")), axis=0))
            s0 += BLOCK_S
        s0 = 0
        while s0 < n_splits:
            l_sum, o = _combine_chunk(m_ptr, l_ptr, acc_ptr, row, s0, n_splits, m_max, l_sum, o, offs_s, offs_d,
                                      HEAD_DIM=HEAD_DIM)
            s0 += BLOCK_S
    else:
        for s0 in range(BLOCK_S, n_splits, BLOCK_S):
            m_max = tl.maximum(m_max, tl.max(tl.load(m_ptr + row * n_splits + s0 + offs_s,
                                                     mask=s0 + offs_s < n_splits, other=float("-inf")), axis=0))
        for s0 in range(0, n_splits, BLOCK_S):
            l_sum, o = _combine_chunk(m_ptr, l_ptr, acc_ptr, row, s0, n_splits, m_max, l_sum, o, offs_s, offs_d,
                                      HEAD_DIM=HEAD_DIM)
    tl.store(o_ptr + row * HEAD_DIM + offs_d, (o / l_sum).to(o_ptr.dtype.element_ty))


_config = functools.partial(spec.launch_config, NAME, DEFAULT_CONFIG)  # validated launch config of a call


def shape_of(inputs: spec.Inputs) -> spec.Shape:
    q, k, v, mask = inputs["q"], inputs["k"], inputs["v"], inputs["mask"]
    if q.dim() != 3 or k.dim() != 4:
        raise spec.DomainError(f"{NAME}: q must be 3-D (batch, q_heads, head_dim) and k 4-D (batch, kv_heads, "
                               f"cache_len, head_dim), got {tuple(q.shape)} and {tuple(k.shape)}")
    b, hq, d = q.shape
    if v.shape != k.shape or k.shape[0] != b or k.shape[3] != d:
        raise spec.DomainError(f"{NAME}: k {tuple(k.shape)} and v {tuple(v.shape)} must be (batch={b}, kv_heads, "
                               f"cache_len, head_dim={d})")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype or t.device != q.device:
            raise spec.DomainError(f"{NAME}: {name} ({t.dtype}, {t.device}) must match q ({q.dtype}, {q.device})")
    hkv, cache_len = k.shape[1], k.shape[2]
    if hq % hkv or hq // hkv > MAX_GROUP:
        raise spec.DomainError(f"{NAME}: q_heads={hq} must be a multiple of kv_heads={hkv}, at most "
                               f"{MAX_GROUP} query heads per kv head")
    if mask.shape != (b, cache_len) or mask.dtype != torch.bool or mask.device != q.device:
        raise spec.DomainError(f"{NAME}: mask must be a bool (batch, cache_len) = {(b, cache_len)} tensor on "
                               f"{q.device}, got {mask.dtype} {tuple(mask.shape)}")
    if d not in HEAD_DIMS:
        raise spec.DomainError(f"{NAME}: head_dim={d} not supported; supported: {HEAD_DIMS}")
    return {"batch": b, "q_heads": hq, "kv_heads": hkv, "cache_len": cache_len, "head_dim": d}


def make_inputs(shape: spec.Shape, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> spec.Inputs:
    """Random q, k, v; the mask of a static cache: sequence 0 fully written, the others a random written
    prefix, odd sequences left-padded (their first keys masked too)."""
    b, hq, hkv, n, d = (shape[k] for k in ("batch", "q_heads", "kv_heads", "cache_len", "head_dim"))
    g = gen.device
    mask = torch.zeros(b, n, dtype=torch.bool, device=g)
    for i in range(b):
        end = n if i == 0 else int(torch.randint(1, n + 1, (), generator=gen, device=g))
        start = int(torch.randint(0, end, (), generator=gen, device=g)) if i % 2 else 0
        mask[i, start:end] = True
    return {
        "q": torch.randn(b, hq, d, generator=gen, device=g).to(device, dtype),
        "k": torch.randn(b, hkv, n, d, generator=gen, device=g).to(device, dtype),
        "v": torch.randn(b, hkv, n, d, generator=gen, device=g).to(device, dtype),
        "mask": mask.to(device),
    }


def edge_inputs(shape: spec.Shape, dtype: torch.dtype, device: torch.device,
                gen: torch.Generator) -> list[tuple[str, spec.Inputs]]:
    """Masks at the edges of a static cache: only the first key written, only the last (one unmasked key in
    one split, every other split empty)."""
    inputs = make_inputs(shape, dtype, device, gen)
    out = []
    for case, col in (("only_first_key", 0), ("only_last_key", shape["cache_len"] - 1)):
        mask = torch.zeros_like(inputs["mask"])
        mask[:, col] = True
        out.append((case, {**inputs, "mask": mask}))
    return out


def alloc_outputs(inputs: spec.Inputs) -> spec.Outputs:
    return (torch.empty_like(inputs["q"]),)


def _splits(cache_len: int, programs: int, block_n: int, target: int) -> tuple[int, int]:
    """(splits, keys per split): about ``target`` programs in all, at least one key block per split."""
    want = max(1, min(triton.cdiv(cache_len, block_n), triton.cdiv(target, programs), MAX_SPLITS))
    per = triton.cdiv(triton.cdiv(cache_len, want), block_n) * block_n
    return triton.cdiv(cache_len, per), per


def run(inputs: spec.Inputs, outs: spec.Outputs, config: spec.LaunchConfig) -> None:
    cfg = _config(config)
    q, k, v, mask = inputs["q"], inputs["k"], inputs["v"], inputs["mask"]
    shape = shape_of(inputs)
    DOMAIN.check(q.dtype, shape, inputs)
    (o,) = outs
    spec.check_outputs(NAME, outs, q)
    b, hq, hkv, n, d = (shape[k] for k in ("batch", "q_heads", "kv_heads", "cache_len", "head_dim"))
    group = hq // hkv
    bn = min(cfg["BLOCK_N"], max(16, triton.next_power_of_2(n)))
    splits, per = _splits(n, b * hkv, bn, cfg["TARGET_PROGRAMS"])
    m = torch.empty(b * hq, splits, dtype=torch.float32, device=q.device)
    lse = torch.empty_like(m)
    acc = torch.empty(b * hq, splits, d, dtype=torch.float32, device=q.device)
    _decode_attn_split[(b * hkv, splits)](
        q, k, v, mask, m, lse, acc, group, hkv, n, per, LOG2E / d**0.5, HEAD_DIM=d,
        BLOCK_G=MAX_GROUP, BLOCK_N=bn, INTERPRETED=q.device.type == "cpu",
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    _decode_attn_combine[(b * hq,)](m, lse, acc, o, splits, HEAD_DIM=d, BLOCK_S=COMBINE_BLOCK,
                                    INTERPRETED=q.device.type == "cpu", num_warps=4)


def reference(inputs: spec.Inputs) -> spec.Outputs:
    q, k, v = (inputs[n].double() for n in ("q", "k", "v"))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    sc = torch.einsum("bhd,bhnd->bhn", q, k) / q.shape[-1] ** 0.5
    sc = sc.masked_fill(~inputs["mask"][:, None, :], float("-inf"))
    return (torch.einsum("bhn,bhnd->bhd", torch.softmax(sc, dim=-1), v),)


def eager(inputs: spec.Inputs) -> spec.Outputs:
    """What transformers runs for a decode step: SDPA with the cache's bool mask, GQA in SDPA."""
    q, mask = inputs["q"], inputs["mask"]
    o = torch.nn.functional.scaled_dot_product_attention(q[:, :, None, :], inputs["k"], inputs["v"],
                                                         attn_mask=mask[:, None, None, :], enable_gqa=True)
    return (o[:, :, 0, :],)


def bytes_moved(shape: spec.Shape, dtype: torch.dtype) -> int:
    """The whole cache read once (what SDPA reads; this kernel skips blocks with no unmasked key), q and o."""
    es = torch.empty((), dtype=dtype).element_size()
    b, n, d = shape["batch"], shape["cache_len"], shape["head_dim"]
    return (2 * b * shape["kv_heads"] * n * d + 2 * b * shape["q_heads"] * d) * es + b * n


def flops(shape: spec.Shape) -> int:
    return 4 * shape["batch"] * shape["q_heads"] * shape["cache_len"] * shape["head_dim"]


def fuzz(rng: random.Random) -> spec.Shape:
    kv = rng.randint(1, 2)
    return {"batch": rng.randint(1, 3), "q_heads": kv * rng.choice((1, 2, 4)), "kv_heads": kv,
            "cache_len": rng.randint(1, 150), "head_dim": rng.choice(HEAD_DIMS)}


def aot(dtype: str, config: spec.LaunchConfig) -> list[spec.AotSpec]:
    """The split and the combine kernel per head_dim (the GPU path)."""
    cfg = _config(config)
    p = spec.TRITON_DTYPES[dtype]
    sig = {"q_ptr": p, "k_ptr": p, "v_ptr": p, "mask_ptr": "*i1", "m_ptr": "*fp32", "l_ptr": "*fp32",
           "acc_ptr": "*fp32", "group": "i32", "n_kvh": "i32", "cache_len": "i32", "keys_per_split": "i32",
           "qk_scale": "fp32", "HEAD_DIM": "constexpr", "BLOCK_G": "constexpr", "BLOCK_N": "constexpr",
           "INTERPRETED": "constexpr"}
    csig = {"m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "o_ptr": p, "n_splits": "i32",
            "HEAD_DIM": "constexpr", "BLOCK_S": "constexpr", "INTERPRETED": "constexpr"}
    out = [spec.AotSpec(_decode_attn_split, sig, {"HEAD_DIM": d, "BLOCK_G": MAX_GROUP, "BLOCK_N": cfg["BLOCK_N"],
                                                  "INTERPRETED": False},
                        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]) for d in HEAD_DIMS]
    out += [spec.AotSpec(_decode_attn_combine, csig, {"HEAD_DIM": d, "BLOCK_S": COMBINE_BLOCK, "INTERPRETED": False},
                         num_warps=4, num_stages=1) for d in HEAD_DIMS]
    return out


DOMAIN = spec.Domain(
    dtypes=("fp16", "bf16"),
    # batch: the sequences of one decode step (its tokens per call); a prefill-sized "batch" is no decode step
    dims={"batch": spec.DimRange(1, 256), "q_heads": spec.DimRange(1, 256), "kv_heads": spec.DimRange(1, 256),
          "cache_len": spec.DimRange(1, 1 << 20), "head_dim": spec.DimRange(64, 128, 64)},
    notes="one decode step of at most 256 sequences: q (batch, q_heads, head_dim), k/v (batch, kv_heads, cache_len, head_dim), mask (batch, cache_len) "
    "bool, contiguous, one dtype (fp16/bf16); q_heads a multiple of kv_heads, at most 16 query heads per kv "
    "head; head_dim 64 or 128; scale 1/sqrt(head_dim); at least one unmasked key per sequence; "
    "|q|, |k|, |v| <= 1e18 so that every score fits in float32.",
    max_abs=1e18,
)

OP = spec.module_op(
    globals(),
    description="decode attention of one query token over a masked KV cache (split-K, GQA), head_dim 64/128",
    tolerances={"fp16": spec.Tolerance(4e-3, 4e-3), "bf16": spec.Tolerance(2e-2, 2e-2)},
    launches_per_call=2,
    edge_inputs=edge_inputs,
    test_shapes=({"batch": 2, "q_heads": 4, "kv_heads": 2, "cache_len": 37, "head_dim": 64},
                 {"batch": 1, "q_heads": 2, "kv_heads": 1, "cache_len": 200, "head_dim": 128}),
    decode_shapes=tuple({"batch": b, "q_heads": 32, "kv_heads": 8, "cache_len": n, "head_dim": 128}
                        for b, n in ((1, 1024), (1, 4096), (8, 4096), (32, 1024), (64, 2048))),
    prefill_shapes=({"batch": 1, "q_heads": 32, "kv_heads": 8, "cache_len": 16384, "head_dim": 128},
                    {"batch": 32, "q_heads": 32, "kv_heads": 8, "cache_len": 8192, "head_dim": 128}),
)
