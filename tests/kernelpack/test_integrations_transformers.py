"""apply_kernels on a tiny random-weight Llama: same logits as transformers' code, counts, fallbacks, compile."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kernelpack import torch_ops
from kernelpack.integrations import transformers as kt
from tests.kernelpack.bundle_fixtures import *  # noqa: F403
from tests.kernelpack.serving_fixtures import *  # noqa: F403
from tests.kernelpack.serving_fixtures import Serving


def tiny_llama(dtype: torch.dtype, head_dim: int = 16, eps: float = 1e-6, seed: int = 0) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=64 // head_dim if head_dim < 64 else 2, num_key_value_heads=1,
                      head_dim=head_dim, rms_norm_eps=eps, max_position_embeddings=64)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval().to(dtype)


@torch.no_grad()
def test_patched_tiny_llama_gives_the_same_logits(serving: Serving) -> None:
    model = tiny_llama(torch.float32)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    ref = model(ids).logits
    counts = kt.apply_kernels(model)
    assert counts == {"rmsnorm": 2, "mlp": 2, "rope": 2, "attention": 2}
    assert model.config._attn_implementation == "kernelctl"
    out = model(ids).logits
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4), (out - ref).abs().max()
    for op in ("add_rmsnorm", "swiglu", "rope"):
        assert torch_ops.last_served(op) == "serve@0.1.0"
        assert serving.runtime.get_op(op, "serve").fallbacks == 0
    assert kt.apply_kernels(model) == dict.fromkeys(kt.KINDS, 0)  # idempotent

    # the same model compiled with fullgraph=True: no graph break, same logits
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    assert torch.allclose(compiled(ids, use_cache=False).logits, out, atol=1e-5)
    assert not torch._dynamo.utils.counters["graph_break"]


@torch.no_grad()
def test_bf16_prefill_runs_flash_attention_and_decode_falls_back(serving: Serving,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    model = tiny_llama(torch.bfloat16, head_dim=64)
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(1))
    ref = model(ids).logits.float()
    kt.apply_kernels(model)
    kt.FALLBACKS.clear()
    kt._logged.clear()
    out = model(ids, use_cache=True)
    assert torch_ops.last_served("flash_attn") == "serve@0.1.0"
    for op in ("add_rmsnorm", "swiglu", "rope", "flash_attn"):  # batch 1: every op ran its kernel
        assert serving.runtime.get_op(op, "serve").fallbacks == 0, op
    assert (out.logits.float() - ref).abs().max() < 0.05  # bf16 over two layers
    with caplog.at_level(logging.WARNING, logger="kernelpack.integrations.transformers"):
        for _ in range(2):  # decode steps over a dynamic cache (no mask: decode_attn needs the cache's mask)
            nxt = out.logits[:, -1:].argmax(-1)
            out = model(nxt, past_key_values=out.past_key_values, use_cache=True)
    reasons = [r for (kind, r) in kt.FALLBACKS if kind == "attention"]
    assert len(reasons) == 1 and "decode without a bool attention mask" in reasons[0]
    assert kt.FALLBACKS[("attention", reasons[0])] == 4  # 2 layers x 2 steps
    assert caplog.text.count("decode without a bool attention mask") == 1


@torch.no_grad()
def test_out_of_domain_model_falls_back_to_transformers(serving: Serving) -> None:
    model = tiny_llama(torch.float32, eps=1e-5)  # Llama-3's eps: the kernel's is fixed at 1e-6
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(2))
    ref = model(ids).logits
    kt.FALLBACKS.clear()
    kt.apply_kernels(model, kinds=("rmsnorm", "mlp"))
    assert torch.allclose(model(ids).logits, ref, atol=1e-5)
    assert any(k == "rmsnorm" and "eps" in r for k, r in kt.FALLBACKS)
    assert model.config._attn_implementation != "kernelctl"


def test_rejects_unknown_kinds_and_families() -> None:
    with pytest.raises(ValueError, match="unknown kernel kind"):
        kt.apply_kernels(tiny_llama(torch.float32), kinds=("conv",))
    with pytest.raises(kt.UnsupportedModelError, match="model_type"):
        kt.apply_kernels(torch.nn.Linear(2, 2))


@pytest.mark.gpu
@torch.no_grad()
def test_real_shape_llama_logits_on_gpu(serving: Serving) -> None:
    """Llama-3-8B layer shapes (2 layers, smaller vocab), bf16, prefill of 2 x 512 tokens: every kind runs
    its kernel (flash attention for the prefill) and the logits match transformers' SDPA model."""
    import copy

    cfg = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                      max_position_embeddings=4096, initializer_range=0.02)
    torch.manual_seed(0)
    with torch.device("cuda"):
        base = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    base.set_attn_implementation("sdpa")
    patched = copy.deepcopy(base)
    assert kt.apply_kernels(patched) == {"rmsnorm": 2, "mlp": 2, "rope": 2, "attention": 2}
    ids = torch.randint(0, 32000, (2, 512), device="cuda")
    ref = torch.log_softmax(base(ids, use_cache=False).logits.float(), -1)
    kt.FALLBACKS.clear()
    out = torch.log_softmax(patched(ids, use_cache=False).logits.float(), -1)
    assert not kt.FALLBACKS, kt.FALLBACKS
    for op in ("add_rmsnorm", "swiglu", "rope", "flash_attn"):
        assert torch_ops.last_served(op) == "serve@0.1.0"
        assert serving.runtime.get_op(op, "serve").fallbacks == 0
    top = ref.topk(5, dim=-1).indices
    diff = (ref.gather(-1, top) - out.gather(-1, top)).abs().max().item()
    agree = (ref.argmax(-1) == out.argmax(-1)).float().mean().item()
    print(f"real-shape logits: max |dlogp| at top-5 {diff:.4f}, top-1 agreement {agree:.4f}")
    assert diff < 0.25 and agree > 0.95


@pytest.mark.gpu
@torch.no_grad()
def test_compiled_static_cache_generate_on_gpu(serving: Serving) -> None:
    """transformers' compiled generate (static cache, reduce-overhead: CUDA graphs) on the patched model at
    Llama-3-8B layer shapes: decode steps run kernelctl.decode_attn, and the first generated token's
    log-probabilities match transformers' compiled model within bf16 rounding."""
    import copy

    cfg = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                      max_position_embeddings=4096, initializer_range=0.02)
    torch.manual_seed(0)
    with torch.device("cuda"):
        base = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    base.set_attn_implementation("sdpa")
    patched = copy.deepcopy(base)
    kt.apply_kernels(patched)
    ids = torch.randint(0, 32000, (2, 64), device="cuda")
    kw = {"max_new_tokens": 8, "do_sample": False, "cache_implementation": "static", "pad_token_id": 0,
          "output_logits": True, "return_dict_in_generate": True}
    kt.FALLBACKS.clear()
    out = patched.generate(ids, **kw)
    assert torch_ops.last_served("decode_attn") == "serve@0.1.0"
    assert not [r for (k, r) in kt.FALLBACKS if r.startswith("decode")], kt.FALLBACKS
    ref = base.generate(ids, **kw)
    same = out.sequences[:, 64] == ref.sequences[:, 64]  # rows whose first decode step saw the same token
    assert same.any()
    a, b = (torch.log_softmax(x.logits[1][same].float(), -1) for x in (ref, out))  # the first decode step
    top = a.topk(5, dim=-1).indices
    assert (a.gather(-1, top) - b.gather(-1, top)).abs().max().item() < 0.25


@torch.no_grad()
def test_policy_runs_kernels_only_inside_their_token_window(serving: Serving) -> None:
    model = tiny_llama(torch.float32)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(3))
    ref = model(ids).logits
    with pytest.raises(ValueError, match="empty"):
        kt.apply_kernels(model, policy={"mlp": (8, 4)})
    kt.apply_kernels(model, kinds=("mlp",), policy={"mlp": (1, 4)})
    kt.FALLBACKS.clear()
    swiglu = serving.runtime.get_op("swiglu", "serve")
    before = swiglu.op.run
    calls: list[int] = []
    swiglu.op.run = lambda inputs, outs, cfg: (calls.append(inputs["gate"].shape[0]), before(inputs, outs, cfg))
    try:
        assert torch.allclose(model(ids).logits, ref, atol=1e-5)  # 14 tokens: transformers' code
        assert calls == [] and any("policy" in r for k, r in kt.FALLBACKS if k == "mlp")
        model(ids[:1, :3])  # 3 tokens: the kernel
        assert calls == [3, 3]  # two layers
    finally:
        swiglu.op.run = before


@torch.no_grad()
def test_generate_drops_the_compiled_call_after_a_switch(serving: Serving) -> None:
    model = tiny_llama(torch.float32)
    kt.apply_kernels(model, kinds=("mlp",))
    ids = torch.randint(0, 64, (1, 4), generator=torch.Generator().manual_seed(4))
    first = model.generate(ids, max_new_tokens=2, do_sample=False)
    assert torch_ops.last_served("swiglu") == "serve@0.1.0"
    model._compiled_call = "captured under 0.1.0"  # what transformers keeps for static-cache generation
    model.generate(ids, max_new_tokens=1, do_sample=False)
    assert model._compiled_call == "captured under 0.1.0"  # same kernels: kept
    serving.publish("0.2.0")
    again = model.generate(ids, max_new_tokens=2, do_sample=False)
    assert not hasattr(model, "_compiled_call")  # dropped before the request under the new version
    assert torch_ops.last_served("swiglu") == "serve@0.2.0"
    assert torch.equal(first, again)  # the same kernels in both versions


@torch.no_grad()
def test_patched_static_cache_generate_matches_transformers(serving: Serving) -> None:
    """Greedy generate with a static cache (the decode path of HF's compiled generate): the patched model
    writes and reads the KV cache as transformers does (>= 5.24 passes it as ``cache``), same tokens."""
    import copy

    model = tiny_llama(torch.float32)
    patched = copy.deepcopy(model)
    kt.apply_kernels(patched)
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(5))
    kw = {"max_new_tokens": 6, "do_sample": False, "cache_implementation": "static", "pad_token_id": 0,
          "output_logits": True, "return_dict_in_generate": True}
    ref, out = model.generate(ids, **kw), patched.generate(ids, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits, strict=True):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (a - b).abs().max()


def _decode_step_guards(model: LlamaForCausalLM) -> int:
    """How many guards dynamo checks before each call of the compiled decode step (static cache, batch 1)."""
    from transformers import StaticCache

    guards: list[object] = []

    def keep_all(entries: list[object]) -> list[bool]:
        guards.extend(entries)
        return [True] * len(entries)

    cache = StaticCache(config=model.config, max_cache_len=16)
    tok = torch.tensor([[3]])
    torch._dynamo.reset()
    step = torch.compile(model.__call__, backend="eager", options={"guard_filter_fn": keep_all})
    with torch.no_grad():
        model(input_ids=tok, past_key_values=cache, use_cache=True)
        step(input_ids=tok, past_key_values=cache, use_cache=True)
    torch._dynamo.reset()
    return len(guards)


def test_compiled_patched_model_checks_no_more_guards_than_transformers(serving: Serving) -> None:
    """generate at batch 1 is bound by the host: dynamo evaluates every guard of the compiled forward before
    each CUDA-graph replay. The patched model's decisions (eps, domains, policy) are made once at trace time
    and its forwards come from the class, so it guards no more than transformers' own model (it skips the
    post-attention norm's module call, so fewer)."""
    import copy

    model = tiny_llama(torch.float32)
    patched = copy.deepcopy(model)
    kt.apply_kernels(patched)
    ours, theirs = _decode_step_guards(patched), _decode_step_guards(model)
    assert ours <= theirs, f"patched model: {ours} guards per call, transformers' {theirs}"


@torch.no_grad()
def test_static_cache_decode_runs_the_decode_attention_kernel(serving: Serving) -> None:
    """A decode step over transformers' static cache (bool mask over the whole cache) runs
    kernelctl.decode_attn; its logits stay within bf16 rounding of transformers' SDPA model."""
    import copy

    model = tiny_llama(torch.bfloat16, head_dim=64)
    patched = copy.deepcopy(model)
    kt.apply_kernels(patched, kinds=("attention",))
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(6))
    kw = {"max_new_tokens": 4, "do_sample": False, "cache_implementation": "static", "pad_token_id": 0,
          "output_logits": True, "return_dict_in_generate": True}
    kt.FALLBACKS.clear()
    out = patched.generate(ids, **kw)
    assert torch_ops.last_served("decode_attn") == "serve@0.1.0"
    assert not [r for (k, r) in kt.FALLBACKS if k == "attention" and r.startswith("decode")]
    ref = model.generate(ids, **kw)
    first = (out.logits[0].float() - ref.logits[0].float()).abs().max()
    assert first < 0.05, first  # same prompt, one decode step: bf16 rounding apart
