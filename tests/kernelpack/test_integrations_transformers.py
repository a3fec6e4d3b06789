"""apply_kernels on a tiny random-weight Llama: same logits as transformers' code, counts, fallbacks, compile."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kernelpack import torch_ops
from kernelpack.build import BuildResult, build_bundle
from kernelpack.integrations import transformers as kt
from kernelpack.runtime import publish_active
from kernelpack.scaffold import write_source
from tests.kernelpack.bundle_fixtures import *  # noqa: F403
from tests.kernelpack.bundle_fixtures import Keys
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


def llama3_config(**kw: object) -> LlamaConfig:
    """Llama-3's shape in miniature: RMSNorm eps 1e-5, GQA (4 query heads on 2 kv heads), head_dim 64 (128: 8B),
    rope_theta 500000 with the "llama3" rope scaling (factor 8 over an original 8k context)."""
    return LlamaConfig(**{**dict(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5, max_position_embeddings=131072,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}), **kw})


@pytest.mark.parametrize("head_dim", [64, 128])
@torch.no_grad()
def test_llama3_shaped_model_runs_every_patched_kind_on_the_bundle(serving: Serving, head_dim: int) -> None:
    """No fallback anywhere in the prefill: each op's kernel ran once per layer (counted by the runtime's ops),
    and the logits stay within bf16 tolerance of transformers' own model. A decode step runs the norm, MLP and
    rope kernels too; its attention (q_len 1 over the cache) is SDPA until a decode kernel ships."""
    cfg = llama3_config(head_dim=head_dim)
    assert cfg.rope_parameters["rope_type"] == "llama3" and cfg.rms_norm_eps == 1e-5
    torch.manual_seed(5)
    model = LlamaForCausalLM(cfg).eval().to(torch.bfloat16)
    base = copy.deepcopy(model)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(5))
    ref_out = base(ids, use_cache=True)
    ref = torch.log_softmax(ref_out.logits.float(), -1)
    assert kt.apply_kernels(model) == {"rmsnorm": 2, "mlp": 2, "rope": 2, "attention": 2}
    ops = {op: serving.runtime.get_op(op) for op in ("add_rmsnorm", "swiglu", "rope", "flash_attn")}
    assert {b.bundle for b in ops.values()} == {"serve@0.1.0"}
    before = {op: b.calls for op, b in ops.items()}
    kt.FALLBACKS.clear()
    out = model(ids, use_cache=True)
    assert not kt.FALLBACKS, kt.FALLBACKS
    assert {op: b.calls - before[op] for op, b in ops.items()} == dict.fromkeys(ops, 2)  # 2 layers
    assert all(b.fallbacks == 0 for b in ops.values())
    diff = (torch.log_softmax(out.logits.float(), -1) - ref).abs().max().item()
    assert diff < 0.05, diff
    # the same model without kernelctl's eps would differ: the kernel really normalised with 1e-5
    x = torch.full((1, 64), 1e-3)
    y5, _ = torch.ops.kernelctl.add_rmsnorm(x, torch.zeros_like(x), torch.ones(64), 1e-5)
    y6, _ = torch.ops.kernelctl.add_rmsnorm(x, torch.zeros_like(x), torch.ones(64))
    assert y5[0, 0] < 0.35 < 0.7 < y6[0, 0]  # 1e-3/sqrt(1e-6+1e-5) vs 1e-3/sqrt(1e-6+1e-6)

    before = {op: b.calls for op, b in ops.items()}
    nxt = ref_out.logits[:, -1:].argmax(-1)
    step = model(nxt, past_key_values=out.past_key_values, use_cache=True)  # a decode step: one token each
    assert {op: b.calls - before[op] for op, b in ops.items()} == {
        "add_rmsnorm": 2, "swiglu": 2, "rope": 2, "flash_attn": 0}
    ref_step = base(nxt, past_key_values=ref_out.past_key_values, use_cache=True)  # the step reads the KV cache
    diff = (torch.log_softmax(step.logits.float(), -1) - torch.log_softmax(ref_step.logits.float(), -1)).abs()
    assert diff.max().item() < 0.05, diff.max().item()


@torch.no_grad()
def test_out_of_domain_model_falls_back_to_transformers(serving: Serving) -> None:
    model = tiny_llama(torch.float32, eps=0.5)  # outside the kernel's eps domain [1e-12, 0.1]
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(2))
    ref = model(ids).logits
    kt.FALLBACKS.clear()
    kt.apply_kernels(model, kinds=("rmsnorm", "mlp"))
    assert torch.allclose(model(ids).logits, ref, atol=1e-5)
    assert any(k == "rmsnorm" and "eps 0.5 outside" in r for k, r in kt.FALLBACKS)
    assert model.config._attn_implementation != "kernelctl"


def test_rejects_unknown_kinds_and_families() -> None:
    with pytest.raises(ValueError, match="unknown kernel kind"):
        kt.apply_kernels(tiny_llama(torch.float32), kinds=("conv",))
    with pytest.raises(kt.UnsupportedModelError, match="model_type"):
        kt.apply_kernels(torch.nn.Linear(2, 2))


@pytest.mark.gpu
@torch.no_grad()
def test_real_shape_llama_logits_on_gpu(serving: Serving) -> None:
    """Llama-3-8B (eps 1e-5, llama3 rope scaling, GQA 32/8) layer shapes (2 layers, smaller vocab), bf16,
    prefill of 2 x 512 tokens: every kind runs its kernel (flash attention for the prefill) and the logits match
    transformers' SDPA model."""

    cfg = llama3_config(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                        num_key_value_heads=8, head_dim=128, initializer_range=0.02)  # Llama-3's eps, rope
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
    calls = swiglu.calls
    assert torch.allclose(model(ids).logits, ref, atol=1e-5)  # 14 tokens: transformers' code
    assert swiglu.calls == calls and any("policy" in r for k, r in kt.FALLBACKS if k == "mlp")
    model(ids[:1, :3])  # 3 tokens: the kernel
    assert swiglu.calls == calls + 2  # two layers


@pytest.fixture(scope="module")
def serve_wins(tmp_path_factory: pytest.TempPathFactory, keys: Keys, aot_cache: Path) -> BuildResult:
    """serve 0.3.0: swiglu only, with a wins table: on sm_90 it won only at 1-4 tokens per call."""
    root = tmp_path_factory.mktemp("serve-wins")
    src = write_source(root / "src", "serve", "0.3.0", kernels={"swiglu": "kernelpack.kernels.swiglu"},
                       note="serving test bundle with a wins table", cuda=["12.x", "13.x"], triton="3.6.0",
                       wins={"swiglu": {"sm_90": [{"lo": 1, "hi": 4}]}})
    return build_bundle(src, root / "serve-0.3.0.kpack", keys.pair.private_path, cache_dir=aot_cache)


@torch.no_grad()
def test_default_policy_follows_the_bundles_wins_table(serving: Serving, serve_wins: BuildResult) -> None:
    """No policy given: the kernel runs where the serving version's manifest says it wins on this arch (and
    everywhere when the version ships no table: the other tests); an explicit window overrides the table."""
    assert serve_wins.manifest.kernel("swiglu").wins_for("sm_90")[0].hi == 4
    publish_active(serving.runtime.runtime_dir, "serve", "0.3.0", serve_wins.path, serve_wins.digest)
    model = tiny_llama(torch.float32)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(6))
    ref = model(ids).logits
    kt.apply_kernels(model, kinds=("mlp",))
    swiglu = serving.runtime.get_op("swiglu")
    assert swiglu.bundle == "serve@0.3.0" and swiglu.wins == ((1, 4),)
    kt.FALLBACKS.clear()
    calls = swiglu.calls
    assert torch.allclose(model(ids).logits, ref, atol=1e-5)  # 14 tokens: outside the table, transformers' code
    assert swiglu.calls == calls
    assert [r for k, r in kt.FALLBACKS if k == "mlp"] == [
        "policy: the serving bundle measured swiglu slower than the baseline at this call's size"]
    model(ids[:1, :3])  # 3 tokens: inside, the kernel
    assert swiglu.calls == calls + 2
    forced = tiny_llama(torch.float32)
    kt.apply_kernels(forced, kinds=("mlp",), policy={"mlp": (1, None)})
    forced(ids)
    assert swiglu.calls == calls + 4


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
