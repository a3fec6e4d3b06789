"""llm-fused 1.1.2-slower1pct (every kernel reads 1% more bytes), 1.1.3-slower1pct (every kernel program waits 1%
of its own time on the GPU's timer) and 1.1.4-slower1pct (the last program of each launch waits 1% of the
launch's time): issue 25's "1%-slower-everywhere" candidates for the GPU proof (1.1.2 and 1.1.3 measured -14% to
+14% per cell on an H200, docs/gpu.md runs V-Y).
Each builds and verifies like any bundle, launches the same number of Triton kernels per call as 1.1.1, through
its wrappers, and its outputs equal 1.1.1's bit for bit on every op's test shapes (Triton interpreter). The timed
wrappers compile for sm_90 on this CPU machine, with the timer reads and the wait loop in their PTX."""

from __future__ import annotations

import sys

import pytest
import torch

from kernelpack.harness.bench import launches_per_call
from kernelpack.harness.numerics import make_generator, run_poisoned
from kernelpack.loader import load_bundle
from kernelpack.manifest import is_prerelease
from tests.agents.bundles import build_test_bundles

SLOWER = ("1.1.2-slower1pct", "1.1.3-slower1pct", "1.1.4-slower1pct")
OPS = ("bias_gelu", "bias_gelu_tanh", "add_rmsnorm", "add_layernorm", "swiglu", "softmax_causal", "rope",
       "fp8_quant", "flash_attn")


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("slower")
    b = build_test_bundles(root, ("1.1.1", *SLOWER), ops=OPS)
    return {v: load_bundle(b.paths[v], b.trusted_dir, arch="sm_90", cache_dir=root / "cache", digest=b.digests[v])
            for v in b.paths}


@pytest.mark.parametrize("version", SLOWER)
def test_the_slower_bundle_is_no_fault_and_computes_stables_bits(loaded, version: str) -> None:  # type: ignore[no-untyped-def]
    stable, slower = loaded["1.1.1"], loaded[version]
    m = slower.manifest
    assert m.fault_fixture is None and is_prerelease(m.version) and m.parent == "1.1.1"
    assert sorted(slower.ops) == sorted(stable.ops) == sorted(OPS)
    common = next(v for k, v in list(sys.modules.items()) if k.endswith(".slower_common")
                  and v.__doc__.startswith(f"llm-fused {version}:"))
    for name in OPS:
        (s_op, s_cfg), (c_op, c_cfg) = (stable.ops[name].op, stable.ops[name].config), (slower.ops[name].op,
                                                                                        slower.ops[name].config)
        for shape in s_op.test_shapes[:2]:
            dtype = next(d for d in ("fp32", "fp16", "bf16") if d in s_op.domain.dtypes)
            tdt = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
            inputs = s_op.make_inputs(dict(shape), tdt, torch.device("cpu"), make_generator(None, 7))
            before = len(common.WRAPPED)
            got, _ = run_poisoned(c_op, c_cfg, inputs)
            assert len(common.WRAPPED) > before, f"{name}: no kernel launched through the 1% wrapper"
            want, _ = run_poisoned(s_op, s_cfg, inputs)
            for g, w in zip(got, want, strict=True):
                assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)), f"{name} {shape}: bits differ"
            assert launches_per_call(c_op, c_cfg, inputs) == launches_per_call(s_op, s_cfg, inputs), name



SM90_SCRIPT = """
import importlib.util, sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
import kernelpack.kernels.swiglu as sw
spec = importlib.util.spec_from_file_location("slower_common", sys.argv[1])
sc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sc)
aot = sw.aot("bf16", {})[-1]
wrapper = sc._make_wrapper(aot.fn, timed=True)
extra = {"SLOW_PERCENT": sc.SLOW_PERCENT}
sig = {**aot.signature, "SLOW_PERCENT": "constexpr"}
if hasattr(sc, "CYCLES_PER_NS"):  # 1.1.4: the launch's start word and the wait's clock rate
    extra["MILLI_CYCLES_PER_NS"] = round(1000 * sc.CYCLES_PER_NS)
    sig = {**aot.signature, "_slow_start": "*i64", "SLOW_PERCENT": "constexpr", "MILLI_CYCLES_PER_NS": "constexpr"}
k = compile(ASTSource(wrapper, signature=sig, constexprs={**aot.constexprs, **extra}),
            target=GPUTarget("cuda", 90, 32), options={"num_warps": aot.num_warps})
ptx = k.asm["ptx"]
print(ptx.count("%globaltimer"), ptx.count("%clock64"))
"""


@pytest.mark.parametrize(("version", "globaltimer", "clock64"), [("1.1.3-slower1pct", 3, 0), ("1.1.4-slower1pct", 2, 2)])
def test_the_timed_wrapper_compiles_for_sm90_with_its_timer(version: str, globaltimer: int, clock64: int) -> None:
    """The wrapper of the stable swiglu kernel, compiled for sm_90 (a child without TRITON_INTERPRET). 1.1.3: the
    global timer read before the body, after it and in the wait loop; 1.1.4: the global timer at the start and
    after the body (the launch's time), the SM's cycle counter before and in the wait loop."""
    import os
    import subprocess
    from pathlib import Path

    common = Path(__file__).parents[2] / f"kernelpack/bundles/llm-fused/{version}/kernels/slower_common.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", SM90_SCRIPT, str(common)], env=env, capture_output=True, text=True,
                       timeout=300, cwd=Path(__file__).parents[2])
    assert r.returncode == 0, r.stderr[-3000:]
    got = [int(x) for x in r.stdout.split()[-2:]]
    assert got[0] >= globaltimer and got[1] >= clock64, r.stdout
