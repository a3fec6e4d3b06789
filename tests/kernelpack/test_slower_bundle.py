"""llm-fused 1.1.2-slower1pct: every op is the stable op whose kernels read 1% more bytes (issue 25's
"1%-slower-everywhere" candidate for the GPU proof). It builds and verifies like any bundle, launches the same
number of Triton kernels per call as 1.1.1, through its wrappers, and its outputs equal 1.1.1's bit for bit on
every op's test shapes (Triton interpreter)."""

from __future__ import annotations

import sys

import pytest
import torch

from kernelpack.harness.bench import launches_per_call
from kernelpack.harness.numerics import make_generator, run_poisoned
from kernelpack.loader import load_bundle
from kernelpack.manifest import is_prerelease
from tests.agents.bundles import build_test_bundles

OPS = ("bias_gelu", "bias_gelu_tanh", "add_rmsnorm", "add_layernorm", "swiglu", "softmax_causal", "rope",
       "fp8_quant", "flash_attn")


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("slower")
    b = build_test_bundles(root, ("1.1.1", "1.1.2-slower1pct"), ops=OPS)
    return {v: load_bundle(b.paths[v], b.trusted_dir, arch="sm_90", cache_dir=root / "cache", digest=b.digests[v])
            for v in b.paths}


def test_the_slower_bundle_is_no_fault_and_computes_stables_bits(loaded) -> None:  # type: ignore[no-untyped-def]
    stable, slower = loaded["1.1.1"], loaded["1.1.2-slower1pct"]
    m = slower.manifest
    assert m.fault_fixture is None and is_prerelease(m.version) and m.parent == "1.1.1"
    assert sorted(slower.ops) == sorted(stable.ops) == sorted(OPS)
    common = next(v for k, v in sys.modules.items() if k.endswith(".slower_common"))
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

