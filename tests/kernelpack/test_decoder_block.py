"""Decoder block built from the bundle ops: stage math cross-checked, kernel block matches the float64
block, a drifting op is caught, interleaved latency reported (CPU interpreter, tiny sizes)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses
import json
import math

import pytest

from kernelpack.harness import decoder_block as db
from kernelpack.harness.numerics import HarnessError, make_generator
from kernelpack.kernels import add_rmsnorm, rope, softmax_causal, swiglu
from kernelpack.kernels.spec import DomainError

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = {"tokens": 8, "hidden": 64, "heads": 2, "head_dim": 16, "device": DEVICE}
KERNELS = {m.OP.name: (m.OP, {}) for m in (add_rmsnorm, rope, softmax_causal, swiglu)}


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=make_generator(None, seed), dtype=torch.float64)


def test_stage_math_matches_independent_references():
    x, r, w = _randn(5, 24, seed=1), _randn(5, 24, seed=2), _randn(24, seed=3)
    y, h = db.eager_add_rmsnorm(x, r, w)
    ry, rh = add_rmsnorm.OP.reference({"x": x, "residual": r, "weight": w})
    torch.testing.assert_close(y, ry)
    torch.testing.assert_close(h, rh)

    q, k = _randn(6, 3, 16, seed=4), _randn(6, 3, 16, seed=5)
    cos, sin = db.rope_tables(6, 16, torch.float64, torch.device("cpu"))
    rq, rk = rope.OP.reference({"q": q, "k": k, "cos": cos, "sin": sin})
    torch.testing.assert_close(db.eager_rope(q, cos, sin), rq)
    torch.testing.assert_close(db.eager_rope(k, cos, sin), rk)

    v = _randn(6, 3, 16, seed=6)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    ).transpose(0, 1)
    torch.testing.assert_close(db.eager_attention(q, k, v), sdpa)

    g, u = _randn(4, 8, seed=7), _randn(4, 8, seed=8)
    torch.testing.assert_close(db.eager_swiglu(g, u), swiglu.OP.reference({"gate": g, "up": u})[0])


def test_kernel_block_runs_and_matches_eager():
    res = db.decoder_block_latency({}, KERNELS, dtype="fp32", rounds=1, min_reps=1, **SMALL)
    assert res.kernels_a == [] and res.kernels_b == ["add_rmsnorm", "rope", "softmax_causal", "swiglu"]
    assert res.within_tolerance_a and res.within_tolerance_b
    assert res.max_abs_err_b < 1e-4 and res.eager_max_abs_err < 1e-4
    assert len(res.a_s) == len(res.b_s) == len(res.log_ratios) == 1
    assert res.log_ratios[0] == pytest.approx(math.log(res.b_s[0] / res.a_s[0]))
    assert res.intermediate == 128
    assert json.loads(json.dumps(dataclasses.asdict(res)))["kernels_b"][0] == "add_rmsnorm"


def test_drifting_op_in_block_is_caught():
    op = swiglu.OP

    def drifted_run(inputs, outs, config):
        op.run(inputs, outs, config)
        outs[0].mul_(1.2)

    bad = dataclasses.replace(op, run=drifted_run)
    good = db.decoder_block_numerics({"swiglu": (op, {})}, dtype="bf16", **SMALL)
    assert good.within_tolerance and good.kernels == ["swiglu"]
    worse = db.decoder_block_numerics({"swiglu": (bad, {})}, dtype="bf16", **SMALL)
    assert not worse.within_tolerance and worse.max_abs_err > 2 * worse.eager_max_abs_err + worse.atol


def test_bad_block_arguments_are_refused():
    with pytest.raises(HarnessError, match="head_dim must be even"):
        db.decoder_block_numerics({}, tokens=4, hidden=16, heads=1, head_dim=7)
    with pytest.raises(HarnessError, match="unknown dtype 'int8'"):
        db.decoder_block_numerics({}, tokens=4, hidden=16, heads=1, head_dim=8, dtype="int8")
    with pytest.raises(HarnessError, match="rounds must be >= 1"):
        db.decoder_block_latency({}, {}, tokens=4, hidden=16, heads=1, head_dim=8, rounds=0)
    with pytest.raises(DomainError, match="hidden=20 outside"):
        db.decoder_block_numerics({"add_rmsnorm": KERNELS["add_rmsnorm"]}, tokens=4, hidden=20, heads=1,
                                  head_dim=8)


def test_flash_attention_block_in_bf16():
    from kernelpack.kernels import flash_attn

    ops = {**KERNELS, "flash_attn": (flash_attn.OP, {})}
    sizes = db.DEFAULT_SIZES["cuda" if torch.cuda.is_available() else "cpu"]
    num = db.decoder_block_numerics(ops, dtype="bf16", device=DEVICE, **sizes)
    assert num.kernels == ["add_rmsnorm", "rope", "flash_attn", "swiglu"]
    assert num.within_tolerance and math.isfinite(num.max_abs_err) and num.eager_max_abs_err > 0
