"""Benchmark harness: timing, interleaved per-call latency, contended windows, launch counting, peak memory."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses
import json
import math
import time

import pytest

from kernelpack.harness.bench import (
    ArmTimes,
    arm_summary,
    bench_op,
    drop_contended,
    interleaved_calls,
    launches_per_call,
    median_time,
    paired_calls,
    peak_memory_bytes,
)
from kernelpack.harness.numerics import HarnessError, make_generator
from tests.kernelpack.test_harness_numerics import make_axpy

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_median_time_measures_the_call():
    fast = median_time(lambda: None, device="cpu", rep_ms=0, min_reps=5)
    slow = median_time(lambda: time.sleep(0.004), device="cpu", rep_ms=0, min_reps=5)
    assert 0.004 <= slow < 0.1 and fast < 0.001


def test_paired_calls_time_every_call_of_both_arms_interleaved():
    stable = (make_axpy(), {})
    slow = (make_axpy("slow"), {})
    st, ca = paired_calls(stable, slow, "fp32", {"n": 128}, device=DEVICE, seed=0, windows=3, quads=2)
    assert len(st.calls) == len(ca.calls) == 12 and len(st.windows) == len(ca.windows) == 3
    assert math.log(arm_summary(ca)["mean_s"] / arm_summary(st)["mean_s"]) > math.log(2.0)  # 5 launches vs 1
    s = arm_summary(st)
    assert s["n"] == 12 and s["p50_s"] <= s["p99_s"] == max(st.calls) and len(s["windows_s"]) == 3


def test_paired_calls_write_both_arms_into_the_same_output_buffers():
    """Where both versions allocate the same outputs, both arms write into one buffer: its placement in device
    memory is common to both, not a per-trial difference between them."""
    seen: dict[str, set[int]] = {"stable": set(), "candidate": set()}

    def recording(arm: str, op):  # type: ignore[no-untyped-def]
        def run(inputs, outs, config):  # type: ignore[no-untyped-def]
            seen[arm].add(outs[0].data_ptr())
            op.run(inputs, outs, config)
        return dataclasses.replace(op, run=run)

    paired_calls((recording("stable", make_axpy()), {}), (recording("candidate", make_axpy("slow")), {}), "fp32",
                 {"n": 64}, device=DEVICE, seed=0, windows=1, quads=1)
    assert len(seen["stable"]) == 1 and seen["stable"] == seen["candidate"]


def test_interleaving_is_abba_or_baab_at_random_and_a_budget_stops_early():
    order: list[str] = []
    a, b = interleaved_calls(lambda: order.append("a"), lambda: order.append("b"), device="cpu", windows=16, quads=2,
                             warmup_calls=0, seed=3)
    quads = ["".join(order[i:i + 4]) for i in range(0, len(order), 4)]
    assert set(quads) == {"abba", "baab"} and len(a.calls) == len(b.calls) == 64  # both orders: no periodic arm
    a, _ = interleaved_calls(lambda: time.sleep(0.002), lambda: None, device="cpu", windows=50, quads=1,
                             warmup_calls=0, budget_s=0.001, min_windows=4)
    assert len(a.windows) == 4


def test_a_gpu_window_that_ran_dry_is_dropped_and_the_sleep_doubled(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU windows' control flow, the device's answer stood in for (no GPU on this machine; the GPU path itself
    runs in docs/gpu.md's runs): a window whose sleep ran out before its last call was enqueued is not recorded,
    the sleep doubles for that window and the rest of the cell, and past MAX_SLEEP_DOUBLINGS a window counts."""
    from kernelpack.harness import bench

    seen: list[tuple[int, bool]] = []

    def window(fns, order, dev, rng, cycles, keep_dry=False):  # type: ignore[no-untyped-def]
        seen.append((cycles, keep_dry))
        if cycles < need and not keep_dry:
            return None  # the host took longer than the sleep
        return [1e-6 * (1 + arm) for arm in order]

    monkeypatch.setattr(bench, "_is_cuda", lambda dev: True)
    monkeypatch.setattr(bench, "_cuda_window", window)
    s = bench.SLEEP_CYCLES
    need = 4 * s
    a, b = interleaved_calls(lambda: None, lambda: None, device="cpu", windows=3, quads=2, warmup_calls=0)
    assert [c for c, _ in seen] == [s, 2 * s, 4 * s, 4 * s, 4 * s]  # dropped twice, then the longer sleep stays
    assert len(a.windows) == len(b.windows) == 3 and len(a.calls) == 12
    assert set(a.calls) == {1e-6} and set(b.calls) == {2e-6}  # only the recorded windows' calls
    seen.clear()
    need = 10**12  # a host that never keeps up
    a, _ = interleaved_calls(lambda: None, lambda: None, device="cpu", windows=2, quads=1, warmup_calls=0)
    cap = s * 2 ** bench.MAX_SLEEP_DOUBLINGS
    assert seen[-2:] == [(cap, True), (cap, True)] and len(seen) == bench.MAX_SLEEP_DOUBLINGS + 2
    assert len(a.windows) == 2


def test_a_window_is_contended_only_when_both_arms_ran_slow_in_it():
    st = ArmTimes([1.0, 1.0, 5.0, 5.0, 1.0, 1.0, 1.0, 1.0], [1.0, 5.0, 1.0, 1.0])
    ca = ArmTimes([2.0, 2.0, 9.0, 9.0, 2.0, 2.0, 2.0, 2.0], [2.0, 9.0, 2.0, 2.0])
    s2, c2, dropped = drop_contended(st, ca)
    assert dropped == 1 and s2.calls == [1.0] * 6 and c2.calls == [2.0] * 6 and c2.windows == [2.0] * 3
    # a candidate slow in some windows: nothing dropped (its own slowness never hides) ...
    _, c3, dropped = drop_contended(ArmTimes([1.0] * 8, [1.0] * 4), ArmTimes([1.0] * 6 + [9.0] * 2, [1, 1, 1, 9]))
    assert dropped == 0 and c3.calls[-1] == 9.0
    # ... nor stable slow alone: contention that hit one arm stays, as noise of either sign
    _, _, dropped = drop_contended(st, ArmTimes([2.0] * 8, [2.0] * 4))
    assert dropped == 0


def test_paired_calls_rejects_bad_arguments():
    op = (make_axpy(), {})
    with pytest.raises(HarnessError, match="windows and quads must be >= 1"):
        paired_calls(op, op, "fp32", {"n": 8}, device=DEVICE, seed=0, windows=0, quads=1)
    other = make_axpy()
    other.name = "rope"
    with pytest.raises(HarnessError, match="cannot pair different ops"):
        paired_calls(op, (other, {}), "fp32", {"n": 8}, device=DEVICE, seed=0, windows=1, quads=1)


def _inputs(op, n=300):
    dev = torch.device(DEVICE)
    return op.make_inputs({"n": n}, torch.float32, dev, make_generator(dev, 0))


def test_launches_per_call_counts_real_launches():
    one = make_axpy()
    two = make_axpy("twolaunch")
    five = make_axpy("slow")
    assert launches_per_call(one, {}, _inputs(one)) == 1
    assert launches_per_call(two, {}, _inputs(two)) == 2
    assert launches_per_call(five, {"BLOCK": 64}, _inputs(five)) == 5
    # counting is scoped: a launch outside the call is not counted next time
    assert launches_per_call(one, {}, _inputs(one)) == 1


def test_peak_memory_sees_allocations():
    keep = []
    small = peak_memory_bytes(lambda: keep.append(torch.empty(10, device=DEVICE)), device=DEVICE)
    big = peak_memory_bytes(lambda: keep.append(torch.empty(1 << 20, device=DEVICE)), device=DEVICE)
    temp = peak_memory_bytes(lambda: torch.empty(1 << 19, device=DEVICE).sum(), device=DEVICE)
    assert big >= 4 << 20 and small < 4096
    assert temp >= 2 << 20


def test_two_launch_op_uses_more_memory():
    one, two = make_axpy(), make_axpy("twolaunch")
    r1 = bench_op(one, {"BLOCK": 2048}, "fp32", {"n": 4096}, device=DEVICE)
    r2 = bench_op(two, {"BLOCK": 2048}, "fp32", {"n": 4096}, device=DEVICE)
    assert r1.peak_memory_bytes >= 4096 * 4  # the output buffer
    assert r2.peak_memory_bytes >= r1.peak_memory_bytes + 4096 * 4  # + its temporary
    assert (r1.launches_per_call, r2.launches_per_call) == (1, 2)


def test_bench_op_result():
    res = bench_op(make_axpy(), {}, "fp16", {"n": 1000}, device=DEVICE)
    assert res.op == "axpy" and res.shape == {"n": 1000} and res.dtype == "fp16"
    assert res.bytes_moved == 3 * 1000 * 2
    assert res.median_s > 0 and res.gbps == pytest.approx(res.bytes_moved / res.median_s / 1e9)
    assert res.tflops == pytest.approx(2000 / res.median_s / 1e12)
    assert res.launch_overhead_s > 0
    assert json.loads(json.dumps(dataclasses.asdict(res)))["launches_per_call"] == 1


# A bundle-local op with a single dtype, so building the test bundle compiles one AOT kernel.
SCALE_PY = '''"""y = 3 * x (fp32 only): the smallest real bundle op."""

import torch
import triton
import triton.language as tl

from kernelpack.kernels.spec import AotSpec, DimRange, Domain, KernelOp, Tolerance


@triton.jit
def _scale(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=m) * 3.0, mask=m)


def run(inputs, outs, config):
    x = inputs["x"]
    _scale[(triton.cdiv(x.numel(), config["BLOCK"]),)](x, outs[0], x.numel(), BLOCK=config["BLOCK"])


OP = KernelOp(
    name="scale",
    description="y = 3x",
    domain=Domain(dtypes=("fp32",), dims={"n": DimRange(1, 1 << 24)}),
    tolerances={"fp32": Tolerance(1e-6, 1e-6)},
    make_inputs=lambda shape, dtype, device, gen: {"x": torch.randn(shape["n"], generator=gen).to(device, dtype)},
    shape_of=lambda inputs: {"n": inputs["x"].numel()},
    alloc_outputs=lambda inputs: (torch.empty_like(inputs["x"]),),
    run=run,
    reference=lambda inputs: (inputs["x"].double().cpu() * 3.0,),
    eager=lambda inputs: (inputs["x"] * 3.0,),
    bytes_moved=lambda shape, dtype: 8 * shape["n"],
    test_shapes=({"n": 100}, {"n": 1000}),
    aot=lambda dtype, config: [AotSpec(_scale, {"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32",
                                                "BLOCK": "constexpr"}, {"BLOCK": config.get("BLOCK", 1024)})],
    default_config={"BLOCK": 1024},
)
'''


@pytest.fixture(scope="module")
def built_bundle(tmp_path_factory):
    from kernelpack.build import build_bundle
    from kernelpack.scaffold import signing_keys, write_source

    d = tmp_path_factory.mktemp("bench_cli")
    write_source(d / "src", "harness-bench-test", "1.0.0", kernels={"scale": "kernels/scale.py"},
                 note="bundle bench CLI test", triton="3.6.0", decode_batch_sizes=[1], prefill_tokens=[128])
    (d / "src" / "kernels").mkdir()
    (d / "src" / "kernels" / "scale.py").write_text(SCALE_PY)
    kp = signing_keys(d / "keys", trusted=d / "trusted").pair
    (d / "empty").mkdir()
    res = build_bundle(d / "src", d / "b.kpack", kp.private_path, cache_dir=d / "cache")
    return d, res.path


def _cli():
    import typer

    from cli.bundle_bench import register

    app = typer.Typer()
    bundle_app = typer.Typer()
    register(bundle_app)
    app.add_typer(bundle_app, name="bundle")
    return app


def test_bundle_bench_cli_json_and_table(built_bundle, monkeypatch):
    from typer.testing import CliRunner

    d, path = built_bundle
    monkeypatch.setenv("XDG_CACHE_HOME", str(d / "xdg"))
    runner = CliRunner()
    args = ["bundle", "bench", str(path), "--trusted-keys", str(d / "trusted"), "--sizes", "test", "--dtype", "fp32"]
    out = runner.invoke(_cli(), [*args, "--json"])
    assert out.exit_code == 0, out.output
    report = json.loads(out.stdout)
    assert report["bundle"] == "harness-bench-test" and report["version"] == "1.0.0"
    assert [(r["op"], r["shape"]) for r in report["results"]] == [("scale", {"n": 100}), ("scale", {"n": 1000})]
    assert all(r["launches_per_call"] == 1 and r["median_s"] > 0 and r["gbps"] > 0 for r in report["results"])
    from rich.console import Console

    from cli.bundle_bench import _print_tables

    console = Console(record=True, width=120)
    _print_tables(console, report)
    text = console.export_text()
    assert "scale" in text and "GB/s" in text and "launches" in text and "n=1000" in text
    fp16 = runner.invoke(_cli(), [*args[:-1], "fp16"])
    assert fp16.exit_code == 0 and "skipped scale: dtype fp16 not in the op's domain" in fp16.stdout


def test_bundle_bench_cli_errors(built_bundle):
    from typer.testing import CliRunner

    d, path = built_bundle
    runner = CliRunner()
    bad_key = runner.invoke(_cli(), ["bundle", "bench", str(path), "--trusted-keys", str(d / "empty")])
    assert bad_key.exit_code == 3 and "cannot load" in bad_key.output
    missing = runner.invoke(_cli(), ["bundle", "bench", str(d / "nope.kpack"), "--trusted-keys", str(d / "trusted")])
    assert missing.exit_code == 2 and "does not exist" in missing.output
    no_op = runner.invoke(_cli(), ["bundle", "bench", str(path), "--trusted-keys", str(d / "trusted"), "--op", "rope"])
    assert no_op.exit_code == 2 and "has no op(s) rope (has scale)" in no_op.output


@pytest.mark.parametrize("mod", ["bias_gelu", "add_rmsnorm", "swiglu", "softmax_causal", "rope", "fp8_quant",
                                 "flash_attn"])
def test_counted_launches_match_each_real_op_declaration(mod):
    import importlib

    from kernelpack.kernels.spec import DTYPES

    op = importlib.import_module(f"kernelpack.kernels.{mod}").OP
    dtype = "fp32" if "fp32" in op.domain.dtypes else op.domain.dtypes[0]
    shape = min(op.test_shapes, key=lambda s: math.prod(s.values()))
    dev = torch.device(DEVICE)
    inputs = op.make_inputs(dict(shape), DTYPES[dtype], dev, make_generator(dev, 0))
    assert launches_per_call(op, {}, inputs) == op.launches_per_call >= 1


def test_the_latency_phase_collects_garbage_once_not_once_per_cell():
    """A full collection in an agent's trial process takes 0.3-0.7 s (torch, Triton and the bundles loaded); the
    trial's latency phase runs one for all its cells (``gc_paused``), the collector off until the phase ends."""
    import gc

    from agents.trial_latency import time_cells

    ops = {"axpy": (make_axpy(), {})}
    plan = [("axpy", "fp32", [{"n": 16}, {"n": 32}, {"n": 64}], None)]
    collections: list[int] = []

    def counted(phase: str, info: dict) -> None:
        if phase == "start":
            collections.append(info["generation"])

    gc.callbacks.append(counted)
    try:
        cells, _notes = time_cells(plan, ops, dict(ops), device=torch.device(DEVICE), seed=0)
    finally:
        gc.callbacks.remove(counted)
    # three cells timed, one full collection (a young-generation one may follow once the collector is back on)
    assert len(cells) == 3 and collections[0] == 2 and collections.count(2) == 1
    assert gc.isenabled()
