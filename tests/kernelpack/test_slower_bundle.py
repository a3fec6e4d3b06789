"""llm-fused 1.1.2-slower1pct (every kernel reads 1% more bytes) and 1.1.3-slower1pct (every kernel program
waits 1% of its own time on the GPU's timer): issue 25's "1%-slower-everywhere" candidates for the GPU proof.
Each builds and verifies like any bundle, launches the same number of Triton kernels per call as 1.1.1, through
its wrappers, and its outputs equal 1.1.1's bit for bit on every op's test shapes (Triton interpreter). 1.1.3's
timed wrapper compiles for sm_90 on this CPU machine, with the timer reads and the wait loop in its PTX."""

from __future__ import annotations

import sys

import pytest
import torch

from kernelpack.harness.bench import launches_per_call
from kernelpack.harness.numerics import make_generator, run_poisoned
from kernelpack.loader import load_bundle
from kernelpack.manifest import is_prerelease
from tests.agents.bundles import build_test_bundles

SLOWER = ("1.1.2-slower1pct", "1.1.3-slower1pct")
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
k = compile(ASTSource(wrapper, signature={**aot.signature, "SLOW_PERCENT": "constexpr"},
                      constexprs={**aot.constexprs, "SLOW_PERCENT": sc.SLOW_PERCENT}),
            target=GPUTarget("cuda", 90, 32), options={"num_warps": aot.num_warps})
print(k.asm["ptx"].count("%globaltimer"))
"""


def test_the_timed_wrapper_compiles_for_sm90_with_its_timer() -> None:
    """1.1.3's wrapper of the stable swiglu kernel, compiled for sm_90 (a child without TRITON_INTERPRET): the
    timer is read before the body, after it and in the wait loop."""
    import os
    import subprocess
    from pathlib import Path

    common = Path(__file__).parents[2] / "kernelpack/bundles/llm-fused/1.1.3-slower1pct/kernels/slower_common.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", SM90_SCRIPT, str(common)], env=env, capture_output=True, text=True,
                       timeout=300, cwd=Path(__file__).parents[2])
    assert r.returncode == 0, r.stderr[-3000:]
    assert int(r.stdout.split()[-1]) >= 3, r.stdout
