"""Numerics harness: poisoning, tolerance, version difference, shape fuzzing (CPU interpreter, tiny ops)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses
import json
import math
import random

import pytest
import triton
import triton.language as tl

from kernelpack.harness.numerics import (
    HarnessError,
    check_numerics,
    fuzz_shapes,
    poison_,
    poisoned_mask,
)
from kernelpack.kernels.spec import DimRange, Domain, KernelOp, Tolerance

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _axpy_kernel(x_ptr, y_ptr, out_ptr, n, alpha, skip_last, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n - skip_last
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out = x * alpha + y
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x, y, out, alpha: float, block: int, skip_last: int = 0) -> None:
    n = out.numel()
    _axpy_kernel[(triton.cdiv(n, block),)](x, y, out, n, alpha, skip_last, BLOCK=block)


def make_axpy(variant: str = "good", alpha: float = 2.0) -> KernelOp:
    """A real one-kernel Triton op ``out = alpha*x + y`` and deliberately broken variants of it.

    variants: good | unwritten (skips the last element) | drift (alpha off by 5%) | twolaunch (two kernels:
    tmp = alpha*x, out = tmp + y) | slow (launches the kernel 5 times) | inplace (writes into input y).
    """

    def make_inputs(shape, dtype, device, gen):
        n = shape["n"]
        return {
            "x": torch.randn(n, generator=gen).to(device, dtype),
            "y": torch.randn(n, generator=gen).to(device, dtype),
        }

    def run(inputs, outs, config):
        x, y, (out,) = inputs["x"], inputs["y"], outs
        block = int(config["BLOCK"])
        if variant == "unwritten":
            _launch(x, y, out, alpha, block, skip_last=1)
        elif variant == "drift":
            _launch(x, y, out, alpha * 1.05, block)
        elif variant == "twolaunch":
            tmp = torch.empty_like(out)
            _launch(x, torch.zeros_like(y), tmp, alpha, block)
            _launch(tmp, y, out, 1.0, block)
        elif variant == "slow":
            for _ in range(5):
                _launch(x, y, out, alpha, block)
        elif variant == "inplace":
            _launch(x, y, y, alpha, block)
            out.copy_(y)
        else:
            _launch(x, y, out, alpha, block)

    def reference(inputs):
        return (inputs["x"].double() * alpha + inputs["y"].double(),)

    def eager(inputs):
        return (inputs["x"] * alpha + inputs["y"],)

    return KernelOp(
        name="axpy",
        description=f"out = {alpha}*x + y ({variant})",
        domain=Domain(dtypes=("fp32", "fp16", "bf16"), dims={"n": DimRange(1, 1 << 20)}),
        tolerances={"fp32": Tolerance(1e-5, 1e-5), "fp16": Tolerance(2e-3, 2e-3), "bf16": Tolerance(2e-2, 2e-2)},
        make_inputs=make_inputs,
        shape_of=lambda inputs: {"n": inputs["x"].numel()},
        alloc_outputs=lambda inputs: (torch.empty_like(inputs["x"]),),
        run=run,
        reference=reference,
        eager=eager,
        bytes_moved=lambda shape, dtype: 3 * shape["n"] * torch.empty((), dtype=dtype).element_size(),
        flops=lambda shape: 2 * shape["n"],
        test_shapes=({"n": 100}, {"n": 257}),
        fuzz=lambda rng: {"n": rng.randint(1, 600)},
        default_config={"BLOCK": 128},
        launches_per_call=2 if variant == "twolaunch" else 1,
    )


SHAPES = [{"n": 100}, {"n": 257}]


def test_good_op_passes_and_serialises():
    res = check_numerics(make_axpy(), {}, "fp32", SHAPES, device=DEVICE, seed=1)
    assert len(res) == 2
    assert all(r.passed and r.within_tolerance for r in res)
    assert all(r.unwritten == 0 and r.nonfinite == 0 for r in res)
    assert res[1].n_elements == 257 and res[1].shape == {"n": 257}
    assert res[0].max_abs_err <= 1e-5
    d = dataclasses.asdict(res[0])
    assert json.loads(json.dumps(d))["passed"] is True


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_poisoning_catches_unwritten_element(dtype):
    res = check_numerics(make_axpy("unwritten"), {"BLOCK": 64}, dtype, SHAPES, device=DEVICE, seed=2)
    assert all(r.unwritten == 1 for r in res)
    assert all(r.nonfinite == 0 for r in res)  # a poison element is "unwritten", not a computed NaN
    assert not any(r.passed or r.within_tolerance for r in res)


def test_tolerance_catches_drift():
    res = check_numerics(make_axpy("drift"), {}, "fp16", SHAPES, device=DEVICE, seed=3)
    assert all(r.unwritten == 0 for r in res)
    assert not any(r.within_tolerance for r in res)
    assert all(r.n_out_of_tol > 0 and r.max_abs_err > 2e-3 for r in res)
    assert all(r.max_rel_err > 0.01 for r in res)


def test_against_detects_version_difference():
    stable = (make_axpy(), {"BLOCK": 64})
    same = check_numerics(make_axpy(), {"BLOCK": 128}, "fp32", SHAPES, device=DEVICE, seed=4, against=stable)
    assert all(r.against_within_tolerance is True and r.against_max_abs_diff <= 1e-6 for r in same)
    diff = check_numerics(make_axpy("drift"), {}, "fp32", SHAPES, device=DEVICE, seed=4, against=stable)
    assert all(r.against_within_tolerance is False for r in diff)
    assert all(r.against_max_abs_diff > 1e-3 for r in diff)
    assert not any(r.passed for r in diff)


def test_input_clobbering_is_reported():
    res = check_numerics(make_axpy("inplace"), {}, "fp32", SHAPES[:1], device=DEVICE, seed=5)
    assert res[0].inputs_modified and res[0].within_tolerance and not res[0].passed


def test_nan_output_is_never_a_pass():
    op = make_axpy()

    def nan_inputs(shape, dtype, device, gen):
        x = torch.randn(shape["n"], generator=gen).to(device, dtype)
        x[3] = float("nan")
        return {"x": x, "y": torch.zeros_like(x)}

    op.make_inputs = nan_inputs
    res = check_numerics(op, {}, "fp32", SHAPES[:1], device=DEVICE, seed=6)
    assert res[0].nonfinite == 1 and res[0].unwritten == 0
    assert not res[0].passed and math.isinf(res[0].max_abs_err)


def test_seeded_inputs_are_reproducible():
    a = check_numerics(make_axpy("drift"), {}, "fp16", SHAPES, device=DEVICE, seed=7)
    b = check_numerics(make_axpy("drift"), {}, "fp16", SHAPES, device=DEVICE, seed=7)
    c = check_numerics(make_axpy("drift"), {}, "fp16", SHAPES, device=DEVICE, seed=8)
    assert [r.max_abs_err for r in a] == [r.max_abs_err for r in b]
    assert [r.max_abs_err for r in a] != [r.max_abs_err for r in c]


def test_poison_patterns_roundtrip():
    for dt in (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.int32):
        t = poison_(torch.empty(8, dtype=dt))
        assert bool(poisoned_mask(t).all()), dt
        if dt.is_floating_point:
            assert bool(torch.isnan(t.to(torch.float32)).all()), dt
            computed_nan = torch.full((8,), float("nan")).to(dt)
            if dt.itemsize > 1:  # fp8 has a single NaN encoding per sign; wider floats have spare payloads
                assert not bool(poisoned_mask(computed_nan).any()), dt


def test_bad_input_errors_are_clear():
    op = make_axpy()
    with pytest.raises(HarnessError, match="unknown dtype 'fp64'"):
        check_numerics(op, {}, "fp64", SHAPES, device=DEVICE, seed=0)
    with pytest.raises(ValueError, match=r"n=0 outside \[1, 1048576\]"):
        check_numerics(op, {}, "fp32", [{"n": 0}], device=DEVICE, seed=0)
    with pytest.raises(HarnessError, match="no shapes"):
        check_numerics(op, {}, "fp32", [], device=DEVICE, seed=0)


def test_fuzz_shapes_inside_domain_and_seedable():
    op = make_axpy()
    a = fuzz_shapes(op, 20, random.Random(3))
    assert a == fuzz_shapes(op, 20, 3)
    assert all(op.domain.dims["n"].contains(s["n"]) for s in a)
    assert len({s["n"] for s in fuzz_shapes(op, 20, None)}) > 1
    res = check_numerics(op, {}, "fp32", a[:3], device=DEVICE, seed=0)
    assert all(r.passed for r in res)


def test_real_op_bias_gelu_against_itself_and_reference():
    from kernelpack.kernels.bias_gelu import OP

    shapes = list(OP.test_shapes[:1]) + fuzz_shapes(OP, 1, 0)
    res = check_numerics(OP, {"BLOCK_N": 64}, "bf16", shapes, device=DEVICE, seed=0,
                         against=(OP, {"BLOCK_N": 32, "BLOCK_M": 2}))
    assert len(res) == 2 and all(r.passed for r in res), res
    assert all(r.against_max_abs_diff == 0.0 for r in res)  # same math, different tiling: bit-identical


def test_real_fp8_op_poisoning_catches_unwritten_row():
    from kernelpack.kernels.fp8_quant import OP

    shape = dict(OP.test_shapes[0])
    good = check_numerics(OP, {}, "fp32", [shape], device=DEVICE, seed=0)
    assert [r.passed for r in good] == [True, True]

    def skip_last_row(inputs, outs, config):
        tmp = OP.alloc_outputs(inputs)
        OP.run(inputs, tmp, config)
        outs[0][:-1].copy_(tmp[0][:-1])
        outs[1][:-1].copy_(tmp[1][:-1])

    bad = dataclasses.replace(OP, run=skip_last_row)
    res = check_numerics(bad, {}, "fp32", [shape], device=DEVICE, seed=0)
    assert [r.unwritten for r in res] == [shape["hidden"], 1]  # fp8 q row and its float32 scale
    assert not any(r.passed for r in res)
