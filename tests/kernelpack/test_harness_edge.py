"""Edge-value inputs and production-shape numerics (kernelpack.harness.edge) on the real ops, interpreter."""

from __future__ import annotations

import dataclasses
import importlib
import math

import pytest
import torch

from kernelpack.harness.edge import CASES, check_edge, check_production, dtypes_of, edge_cases, edge_seed
from kernelpack.kernels.spec import DTYPES as DTYPE

OPS = ("bias_gelu", "bias_gelu_tanh", "add_rmsnorm", "add_layernorm", "swiglu", "softmax_causal", "rope", "fp8_quant",
       "flash_attn", "decode_attn")
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
            outs = check_edge((op, {}), stable, dtype, small(op), device=CPU)
            assert {o.case for o in outs} >= set(CASES) - {"zero_tensor"} or name == "softmax_causal"
            bad = [(o.case, o.result.output, o.result.nonfinite) for o in outs if not o.result.passed]
            assert not bad, (name, dtype, bad)


def test_edge_cases_are_what_they_say() -> None:
    op = op_of("swiglu")
    cases = dict(edge_cases(op, {"tokens": 6, "hidden": 16}, "fp16", CPU))
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
    outs = check_edge((bad_op, {}), (base, {}), "fp32", {"tokens": 3, "hidden": 40}, device=CPU)
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
    near = dict(edge_cases(flash, shape, "bf16", torch.device("cpu")))["near_max"]
    top = max(float(t.abs().max()) for t in near.values() if isinstance(t, torch.Tensor))
    assert 1e17 < top <= 1e18 * 1.01  # bf16 rounding
    norm = importlib.import_module("kernelpack.kernels.add_layernorm").OP
    assert norm.domain.max_abs is None
    near = dict(edge_cases(norm, {"tokens": 3, "hidden": 40}, "bf16", torch.device("cpu")))["near_max"]
    assert max(float(t.abs().max()) for t in near.values() if isinstance(t, torch.Tensor)) > 1e38


# --------------------------------------------------------------------------- what the first GPU runs found
def _exp_op(gpu_nan: bool):  # type: ignore[no-untyped-def]
    """A tiny op y = exp(x) whose ``run`` writes NaN/Inf the way an NVIDIA GPU encodes them (a computed NaN
    has every mantissa bit set: 0x7FFF in fp16/bf16, 0x7FFFFFFF in fp32) when ``gpu_nan``; else torch's."""
    from kernelpack.kernels.spec import DimRange, Domain, KernelOp, Tolerance

    def run(inputs, outs, config):  # type: ignore[no-untyped-def]
        y = torch.exp(inputs["x"].float()) - torch.where(inputs["x"] > 1e3, torch.inf, 0.0)  # inf - inf: NaN
        outs[0].copy_(y.to(outs[0].dtype))
        if gpu_nan:
            bits = {torch.float16: (torch.int16, 0x7FFF), torch.bfloat16: (torch.int16, 0x7FFF),
                    torch.float32: (torch.int32, 0x7FFFFFFF)}[outs[0].dtype]
            outs[0].view(bits[0])[torch.isnan(outs[0])] = bits[1]

    return KernelOp(
        name="exp", description="y = exp(x)", tolerances={"fp16": Tolerance(1e-3, 1e-3), "fp32": Tolerance(1e-6, 1e-6)},
        domain=Domain(dtypes=("fp16", "fp32"), dims={"tokens": DimRange(1, 64), "hidden": DimRange(1, 64)}),
        make_inputs=lambda s, dt, dev, g: {"x": torch.randn(s["tokens"], s["hidden"], generator=g).to(dev, dt)},
        shape_of=lambda i: {"tokens": i["x"].shape[0], "hidden": i["x"].shape[1]},
        alloc_outputs=lambda i: (torch.empty_like(i["x"]),), run=run,
        reference=lambda i: (torch.exp(i["x"].double()),), eager=lambda i: (torch.exp(i["x"]),),
        bytes_moved=lambda s, dt: 0)


@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
def test_a_gpu_encoded_nan_is_a_computed_nan_not_an_unwritten_element(dtype: str) -> None:
    """The poison used to be the NVIDIA canonical NaN: on a GPU every NaN a kernel computed read as
    "unwritten", which no non-finite reference can excuse (a stable bundle failed its own edge checks)."""
    from kernelpack.harness.numerics import COMPUTED_NANS, poison_, poisoned_mask

    for dt, patterns in COMPUTED_NANS.items():
        ints = poison_(torch.empty(4, dtype=dt)).view({2: torch.int16, 4: torch.int32, 8: torch.int64}[dt.itemsize])
        assert int(ints[0]) not in patterns, dt
        for bits in patterns:
            nan = torch.full((4,), bits, dtype=ints.dtype).view(dt)
            assert bool(torch.isnan(nan).all()) and not bool(poisoned_mask(nan).any()), (dt, hex(bits))
    shape = {"tokens": 4, "hidden": 8}
    for gpu_nan in (False, True):
        outs = check_edge((_exp_op(gpu_nan), {}), None, dtype, shape, device=CPU)
        near = [o.result for o in outs if o.case == "near_max"]
        # exp(0.5 * max) overflows in float64 too: the reference is not finite, the NaN/Inf is excused
        assert near and all(r.passed and r.unwritten == 0 for r in near), near
        assert all(o.result.passed for o in outs), [(o.case, o.result) for o in outs if not o.result.passed]


def test_a_nan_where_the_reference_is_finite_is_counted_as_nonfinite_on_gpu_encoding() -> None:
    op = _exp_op(True)

    def run(inputs, outs, config):  # type: ignore[no-untyped-def]
        outs[0].copy_(torch.exp(inputs["x"].float()).to(outs[0].dtype))
        outs[0].view(torch.int16)[0, :2] = 0x7FFF  # NaN as a GPU writes it, where exp is finite

    outs = check_edge((dataclasses.replace(op, run=run), {}), (op, {}), "fp16", {"tokens": 4, "hidden": 8},
                      device=CPU)
    zero = next(o.result for o in outs if o.case == "zero_tensor")
    assert not zero.passed and zero.nonfinite == 2 and zero.unwritten == 0


@pytest.mark.parametrize("name", OPS)
def test_edge_inputs_are_finite_inside_the_dtype_and_deterministic(name: str) -> None:
    """Every edge input is a finite value of its dtype (mixed_scale used to overflow fp16 to inf on some
    seeds: softmax_causal fp16 then wrote NaN rows) and depends on (op, dtype, shape) only."""
    op = op_of(name)
    shapes = [small(op), *op.test_shapes]
    if name == "softmax_causal":
        shapes.append({"bh": 2, "q": 64, "k": 64})  # 128 rows x 64 keys: the old scaling overflowed here
    for dtype in dtypes_of(op):
        fi = torch.finfo(DTYPE[dtype])
        for shape in shapes:
            torch.manual_seed(1)
            a = edge_cases(op, shape, dtype, CPU)
            torch.manual_seed(2)  # the global RNG does not matter
            b = edge_cases(op, shape, dtype, CPU)
            assert [c for c, _ in a] == [c for c, _ in b]
            for (case, ia), (_, ib) in zip(a, b, strict=True):
                for k, t in ia.items():
                    if not isinstance(t, torch.Tensor):  # a run-time parameter (eps): a value of its domain
                        assert t == ib[k] and op.domain.params[k].contains(t), (case, k)
                        continue
                    assert torch.equal(t.view(-1).view(torch.uint8), ib[k].view(-1).view(torch.uint8)), (case, k)
                    if t.is_floating_point():
                        assert bool(torch.isfinite(t).all()), (name, dtype, shape, case, k)
                        if case == "mixed_scale" and t.dtype == DTYPE[dtype] and t.dim() >= 2:
                            assert float(t.abs().max()) <= min(1e6, fi.max / 10) * 1.01, (name, dtype, case, k)
    if len(dtypes_of(op)) > 1:
        d0, d1 = dtypes_of(op)[:2]
        assert edge_seed(op.name, d0, small(op)) != edge_seed(op.name, d1, small(op))


def test_edge_and_production_results_repeat_exactly() -> None:
    op = op_of("softmax_causal")
    a = [dataclasses.asdict(o.result) for o in check_edge((op, {}), None, "fp16", small(op), device=CPU)]
    b = [dataclasses.asdict(o.result) for o in check_edge((op, {}), (op, {}), "fp16", small(op), device=CPU)]
    assert [r["max_abs_err"] for r in a] == [r["max_abs_err"] for r in b] and all(r["passed"] for r in a + b)
    sw = op_of("swiglu")
    shape = {"tokens": 40, "hidden": 16}
    r1, _ = check_production((sw, {}), None, "fp16", shape, device=CPU, token_dim="tokens")
    r2, _ = check_production((sw, {}), None, "fp16", shape, device=CPU, token_dim="tokens")
    assert r1[0].seed == r2[0].seed == edge_seed("swiglu", "fp16", shape)
    assert r1[0].max_abs_err == r2[0].max_abs_err and r1[0].passed
