"""torch.ops.kernelctl.*: one operator per bundle op, fake implementations, fullgraph tracing, active version."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from kernelpack import torch_ops
from tests.kernelpack.bundle_fixtures import *  # noqa: F403
from tests.kernelpack.serving_fixtures import *  # noqa: F403
from tests.kernelpack.serving_fixtures import Serving

ALL_OPS = ("add_layernorm", "add_rmsnorm", "bias_gelu", "bias_gelu_tanh", "decode_attn", "flash_attn", "fp8_quant",
           "rope", "softmax_causal", "swiglu")


def _inputs(name: str) -> tuple[torch.Tensor, ...]:
    op = importlib.import_module(f"kernelpack.kernels.{name}").OP
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[op.domain.dtypes[0]]
    ins = op.make_inputs(op.test_shapes[0], dtype, torch.device("cpu"), torch.Generator().manual_seed(1))
    return tuple(ins.values())


def test_every_bundle_op_is_an_operator_with_a_fake_implementation() -> None:
    assert sorted(torch_ops.SIGNATURES) == sorted(ALL_OPS)
    assert torch_ops.SIGNATURES["add_rmsnorm"].schema == \
        "add_rmsnorm(Tensor x, Tensor residual, Tensor weight) -> (Tensor, Tensor)"
    for name in ALL_OPS:
        args = _inputs(name)
        packet = getattr(torch.ops.kernelctl, name)
        with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
            fake_out = packet(*(mode.from_tensor(a) for a in args))
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
