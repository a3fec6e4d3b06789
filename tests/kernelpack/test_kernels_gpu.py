"""The fused kernels on a real CUDA GPU: decode and prefill sizes and every tuning config against the float64
reference (computed on the GPU), outputs poisoned first; one launch per call; CUDA-graph capture and replay."""

from __future__ import annotations

import importlib
import random

import pytest
import torch

from kernelpack.kernels.spec import DTYPES, KernelOp, Tolerance

# Deselected on CPU by the default `-m "not gpu"`; run on a GPU with `pytest -m gpu` (through the device tool).
pytestmark = pytest.mark.gpu

MODULES = [
    "bias_gelu", "bias_gelu_tanh", "add_rmsnorm", "add_layernorm", "swiglu",
    "softmax_causal", "rope", "fp8_quant", "flash_attn", "decode_attn",
]
MODS = {m: importlib.import_module(f"kernelpack.kernels.{m}") for m in MODULES}
OPS: dict[str, KernelOp] = {m: MODS[m].OP for m in MODULES}
CASES = [(m, d) for m in MODULES for d in OPS[m].domain.dtypes]
DEV = torch.device("cuda")


def within(out: torch.Tensor, ref: torch.Tensor, tol: Tolerance) -> tuple[bool, float]:
    o = out.double()
    err = (o - ref).abs()
    ok = bool(torch.isfinite(o).all()) and bool((err <= tol.atol + tol.rtol * ref.abs()).all())
    return ok, float(err.max()) if err.numel() else 0.0


def check(op: KernelOp, dtype: str, shape: dict, config: dict, seed: int) -> None:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    inputs = op.make_inputs(shape, DTYPES[dtype], DEV, gen)
    outs = op.alloc_outputs(inputs)
    for o in outs:
        o.fill_(float("nan"))
    op.run(inputs, outs, config)
    torch.cuda.synchronize()
    refs = op.reference(inputs)
    for i, (o, r) in enumerate(zip(outs, refs, strict=True)):
        assert not torch.isnan(o.float()).any(), f"{op.name} {dtype} {shape}: output {i} not fully written"
        ok, err = within(o, r, op.tolerances[dtype])
        assert ok, f"{op.name} {dtype} {shape} {config}: output {i} max abs err {err:.3g}"


def small_prefill(op: KernelOp) -> dict:
    """The cheapest prefill shape (the float64 reference of attention at prefill sizes is large)."""
    return min(op.prefill_shapes, key=lambda s: op.bytes_moved(s, torch.bfloat16) + op.flops(s) / 1000)


@pytest.mark.parametrize(("mod", "dtype"), CASES)
def test_gpu_matches_reference(mod: str, dtype: str) -> None:
    op = OPS[mod]
    rng = random.Random(hash((mod, dtype)) & 0xFFFF)
    shapes = [*op.test_shapes, *(op.fuzz(rng) for _ in range(3)), *op.decode_shapes, small_prefill(op)]
    for i, shape in enumerate(shapes):
        check(op, dtype, shape, dict(op.default_config), seed=i + rng.randint(0, 1 << 20))


@pytest.mark.parametrize("mod", MODULES)
def test_gpu_every_tuning_config_is_correct(mod: str) -> None:
    op = OPS[mod]
    dtype = "bf16"
    shapes = [op.decode_shapes[-1], op.fuzz(random.Random(5))]
    for cfg in MODS[mod].TUNING_SPACE:
        for j, shape in enumerate(shapes):
            check(op, dtype, shape, cfg, seed=j)


@pytest.mark.parametrize("mod", MODULES)
def test_gpu_one_launch_per_call_and_cuda_graph_replay(mod: str) -> None:
    op = OPS[mod]
    shape = op.decode_shapes[1]
    inputs = op.make_inputs(shape, torch.bfloat16, DEV, torch.Generator(device=DEV).manual_seed(1))
    outs = op.alloc_outputs(inputs)
    op.run(inputs, outs, op.default_config)  # compile outside the profiler and the capture
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        op.run(inputs, outs, op.default_config)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA" and "memcpy" not in e.name.lower()
               and "memset" not in e.name.lower()]
    assert len(kernels) == op.launches_per_call, [e.name for e in kernels]

    for o in outs:
        o.fill_(float("nan"))
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        op.run(inputs, outs, op.default_config)
    torch.cuda.current_stream().wait_stream(s)
    g.replay()
    torch.cuda.synchronize()
    for o, r in zip(outs, op.reference(inputs), strict=True):
        assert within(o, r, op.tolerances["bf16"])[0]
