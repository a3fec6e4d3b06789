"""Causal flash-attention forward for head_dim 64 and 128: ``o = softmax(q k^T / sqrt(d) + causal) v``.

Owns op ``flash_attn``: Triton kernel, float64 reference, eager PyTorch version, domain and tolerances.
q and o are (batch, heads, seq, head_dim), k and v (batch, kv_heads, seq, head_dim) with heads a multiple of
kv_heads (grouped-query attention: query head h reads kv head h // (heads / kv_heads), no copies), contiguous,
one dtype (fp16 or bf16), self-attention with q_len == kv_len (prefill); scale is 1/sqrt(head_dim). Online softmax in fp32, P rounded to the input
dtype before the P@V product (as FlashAttention does). Each program owns BLOCK_M queries of one (batch, head)
and walks the key blocks left of the diagonal unmasked, then the diagonal blocks masked. The config's
BLOCK_M / BLOCK_N are upper bounds: a sequence shorter than a tile gets max(16, next_power_of_2(seq)).

Two code paths, chosen by the launch config's ``TMA`` flag (bundles pin it per arch): the portable pointer
kernel (``TMA = 0``), and the Hopper kernel after Triton's attention tutorial (``TMA = 1``): tiles moved by
tensor descriptors made on the device (TMA on sm_90; Triton lowers them to plain loads on older archs), the
scale folded into one multiply-add with the running max. The descriptors are made on the device,
one per (batch, head), their scratch from ``triton.set_allocator`` (installed on first use in each thread,
unless the caller set one); with ``HOST_DESC = 1`` the host makes one per tensor where the sequence
fills the tiles (the prefill sizes), as the tutorial does on Hopper. Triton 3.6's warp specialisation of the
key loop is not offered: it compiles only with a single (fully masked) key loop, and on an H100 every such
config gave wrong output (max error 0.97 and NaN at 256 tokens, docs/gpu.md, run of 2026-11-28).

On CPU (Triton interpreter) the key loops are ``while`` loops and the dot operands are upcast to fp32: the
interpreter cannot take a run-time ``range`` bound with numpy >= 2.4 and miscomputes bf16 dots; both are
constexpr switches, the GPU path is a pipelined ``for`` loop over native-dtype tensor-core dots. The
interpreter runs tensor descriptors, so CI checks both paths' index math (tile bounds, GQA, clipping).
Imports only torch, triton and ``kernelpack.kernels.spec``.
"""

from __future__ import annotations

import random

import torch
import triton
import triton.language as tl
from triton.runtime import _allocation
from triton.tools.tensor_descriptor import TensorDescriptor

import kernelpack.kernels.spec as spec

NAME = "flash_attn"
LOG2E = 1.4426950408889634
# switches between code paths (0 or 1): TMA selects the tensor-descriptor (Hopper) kernel; with it,
# HOST_DESC descriptors made on the host (the tutorial's Hopper setup) where the sequence fills the tiles
FLAGS = ("TMA", "HOST_DESC")
DEFAULT_CONFIG: dict[str, int] = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "TMA": 0,
                                  "HOST_DESC": 0}
# launch configs an arch-specific tuning sweep tries (scripts/bench-kernels --tune); all must be correct
TUNING_SPACE: list[dict[str, int]] = [
    {"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": s, "TMA": 0, "HOST_DESC": 0}
    for m, n, w, s in ((128, 64, 4, 3), (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3), (64, 64, 4, 3),
                       (64, 64, 4, 4), (64, 32, 4, 3), (128, 32, 4, 4), (64, 128, 4, 3))
] + [  # the Hopper path, from the attention tutorial's sm_90 space (BLOCK_M 128, BLOCK_N 64/128, 4/8 warps); every
    # one fits the H100's 227 KiB of shared memory at head_dim 128 (compiled for sm_90 on the CPU; left out:
    # 128x128 with 4 warps, 3 stages: 2 KiB of spills)
    {"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": s, "TMA": 1, "HOST_DESC": hd}
    for m, n, w, s, hd in ((128, 128, 8, 3, 0), (128, 128, 8, 2, 0), (128, 64, 8, 3, 0), (128, 64, 8, 4, 0),
                           (128, 64, 4, 3, 0), (64, 64, 4, 3, 0), (128, 128, 8, 3, 1), (128, 64, 8, 3, 1),
                           (128, 64, 4, 3, 1))
]


@triton.jit
def _attn_block(acc, m_i, l_i, q, k_ptr, v_ptr, start_n, offs_m, offs_n, offs_d, seq, qk_scale,
                MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_F32: tl.constexpr):
    n = start_n + offs_n
    kv_offs = n[:, None] * HEAD_DIM + offs_d[None, :]
    if MASKED:
        k = tl.load(k_ptr + kv_offs, mask=n[:, None] < seq, other=0.0)
        v = tl.load(v_ptr + kv_offs, mask=n[:, None] < seq, other=0.0)
    else:
        k = tl.load(k_ptr + kv_offs)
        v = tl.load(v_ptr + kv_offs)
    if DOT_F32:  # noqa: SIM108 (kept as a constexpr branch for the Triton frontend)
        qk = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))
    else:
        qk = tl.dot(q, tl.trans(k))
    qk = qk * qk_scale
    if MASKED:
        qk = tl.where((offs_m[:, None] >= n[None, :]) & (n[None, :] < seq), qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    return _online_softmax_step(acc, m_i, l_i, qk - m_new[:, None], m_new, v, DOT_F32=DOT_F32)


@triton.jit
def _online_softmax_step(acc, m_i, l_i, qk_shifted, m_new, v, DOT_F32: tl.constexpr):
    """One key block into the running softmax: ``qk_shifted`` is the block's log2-scaled scores minus the new
    running max ``m_new``; rescales the accumulator and the row sums by the max's change, adds P @ V."""
    p = tl.math.exp2(qk_shifted)
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    if DOT_F32:
        acc += tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32))
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_new, l_i


@triton.jit
def _flash_attn_fwd(q_ptr, k_ptr, v_ptr, o_ptr, seq, qk_scale, group,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    INTERPRETED: tl.constexpr):
    start_m = tl.num_programs(0) - 1 - tl.program_id(0)  # longest (most key blocks) query blocks first
    base = tl.program_id(1).to(tl.int64) * seq * HEAD_DIM  # (batch, head) of q and o
    kv_base = (tl.program_id(1) // group).to(tl.int64) * seq * HEAD_DIM  # its (batch, kv head): GQA
    q_ptr += base
    k_ptr += kv_base
    v_ptr += kv_base
    o_ptr += base
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    qo_offs = offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    q = tl.load(q_ptr + qo_offs, mask=offs_m[:, None] < seq, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    full_hi = (start_m * BLOCK_M // BLOCK_N) * BLOCK_N  # key blocks entirely left of the diagonal
    diag_hi = tl.minimum((start_m + 1) * BLOCK_M, seq)
    if INTERPRETED:
        start_n = 0
        while start_n < full_hi:
            acc, m_i, l_i = _attn_block(acc, m_i, l_i, q, k_ptr, v_ptr, start_n, offs_m, offs_n, offs_d, seq,
                                        qk_scale, MASKED=False, HEAD_DIM=HEAD_DIM, DOT_F32=True)
            start_n += BLOCK_N
        while start_n < diag_hi:
            acc, m_i, l_i = _attn_block(acc, m_i, l_i, q, k_ptr, v_ptr, start_n, offs_m, offs_n, offs_d, seq,
                                        qk_scale, MASKED=True, HEAD_DIM=HEAD_DIM, DOT_F32=True)
            start_n += BLOCK_N
    else:
        for start_n in range(0, full_hi, BLOCK_N):
            acc, m_i, l_i = _attn_block(acc, m_i, l_i, q, k_ptr, v_ptr, start_n, offs_m, offs_n, offs_d, seq,
                                        qk_scale, MASKED=False, HEAD_DIM=HEAD_DIM, DOT_F32=False)
        for start_n in range(full_hi, diag_hi, BLOCK_N):
            acc, m_i, l_i = _attn_block(acc, m_i, l_i, q, k_ptr, v_ptr, start_n, offs_m, offs_n, offs_d, seq,
                                        qk_scale, MASKED=True, HEAD_DIM=HEAD_DIM, DOT_F32=False)
    o = acc / l_i[:, None]
    tl.store(o_ptr + qo_offs, o.to(o_ptr.dtype.element_ty), mask=offs_m[:, None] < seq)


@triton.jit
def _attn_block_tma(acc, m_i, l_i, q, desc_k, desc_v, kv_row, start_n, offs_m, offs_n, qk_scale,
                    MASKED: tl.constexpr, DOT_F32: tl.constexpr):
    k = desc_k.load([kv_row + start_n, 0])  # rows past seq: zeros (per-head bounds) or masked keys
    if DOT_F32:  # noqa: SIM108 (kept as a constexpr branch for the Triton frontend)
        qk = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))
    else:
        qk = tl.dot(q, tl.trans(k))
    if MASKED:  # the diagonal: causal mask (a key past seq is past every stored query row)
        qk = tl.where(offs_m[:, None] >= (start_n + offs_n)[None, :], qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        qk = qk - m_new[:, None]
    else:  # left of the diagonal: the scale folded into one multiply-add with the running max
        m_new = tl.maximum(m_i, tl.max(qk, axis=1) * qk_scale)
        qk = qk * qk_scale - m_new[:, None]
    v = desc_v.load([kv_row + start_n, 0])
    return _online_softmax_step(acc, m_i, l_i, qk, m_new, v, DOT_F32=DOT_F32)


@triton.jit
def _flash_attn_fwd_tma(q_ptr, k_ptr, v_ptr, o_ptr, seq, qk_scale, group,
                        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        INTERPRETED: tl.constexpr, HOST_DESC: tl.constexpr):
    """The Hopper path: tiles moved by tensor descriptors (TMA on sm_90). Made on the device, one per
    (batch, head) and tensor (scratch from ``triton.set_allocator``), bounded at ``seq`` rows: a tile past the
    end reads zeros and its store is clipped. With HOST_DESC the host made one per tensor over all rows (no
    per-program setup; ``run`` takes it only when ``seq`` is a multiple of both tiles, so no tile crosses a
    head). Same walk as ``_flash_attn_fwd``."""
    start_m = tl.num_programs(0) - 1 - tl.program_id(0)  # longest (most key blocks) query blocks first
    if HOST_DESC:  # descriptors over all rows (batch * heads * seq, head_dim) from the host; seq fills the tiles
        desc_q, desc_k, desc_v, desc_o = q_ptr, k_ptr, v_ptr, o_ptr
        q_row = tl.program_id(1) * seq  # its (batch, head)
        kv_row = (tl.program_id(1) // group) * seq  # its (batch, kv head): GQA
    else:  # one descriptor per (batch, head) and tensor, made here
        base = tl.program_id(1).to(tl.int64) * seq * HEAD_DIM  # (batch, head) of q and o
        kv_base = (tl.program_id(1) // group).to(tl.int64) * seq * HEAD_DIM  # its (batch, kv head): GQA
        desc_q = tl.make_tensor_descriptor(q_ptr + base, shape=[seq, HEAD_DIM], strides=[HEAD_DIM, 1],
                                           block_shape=[BLOCK_M, HEAD_DIM])
        desc_k = tl.make_tensor_descriptor(k_ptr + kv_base, shape=[seq, HEAD_DIM], strides=[HEAD_DIM, 1],
                                           block_shape=[BLOCK_N, HEAD_DIM])
        desc_v = tl.make_tensor_descriptor(v_ptr + kv_base, shape=[seq, HEAD_DIM], strides=[HEAD_DIM, 1],
                                           block_shape=[BLOCK_N, HEAD_DIM])
        desc_o = tl.make_tensor_descriptor(o_ptr + base, shape=[seq, HEAD_DIM], strides=[HEAD_DIM, 1],
                                           block_shape=[BLOCK_M, HEAD_DIM])
        q_row = 0
        kv_row = 0
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    q = desc_q.load([q_row + start_m * BLOCK_M, 0])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    full_hi = (start_m * BLOCK_M // BLOCK_N) * BLOCK_N  # key blocks entirely left of the diagonal
    diag_hi = tl.minimum((start_m + 1) * BLOCK_M, seq)
    if INTERPRETED:
        start_n = 0
        while start_n < full_hi:
            acc, m_i, l_i = _attn_block_tma(acc, m_i, l_i, q, desc_k, desc_v, kv_row, start_n, offs_m, offs_n, qk_scale,
                                            MASKED=False, DOT_F32=True)
            start_n += BLOCK_N
        while start_n < diag_hi:
            acc, m_i, l_i = _attn_block_tma(acc, m_i, l_i, q, desc_k, desc_v, kv_row, start_n, offs_m, offs_n, qk_scale,
                                            MASKED=True, DOT_F32=True)
            start_n += BLOCK_N
    else:
        for start_n in tl.range(0, full_hi, BLOCK_N):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            acc, m_i, l_i = _attn_block_tma(acc, m_i, l_i, q, desc_k, desc_v, kv_row, start_n, offs_m, offs_n, qk_scale,
                                            MASKED=False, DOT_F32=False)
        for start_n in tl.range(full_hi, diag_hi, BLOCK_N):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            acc, m_i, l_i = _attn_block_tma(acc, m_i, l_i, q, desc_k, desc_v, kv_row, start_n, offs_m, offs_n, qk_scale,
                                            MASKED=True, DOT_F32=False)
    o = acc / l_i[:, None]
    desc_o.store([q_row + start_m * BLOCK_M, 0], o.to(desc_o.dtype))




def _config(config: spec.LaunchConfig) -> dict[str, int]:
    """The validated launch config of a call (HOST_DESC only on the TMA path)."""
    cfg = spec.launch_config(NAME, DEFAULT_CONFIG, config, flags=FLAGS)
    if cfg["HOST_DESC"] and not cfg["TMA"]:
        raise ValueError(f"{NAME}: launch config HOST_DESC=1 needs TMA=1 (the tensor-descriptor path)")
    return cfg


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Global scratch for the descriptors a TMA program makes on the device (Triton asks at each launch)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _host_desc(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """A descriptor over all of ``t``'s rows ((batch * heads * seq, head_dim)), tiles of ``rows`` rows."""
    flat = t.view(-1, t.shape[-1])
    return TensorDescriptor.from_tensor(flat, [rows, t.shape[-1]])


def _ensure_allocator() -> None:
    """Triton's allocator is a context variable whose default refuses every request: install ``_scratch`` in
    this context (thread) when nothing was set, and keep an allocator the caller set."""
    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch)


def shape_of(inputs: spec.Inputs) -> spec.Shape:
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    if q.dim() != 4:
        raise spec.DomainError(f"{NAME}: q must be 4-D (batch, heads, seq, head_dim), got shape {tuple(q.shape)}")
    b, h, s, d = q.shape
    for name, t in (("k", k), ("v", v)):
        if t.dim() != 4 or (t.shape[0], t.shape[2], t.shape[3]) != (b, s, d) or t.shape[1] != k.shape[1]:
            raise spec.DomainError(f"{NAME}: {name} shape {tuple(t.shape)} must be (batch, kv_heads, seq, head_dim) "
                                   f"with q's batch, seq and head_dim {(b, s, d)} (self-attention)")
        if t.dtype != q.dtype or t.device != q.device:
            raise spec.DomainError(f"{NAME}: {name} ({t.dtype}, {t.device}) must match q ({q.dtype}, {q.device})")
    if h % k.shape[1]:
        raise spec.DomainError(f"{NAME}: heads={h} must be a multiple of kv_heads={k.shape[1]} (GQA)")
    if d not in HEAD_DIMS:
        raise spec.DomainError(f"{NAME}: head_dim={d} not supported; supported: {HEAD_DIMS}")
    return {"batch": b, "heads": h, "kv_heads": k.shape[1], "seq": s, "head_dim": d}


def make_inputs(shape: spec.Shape, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> spec.Inputs:
    b, s, d = shape["batch"], shape["seq"], shape["head_dim"]
    kv = shape.get("kv_heads", shape["heads"])
    return {n: torch.randn(b, heads, s, d, generator=gen, device=gen.device).to(device, dtype)
            for n, heads in (("q", shape["heads"]), ("k", kv), ("v", kv))}


def alloc_outputs(inputs: spec.Inputs) -> spec.Outputs:
    return (torch.empty_like(inputs["q"]),)


def run(inputs: spec.Inputs, outs: spec.Outputs, config: spec.LaunchConfig) -> None:
    cfg = _config(config)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    DOMAIN.check(q.dtype, shape_of(inputs), inputs)
    (o,) = outs
    spec.check_outputs(NAME, outs, q)
    b, h, s, d = q.shape
    # short sequences (decode-sized prefill) get tiles no larger than the sequence: the configured
    # BLOCK_M/BLOCK_N are upper bounds, capped at max(16, next_power_of_2(seq))
    cap = max(16, triton.next_power_of_2(s))
    bm, bn = min(cfg["BLOCK_M"], cap), min(cfg["BLOCK_N"], cap)
    grid = (triton.cdiv(s, bm), b * h)
    args = (q, k, v, o, s, LOG2E / d**0.5, h // k.shape[1])
    interpreted = q.device.type == "cpu"
    # a descriptor's base must be 16-byte aligned: an input at an odd storage offset takes the pointer path
    if cfg["TMA"] and all(t.data_ptr() % 16 == 0 for t in (q, k, v, o)):
        # host-made descriptors span every head's rows: only where no tile crosses a head (and row numbers,
        # which TMA takes as int32, fit)
        host = bool(cfg["HOST_DESC"]) and s % max(bm, bn) == 0 and b * h * s < 2**31
        if host:
            args = (_host_desc(q, bm), _host_desc(k, bn), _host_desc(v, bn), _host_desc(o, bm), *args[4:])
        elif not interpreted:
            _ensure_allocator()
        _flash_attn_fwd_tma[grid](*args, HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn,
                                  INTERPRETED=interpreted, HOST_DESC=host, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    else:
        _flash_attn_fwd[grid](*args, HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, INTERPRETED=interpreted,
                              num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def _causal(s: int, device: torch.device) -> torch.Tensor:
    return torch.ones(s, s, dtype=torch.bool, device=device).tril()


def _expand_kv(inputs: spec.Inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, and k, v repeated to q's heads (GQA: kv head j serves query heads j*group .. (j+1)*group - 1)."""
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    group = q.shape[1] // k.shape[1]
    return q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)


def reference(inputs: spec.Inputs) -> spec.Outputs:
    q, k, v = (t.double() for t in _expand_kv(inputs))
    sc = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    sc = sc.masked_fill(~_causal(q.shape[2], sc.device), float("-inf"))
    return (torch.softmax(sc, dim=-1) @ v,)


def eager(inputs: spec.Inputs) -> spec.Outputs:
    q, k, v = _expand_kv(inputs)
    sc = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
    sc = sc.masked_fill(~_causal(q.shape[2], sc.device), float("-inf"))
    return (torch.softmax(sc.float(), dim=-1).to(q.dtype) @ v,)


def bytes_moved(shape: spec.Shape, dtype: torch.dtype) -> int:
    es = torch.empty((), dtype=dtype).element_size()
    heads = 2 * shape["heads"] + 2 * shape.get("kv_heads", shape["heads"])  # q, o; k, v
    return heads * shape["batch"] * shape["seq"] * shape["head_dim"] * es


def flops(shape: spec.Shape) -> int:
    """Causal: half of the 4*b*h*s^2*d of full attention (two matmuls)."""
    return 2 * shape["batch"] * shape["heads"] * shape["seq"] ** 2 * shape["head_dim"]


def fuzz(rng: random.Random) -> spec.Shape:
    kv, group = rng.randint(1, 2), rng.choice((1, 1, 2, 4))
    return {"batch": rng.randint(1, 2), "heads": kv * group, "kv_heads": kv, "seq": rng.randint(1, 150),
            "head_dim": rng.choice(HEAD_DIMS)}


def aot(dtype: str, config: spec.LaunchConfig) -> list[spec.AotSpec]:
    """One specialization per supported head_dim of the config's GPU path (INTERPRETED=False): the pointer
    kernel, or with TMA=1 the tensor-descriptor kernel."""
    cfg = _config(config)
    p = spec.TRITON_DTYPES[dtype]
    sig = {"q_ptr": p, "k_ptr": p, "v_ptr": p, "o_ptr": p, "seq": "i32", "qk_scale": "fp32", "group": "i32",
           "HEAD_DIM": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "INTERPRETED": "constexpr"}
    fn, extra = _flash_attn_fwd, {}
    if cfg["TMA"]:
        fn = _flash_attn_fwd_tma
        extra = {"HOST_DESC": bool(cfg["HOST_DESC"])}
        sig = {**sig, "HOST_DESC": "constexpr"}
    specs = []
    for d in HEAD_DIMS:
        s = dict(sig)
        if cfg["TMA"] and cfg["HOST_DESC"]:
            rows = {"q_ptr": cfg["BLOCK_M"], "k_ptr": cfg["BLOCK_N"], "v_ptr": cfg["BLOCK_N"], "o_ptr": cfg["BLOCK_M"]}
            s.update({a: f"tensordesc<{dtype}[{r},{d}]>" for a, r in rows.items()})
        specs.append(spec.AotSpec(fn, s, {"HEAD_DIM": d, "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"],
                                          "INTERPRETED": False, **extra},
                                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))
    return specs

HEAD_DIMS = (64, 128)
DOMAIN = spec.Domain(
    dtypes=("fp16", "bf16"),
    dims={"batch": spec.DimRange(1, 4096), "heads": spec.DimRange(1, 256), "kv_heads": spec.DimRange(1, 256),
          "seq": spec.DimRange(1, 65536), "head_dim": spec.DimRange(64, 128, 64)},
    notes="q (batch, heads, seq, head_dim), k, v (batch, kv_heads, seq, head_dim), heads a multiple of kv_heads "
    "(GQA), contiguous, one dtype (fp16/bf16), q_len == kv_len, head_dim 64 or 128, scale 1/sqrt(head_dim), "
    "causal (top-left aligned); |q|, |k|, |v| <= 1e18 so that every score q.k fits in float32.",
    max_abs=1e18,
)

OP = spec.module_op(
    globals(),
    description="causal flash-attention forward (online softmax, no scores in memory), head_dim 64/128",
    tolerances={"fp16": spec.Tolerance(4e-3, 4e-3), "bf16": spec.Tolerance(2e-2, 2e-2)},
    test_shapes=({"batch": 1, "heads": 4, "kv_heads": 2, "seq": 37, "head_dim": 64},
                 {"batch": 1, "heads": 1, "kv_heads": 1, "seq": 200, "head_dim": 128}),
    decode_shapes=tuple({"batch": 1, "heads": 32, "kv_heads": 8, "seq": t, "head_dim": 128} for t in (1, 16, 64, 256)),
    prefill_shapes=({"batch": 4, "heads": 32, "kv_heads": 8, "seq": 2048, "head_dim": 128},
                    {"batch": 1, "heads": 32, "kv_heads": 8, "seq": 8192, "head_dim": 128},
                    {"batch": 1, "heads": 32, "kv_heads": 8, "seq": 16384, "head_dim": 128},
                    {"batch": 1, "heads": 32, "kv_heads": 8, "seq": 8192, "head_dim": 64}),
)
