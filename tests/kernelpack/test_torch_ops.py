"""torch.ops.kernelctl.*: one operator per bundle op, fake implementations, fullgraph tracing, active version."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from kernelpack import torch_ops
from kernelpack.build import BuildResult, build_bundle
from kernelpack.harness.numerics import comparable
from kernelpack.runtime import publish_active
from kernelpack.scaffold import write_source
from tests.kernelpack.bundle_fixtures import *  # noqa: F403
from tests.kernelpack.bundle_fixtures import Keys
from tests.kernelpack.serving_fixtures import *  # noqa: F403
from tests.kernelpack.serving_fixtures import Serving

ALL_OPS = ("add_layernorm", "add_rmsnorm", "bias_gelu", "bias_gelu_tanh", "decode_attn", "flash_attn", "fp8_quant",
           "rope", "softmax_causal", "swiglu")


def _inputs(name: str) -> tuple[object, ...]:
    op = importlib.import_module(f"kernelpack.kernels.{name}").OP
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[op.domain.dtypes[0]]
    ins = op.make_inputs(op.test_shapes[0], dtype, torch.device("cpu"), torch.Generator().manual_seed(1))
    return tuple(ins.values())


def test_every_bundle_op_is_an_operator_with_a_fake_implementation() -> None:
    assert sorted(torch_ops.SIGNATURES) == sorted(ALL_OPS)
    assert torch_ops.SIGNATURES["add_rmsnorm"].schema == \
        "add_rmsnorm(Tensor x, Tensor residual, Tensor weight, float eps=1e-06) -> (Tensor, Tensor)"
    assert torch_ops.SIGNATURES["add_layernorm"].params == (("eps", 1e-5),)
    for name in ALL_OPS:
        args = _inputs(name)
        packet = getattr(torch.ops.kernelctl, name)
        with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
            fake_out = packet(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
        real_out = packet(*args)  # no bundle published: the PyTorch path
        fake_out = fake_out if isinstance(fake_out, tuple) else (fake_out,)
        real_out = real_out if isinstance(real_out, tuple) else (real_out,)
        assert [(f.shape, f.dtype) for f in fake_out] == [(r.shape, r.dtype) for r in real_out], name


def test_opcheck_add_rmsnorm_and_swiglu(serving: Serving) -> None:
    x, r, w = (torch.randn(3, 16), torch.randn(3, 16), torch.randn(16))
    torch.library.opcheck(torch.ops.kernelctl.add_rmsnorm.default, (x, r, w),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.kernelctl.swiglu.default, (x, r), test_utils=("test_schema", "test_faketensor"))


def test_ops_run_the_active_version_and_trace_fullgraph(serving: Serving) -> None:
    x, r, w, u = (torch.randn(4, 32), torch.randn(4, 32), 1 + 0.1 * torch.randn(32), torch.randn(4, 32))

    def block(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        y, h = torch.ops.kernelctl.add_rmsnorm(x, r, w)
        return torch.ops.kernelctl.swiglu(y, u) + h

    eager = block(x, r, w, u)
    assert torch_ops.last_served("add_rmsnorm") == "serve@0.1.0"
    assert torch_ops.last_served("swiglu") == "serve@0.1.0"
    h = x + r
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    assert torch.allclose(eager, torch.nn.functional.silu(y) * u + h, atol=1e-5, rtol=1e-5)

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    assert torch.allclose(compiled(x, r, w, u), eager, atol=1e-6)
    assert not torch._dynamo.utils.counters["graph_break"]
    gm = make_fx(block, tracing_mode="fake")(x, r, w, u)  # the ops are single opaque nodes (fake impls)
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert {"kernelctl.add_rmsnorm.default", "kernelctl.swiglu.default"} <= targets

    # the compiled (not CUDA-graphed) function re-enters the op body: a switch reaches it on the next call
    serving.publish("0.2.0")
    compiled(x, r, w, u)
    assert torch_ops.last_served("add_rmsnorm") == "serve@0.2.0"


def test_out_of_domain_call_runs_the_pytorch_path(serving: Serving) -> None:
    x = torch.randn(2, 12)  # hidden 12 is not a multiple of 8
    _y, h = torch.ops.kernelctl.add_rmsnorm(x, x, torch.ones(12))
    bound = serving.runtime.get_op("add_rmsnorm", "serve")
    assert bound.fallbacks >= 1 and "outside the op's domain" in (bound.last_fallback_reason or "")
    assert torch.allclose(h, 2 * x)


@pytest.mark.parametrize("n", [1])
def test_outputs_never_alias_inputs(n: int) -> None:
    a = torch.randn(3)
    (out,) = torch_ops._no_alias([a[:2]], [a])
    assert out.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()


OLD_NORM = '''"""add_rmsnorm as bundles built before eps was a run-time parameter shipped it: eps fixed at 1e-6."""

from __future__ import annotations

import dataclasses

from . import stable_add_rmsnorm as base


def make_inputs(shape, dtype, device, gen):  # type: ignore[no-untyped-def]
    inputs = base.make_inputs(shape, dtype, device, gen)
    del inputs["eps"]
    return inputs


OP = dataclasses.replace(base.OP, domain=dataclasses.replace(base.OP.domain, params={}), make_inputs=make_inputs)
'''


@pytest.fixture(scope="module")
def old_norm(tmp_path_factory: pytest.TempPathFactory, keys: Keys, aot_cache: Path) -> BuildResult:
    root = tmp_path_factory.mktemp("old-norm")
    (root / "src" / "kernels").mkdir(parents=True)
    (root / "src" / "kernels" / "add_rmsnorm_v1.py").write_text(OLD_NORM)
    src = write_source(root / "src", "norms", "0.9.0", kernels={"add_rmsnorm": "kernels/add_rmsnorm_v1.py"},
                       note="an op without the eps parameter", triton="3.6.0")
    return build_bundle(src, root / "norms-0.9.0.kpack", keys.pair.private_path, cache_dir=aot_cache)


def test_a_version_that_predates_a_parameter_serves_only_its_default(serving: Serving,
                                                                      old_norm: BuildResult) -> None:
    """An older bundle's op ignores eps (it had it fixed): it serves calls at the default eps, and any other
    eps runs the installed PyTorch path, never the old kernel with the wrong eps."""
    assert "params" not in old_norm.manifest.kernel("add_rmsnorm").limitations
    publish_active(serving.runtime.runtime_dir, "serve", "0.9.0", old_norm.path, old_norm.digest)
    bound = serving.runtime.get_op("add_rmsnorm")
    assert bound.bundle == "norms@0.9.0" and bound.supported
    x, w = torch.full((2, 16), 1e-3), torch.ones(16)
    calls, fallbacks = bound.calls, bound.fallbacks
    y6, _ = torch.ops.kernelctl.add_rmsnorm(x, torch.zeros_like(x), w)  # the default: the old kernel
    assert (bound.calls, bound.fallbacks) == (calls + 1, fallbacks)
    y5, _ = torch.ops.kernelctl.add_rmsnorm(x, torch.zeros_like(x), w, 1e-5)
    assert (bound.calls, bound.fallbacks) == (calls + 1, fallbacks + 1)
    assert "predates the run-time parameter(s) eps" in (bound.last_fallback_reason or "")
    assert torch.allclose(y6, x / (1e-6 + 1e-6) ** 0.5, rtol=1e-5)
    assert torch.allclose(y5, x / (1e-6 + 1e-5) ** 0.5, rtol=1e-5)
    # the trial compares a candidate with such a stable version only where the stable one can compute
    new = importlib.import_module("kernelpack.kernels.add_rmsnorm").OP
    inputs = {"x": x, "residual": x, "weight": w}
    assert comparable((bound.op, {}), new, {**inputs, "eps": 1e-6}) is not None
    assert comparable((bound.op, {}), new, {**inputs, "eps": 1e-5}) is None


def test_an_op_that_refuses_a_newer_input_falls_back_to_the_installed_pytorch_path(tmp_path: Path) -> None:
    """A flash_attn from before GQA refused k/v with fewer heads than q, and its own eager code cannot compute
    them: the call runs the installed op's eager path (the contract of this installation)."""
    import dataclasses

    from kernelpack.kernels.spec import DomainError
    from kernelpack.loader import BoundOp

    new = importlib.import_module("kernelpack.kernels.flash_attn").OP

    def no_gqa(inputs):  # type: ignore[no-untyped-def]
        if inputs["k"].shape != inputs["q"].shape:
            raise DomainError("k shape must equal q shape (self-attention, no GQA)")
        return new.shape_of(inputs)

    def eager_no_gqa(inputs):  # type: ignore[no-untyped-def]
        q, k, v = inputs["q"], inputs["k"], inputs["v"]
        return (torch.softmax((q @ k.transpose(-1, -2)).float(), -1).to(q.dtype) @ v,)

    old = BoundOp("flash_attn", dataclasses.replace(new, shape_of=no_gqa, eager=eager_no_gqa), {}, "sm_90",
                  "attn@0.1.0", tmp_path)
    g = torch.Generator().manual_seed(3)
    inputs = {"q": torch.randn(1, 4, 5, 64, generator=g).to(torch.bfloat16),
              "k": torch.randn(1, 2, 5, 64, generator=g).to(torch.bfloat16),
              "v": torch.randn(1, 2, 5, 64, generator=g).to(torch.bfloat16)}
    (o,) = old(inputs)
    assert old.fallbacks == 1 and old.calls == 0 and "no GQA" in (old.last_fallback_reason or "")
    assert torch.equal(o, new.eager(inputs)[0])
