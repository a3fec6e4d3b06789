"""flash_attn's two code paths (the ``TMA`` launch-config flag) on CPU through the Triton interpreter: the
tensor-descriptor (Hopper) kernel against the float64 reference and against the pointer kernel, with tiles
that cross the end of the sequence, GQA and host-made descriptors; the
harness's edge values and scores far beyond an additive mask; an unaligned input falls back to the pointer
kernel; config validation; and the Hopper kernel compiled for sm_90 in a child process without the interpreter
(TMA copies and wgmma in its PTX, within the H100's shared memory)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import kernelpack.kernels.flash_attn as fa
from kernelpack.kernels.spec import DTYPES

DEV = torch.device("cpu")
SHAPES = ({"batch": 2, "heads": 4, "kv_heads": 2, "seq": 45, "head_dim": 64},
          {"batch": 1, "heads": 2, "kv_heads": 1, "seq": 96, "head_dim": 128})
# small tiles so that a sequence spans several query and key blocks and its last tiles cross the end
# and with HOST_DESC host-made descriptors where the sequence fills the tiles (96 tokens), the device's where not
TMA_CONFIGS = ({"TMA": 1, "BLOCK_M": 32, "BLOCK_N": 16}, {"TMA": 1, "BLOCK_M": 16, "BLOCK_N": 32},
               {"TMA": 1, "HOST_DESC": 1, "BLOCK_M": 32, "BLOCK_N": 16})


class _Spy:
    """Records the grid and the HOST_DESC switch of each launch of a kernel (``kernel[grid](...)``)."""

    def __init__(self, kernel: object) -> None:
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid: tuple) -> object:
        def launch(*args: object, **kwargs: object) -> object:
            self.grids.append((*grid, kwargs["HOST_DESC"]))
            return self.kernel[grid](*args, **kwargs)

        return launch


def _run(inputs: dict, cfg: dict) -> torch.Tensor:
    o = torch.full_like(inputs["q"], float("nan"))
    fa.OP.run(inputs, (o,), cfg)
    return o


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("cfg", TMA_CONFIGS)
def test_tma_path_matches_reference_and_pointer_path(dtype: str, cfg: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    spy = _Spy(fa._flash_attn_fwd_tma)
    monkeypatch.setattr(fa, "_flash_attn_fwd_tma", spy)
    tol = fa.OP.tolerances[dtype]
    for i, shape in enumerate(SHAPES):
        inputs = fa.OP.make_inputs(shape, DTYPES[dtype], DEV, torch.Generator().manual_seed(40 + i))
        out = _run(inputs, cfg)
        ref = fa.OP.reference(inputs)[0]
        assert not torch.isnan(out.float()).any(), f"{cfg} {shape}: unwritten output"
        err = (out.double() - ref).abs()
        assert bool((err <= tol.atol + tol.rtol * ref.abs()).all()), f"{cfg} {shape}: max err {float(err.max()):.3g}"
        # the interpreter computes both kernels' arithmetic alike: any index slip shows as a difference
        pointer = _run(inputs, {"BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"]})
        assert torch.equal(out, pointer), f"{cfg} {shape}: TMA and pointer kernels differ"
    host = "HOST_DESC" in cfg
    assert spy.grids == ([(2, 8, False), (3, 2, host)] if cfg["BLOCK_M"] == 32 else [(3, 8, False), (6, 2, False)])


def test_unaligned_input_takes_the_pointer_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A descriptor's base must be 16-byte aligned: q at an odd storage offset runs the pointer kernel."""
    spy = _Spy(fa._flash_attn_fwd_tma)
    monkeypatch.setattr(fa, "_flash_attn_fwd_tma", spy)
    inputs = fa.OP.make_inputs(SHAPES[0], torch.float16, DEV, torch.Generator().manual_seed(9))
    buf = torch.empty(inputs["q"].numel() + 1, dtype=torch.float16)
    q = buf[1:].view_as(inputs["q"])
    q.copy_(inputs["q"])
    out = _run({**inputs, "q": q}, TMA_CONFIGS[0])
    assert spy.grids == []
    assert torch.equal(out, _run(inputs, TMA_CONFIGS[0]))
    assert spy.grids == [(2, 8, False)]


@pytest.mark.parametrize("cfg", [TMA_CONFIGS[0]])
def test_tma_path_passes_every_edge_case(cfg: dict) -> None:
    """The harness's edge values (zeros, constants, near the declared magnitude cap, subnormals, the op's own),
    the pointer kernel as the stable version to compare with."""
    from kernelpack.harness.edge import check_edge

    for dtype in fa.OP.domain.dtypes:
        outs = check_edge((fa.OP, cfg), (fa.OP, {}), dtype, SHAPES[0], device=DEV)
        bad = [(o.case, o.result.output, o.result.nonfinite) for o in outs if not o.result.passed]
        assert outs and not bad, (dtype, bad)


@pytest.mark.parametrize("cfg", [{}, *TMA_CONFIGS])
def test_mask_holds_for_scores_far_beyond_any_additive_bias(cfg: dict) -> None:
    """Scores of ~1e7 (inside the declared |x| <= 1e18): a masked key must get no weight (an additive -1e6
    mask, as the tutorial writes it, would let future keys in)."""
    tol = fa.OP.tolerances["bf16"]
    inputs = fa.OP.make_inputs(SHAPES[0], torch.bfloat16, DEV, torch.Generator().manual_seed(77))
    inputs = {k: (v * 3000 if k in ("q", "k") else v) for k, v in inputs.items()}
    out, ref = _run(inputs, cfg), fa.OP.reference(inputs)[0]
    err = (out.double() - ref).abs()
    assert bool((err <= tol.atol + tol.rtol * ref.abs()).all()), float(err.max())


def test_path_flags_are_validated() -> None:
    inputs = fa.OP.make_inputs(SHAPES[0], torch.float16, DEV, torch.Generator())
    with pytest.raises(ValueError, match="WARP_SPECIALIZE"):  # wrong on an H100 with Triton 3.6: not offered
        fa.OP(inputs, {"TMA": 1, "WARP_SPECIALIZE": 1})
    with pytest.raises(ValueError, match="TMA=2 must be 0 or 1"):
        fa.OP(inputs, {"TMA": 2})
    with pytest.raises(ValueError, match="HOST_DESC=1 needs TMA=1"):
        fa.OP(inputs, {"HOST_DESC": 1})
    assert {c["TMA"] for c in fa.TUNING_SPACE} == {0, 1}


AOT_SCRIPT = """
import sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
import kernelpack.kernels.flash_attn as fa
for cfg in ({"TMA": 1, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3},
            {"TMA": 1, "HOST_DESC": 1, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}):
    spec = fa.aot("bf16", cfg)[-1]
    assert spec.fn is fa._flash_attn_fwd_tma and spec.constexprs["HEAD_DIM"] == 128
    k = compile(ASTSource(spec.fn, signature=spec.signature, constexprs=spec.constexprs),
                target=GPUTarget("cuda", 90, 32), options={"num_warps": spec.num_warps, "num_stages": spec.num_stages})
    ptx = k.asm["ptx"]
    print(ptx.count("cp.async.bulk.tensor"), ptx.count("wgmma.mma_async"),
          k.metadata.shared, k.metadata.global_scratch_size)
"""


def test_hopper_kernel_compiles_for_sm90_with_tma_and_wgmma() -> None:
    """Compiled for sm_90 on the CPU (a real JIT function: a child without TRITON_INTERPRET)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", AOT_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [list(map(int, line.split())) for line in r.stdout.split("\n") if line.strip()]
    assert len(rows) == 2, r.stdout
    for i, (tma, wgmma, shared, scratch) in enumerate(rows):
        assert tma > 0 and wgmma > 0, r.stdout
        assert shared <= 227 * 1024, r.stdout  # the H100's shared memory per block
        assert (scratch == 0) == (i == 1), r.stdout  # descriptors made on the device need scratch
