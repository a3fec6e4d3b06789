"""Edge-value inputs and production-shape numerics (kernelpack.harness.edge) on the real ops, interpreter."""

from __future__ import annotations

import dataclasses
import importlib
import math

import pytest
import torch

from kernelpack.harness.edge import CASES, check_edge, check_production, dtypes_of, edge_cases

OPS = ("bias_gelu", "bias_gelu_tanh", "add_rmsnorm", "add_layernorm", "swiglu", "softmax_causal", "rope", "fp8_quant",
       "flash_attn")
CPU = torch.device("cpu")


def op_of(name: str):  # type: ignore[no-untyped-def]
    return importlib.import_module(f"kernelpack.kernels.{name}").OP


def small(op) -> dict[str, int]:  # type: ignore[no-untyped-def]
    return dict(min(op.test_shapes, key=lambda s: math.prod(s.values())))


@pytest.mark.parametrize("name", OPS)
def test_shipped_kernels_pass_every_edge_case_in_every_dtype(name: str) -> None:
    """No false numeric error: every case, every dtype, with and without a stable version to compare."""
    op = op_of(name)
    for dtype in dtypes_of(op):
        for stable in (None, (op, {})):
            outs = check_edge((op, {}), stable, dtype, small(op), device=CPU, seed=7)
            assert {o.case for o in outs} >= set(CASES) - {"zero_tensor"} or name == "softmax_causal"
            bad = [(o.case, o.result.output, o.result.nonfinite) for o in outs if not o.result.passed]
            assert not bad, (name, dtype, bad)


def test_edge_cases_are_what_they_say() -> None:
    op = op_of("swiglu")
    cases = dict(edge_cases(op, {"tokens": 6, "hidden": 16}, "fp16", CPU, seed=1))
    assert not cases["zero_tensor"]["gate"].any() and not cases["zero_tensor"]["up"].any()
    g = cases["zero_rows"]["gate"]
    assert not g[0].any() and not g[3].any() and not g[-1].any() and g[1].any()
    c = cases["constant_rows"]["gate"]
    assert all(len(set(row.tolist())) == 1 for row in c)
    big = cases["near_max"]["gate"].abs().max().item()
    assert big >= 0.5 * torch.finfo(torch.float16).max * 0.99 and (cases["near_max"]["gate"] < 0).any()
    tiny = cases["tiny"]["gate"].abs()
    assert (tiny[tiny > 0] < torch.finfo(torch.float16).tiny * 1.01).all()  # tiny and subnormal
    assert torch.isfinite(cases["mixed_scale"]["gate"]).all()


def test_nan_on_a_zero_row_is_caught_and_drift_at_production_rows_is_caught() -> None:
    base = op_of("add_rmsnorm")
    mod = importlib.import_module("kernelpack.kernels.add_rmsnorm")

    def run_no_eps(inputs, outs, config):  # type: ignore[no-untyped-def]
        x = inputs["x"]
        y, h = outs
        t, n = x.shape
        mod._add_rmsnorm_fwd[(t,)](x, inputs["residual"], inputs["weight"], y, h, t, n, 0.0, BLOCK_M=1,
                                   BLOCK_N=mod._block_n(n), num_warps=4, num_stages=1)

    bad_op = dataclasses.replace(base, run=run_no_eps)
    outs = check_edge((bad_op, {}), (base, {}), "fp32", {"tokens": 3, "hidden": 40}, device=CPU, seed=3)
    failed = {o.case for o in outs if not o.result.passed}
    assert {"zero_tensor", "zero_rows"} <= failed and "near_max" not in failed

    sw = op_of("swiglu")

    def drifting(inputs, outs, config):  # type: ignore[no-untyped-def]
        sw.run(inputs, outs, config)
        outs[0][1000:] *= 1.03

    res, _ = check_production((dataclasses.replace(sw, run=drifting), {}), (sw, {}), "fp32",
                              {"tokens": 1100, "hidden": 16}, device=CPU, seed=5, token_dim="tokens")
    assert not res[0].passed and res[0].against_within_tolerance is False
    ok, _ = check_production((sw, {}), (sw, {}), "fp32", {"tokens": 1100, "hidden": 16}, device=CPU, seed=5,
                             token_dim="tokens")
    assert ok[0].passed and ok[0].against_max_abs_diff == 0.0


def test_near_limit_inputs_respect_the_ops_declared_magnitude_cap() -> None:
    """flash_attn declares |x| <= 1e18 (scores must fit float32): near_max stops there, bf16's limit is not used;
    an op without a cap still gets values at half the dtype's limit."""
    flash = importlib.import_module("kernelpack.kernels.flash_attn").OP
    assert flash.domain.max_abs == 1e18 and flash.domain.to_json()["max_abs"] == 1e18
    shape = {"batch": 1, "heads": 1, "seq": 8, "head_dim": 64}
    near = dict(edge_cases(flash, shape, "bf16", torch.device("cpu"), seed=3))["near_max"]
    top = max(float(t.abs().max()) for t in near.values())
    assert 1e17 < top <= 1e18 * 1.01  # bf16 rounding
    norm = importlib.import_module("kernelpack.kernels.add_layernorm").OP
    assert norm.domain.max_abs is None
    near = dict(edge_cases(norm, {"tokens": 3, "hidden": 40}, "bf16", torch.device("cpu"), seed=3))["near_max"]
    assert max(float(t.abs().max()) for t in near.values()) > 1e38
