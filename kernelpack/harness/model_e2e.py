"""End to end on a real model architecture: TTFT, time per output token and log-prob agreement, A against B.

A transformers model is built once from a config (architecture and sizes; random weights from ``seed``,
nothing downloaded) and patched with :func:`kernelpack.integrations.transformers.apply_kernels`. Two
*variants* are measured interleaved (A B, then B A, per round):

* the trial (:func:`trial_model_e2e`): one patched model, the ops pinned to the stable bundle (A) or the
  candidate (B) with :func:`kernelpack.torch_ops.pinned`; ops a bundle lacks run the PyTorch path in both;
* the benchmark (:func:`benchmark`, ``python -m kernelpack.harness.model_e2e``): transformers' own model with
  SDPA attention (A) against the patched model on a bundle (B), both compiled the same way.

Per variant: prefill time (TTFT: one forward of ``tokens`` prompt tokens, last position's logits) at each
prefill size, and time per output token at each decode batch size: a static KV cache of ``max_cache_len``
(attention over the whole cache, so the cost does not depend on the position) and, on CUDA, the decode step
compiled with ``torch.compile(fullgraph=True)`` and replayed from a CUDA graph captured per variant (prefill is
compiled too, without graphs). Plus top-k log-probabilities of B against A on the same prompts (max absolute
difference at A's top-k tokens, and how often the top-1 token agrees). On CPU (Triton interpreter) everything
runs eagerly at the sizes given, so keep them tiny there.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kernelpack import torch_ops
from kernelpack.integrations.graphs import SwitchingGraph

log = logging.getLogger("kernelpack.harness.model_e2e")

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# candidate log-probs further than this from stable's (nats, at stable's top-k) fail the trial as numeric_error
LOGPROB_BOUND = {"fp32": 1e-2, "fp16": 0.5, "bf16": 1.0}
OpSet = Mapping[str, Any]  # op name -> BoundOp, or (KernelOp, config) pairs (see bound_ops)


@dataclass
class Variant:
    name: str
    model: torch.nn.Module
    ops: Mapping[str, Any] | None = None  # pinned BoundOps (None: transformers' code / the runtime)


@dataclass
class ModelE2EResult:
    a: str
    b: str
    device: str
    dtype: str
    compiled: bool
    cuda_graphs: bool
    model: dict[str, Any]
    replaced: dict[str, int]
    prefill: list[dict[str, Any]] = field(default_factory=list)  # {"tokens", "a_s": [...], "b_s": [...]}
    decode: list[dict[str, Any]] = field(default_factory=list)  # {"batch", "a_s": [...], "b_s": [...]} per token
    topk: int = 5
    logprob_max_abs_diff: float = 0.0
    top1_agreement: float = 1.0
    fallbacks: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        """Medians per point and the B/A ratio (what docs/gpu.md and the trial notes show)."""
        def pts(rows: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
            out = []
            for r in rows:
                a, b = statistics.median(r["a_s"]), statistics.median(r["b_s"])
                out.append({key: r[key], f"{self.a}_ms": a * 1e3, f"{self.b}_ms": b * 1e3, "ratio": b / a})
            return out

        return {"a": self.a, "b": self.b, "device": self.device, "dtype": self.dtype, "model": self.model,
                "replaced": self.replaced, "ttft": pts(self.prefill, "tokens"), "tpot": pts(self.decode, "batch"),
                "topk": self.topk, "logprob_max_abs_diff": self.logprob_max_abs_diff,
                "top1_agreement": self.top1_agreement, "fallbacks": self.fallbacks,
                "seconds": round(self.seconds, 1)}


# --------------------------------------------------------------------------------------------- building
def llama_config(cfg: Mapping[str, Any]) -> Any:
    """A ``LlamaConfig`` from a profile's model mapping (``architecture`` must be llama)."""
    from transformers import LlamaConfig

    cfg = {k: v for k, v in dict(cfg).items() if v is not None}
    arch = cfg.pop("architecture", "llama")
    if arch != "llama":
        raise ValueError(f"model architecture {arch!r} is not supported (llama)")
    for k in ("dtype", "max_cache_len", "decode_steps"):
        cfg.pop(k, None)
    return LlamaConfig(**cfg)


def build_model(cfg: Mapping[str, Any], *, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Any:
    """Random-weight model from the config (small init so activations stay O(1) over many layers)."""
    from transformers import LlamaForCausalLM

    config = llama_config(cfg)
    config.initializer_range = 0.02
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(dtype).eval()


def bound_ops(ops: OpSet, label: str) -> dict[str, Any]:
    """``BoundOp``s from (KernelOp, config) pairs (the trial worker's form); BoundOps pass through."""
    from triton import knobs

    from kernelpack.loader import BoundOp

    out: dict[str, Any] = {}
    for name, v in ops.items():
        if isinstance(v, tuple):
            op, config = v
            cache = Path(knobs.cache.dir) if knobs.cache.dir else Path(tempfile.gettempdir()) / "kernelctl-triton"
            out[name] = BoundOp(name, op, dict(config), None, label, cache)
        else:
            out[name] = v
    return out


# --------------------------------------------------------------------------------------------- running
class _Runner:
    """One variant's compiled prefill and per-batch decode steps (static cache, CUDA graph on GPU)."""

    def __init__(self, v: Variant, device: torch.device, compiled: bool, max_cache_len: int,
                 shared: dict[Any, Any]) -> None:
        self.v, self.device, self.compiled, self.max_cache_len = v, device, compiled, max_cache_len
        self.shared = shared  # per model: compiled callables and caches shared by variants of one model
        self.graphs: dict[int, Callable[[], torch.Tensor]] = {}

    def _pin(self) -> Any:
        from contextlib import nullcontext

        return torch_ops.pinned(self.v.ops) if self.v.ops is not None else nullcontext()

    def _compiled(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        key = (id(self.v.model), name)
        if key not in self.shared:
            self.shared[key] = torch.compile(fn, fullgraph=True, dynamic=False) if self.compiled else fn
        return self.shared[key]

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        model = self.v.model

        def fwd(ids: torch.Tensor) -> torch.Tensor:
            return model(input_ids=ids, use_cache=False, logits_to_keep=1).logits

        with self._pin(), torch.no_grad():
            return self._compiled("prefill", fwd)(ids)

    def decode(self, batch: int) -> Callable[[], torch.Tensor]:
        """A zero-argument step that decodes one token for ``batch`` sequences (positions restart per window)."""
        if batch in self.graphs:
            return self.graphs[batch]
        from transformers import StaticCache

        model = self.v.model
        ckey = (id(model), "cache", batch)
        if ckey not in self.shared:
            cache = StaticCache(config=model.config, max_cache_len=self.max_cache_len)
            tok = torch.randint(0, model.config.vocab_size, (batch, 1), device=self.device)
            with torch.no_grad(), self._pin():  # initialise the cache eagerly (static addresses)
                model(input_ids=tok, past_key_values=cache, use_cache=True)

            def step(tok: torch.Tensor) -> torch.Tensor:
                return model(input_ids=tok, past_key_values=cache, use_cache=True).logits

            self.shared[ckey] = (cache, tok, self._compiled(f"decode{batch}", step))
        cache, tok, step = self.shared[ckey]
        label = self.v.name

        if self.device.type == "cuda":
            graph = SwitchingGraph(lambda t: step(t), key_fn=lambda: label, keep=1)

            def run() -> torch.Tensor:
                with torch.no_grad(), self._pin():
                    return graph(tok)
        else:
            def run() -> torch.Tensor:
                with torch.no_grad(), self._pin():
                    return step(tok)

        cache.reset()
        run()  # warm-up (and capture)
        self.graphs[batch] = lambda: (cache.reset(), run())[1]  # type: ignore[func-returns-value]
        self.graphs[(batch, "step")] = run  # type: ignore[index]
        return self.graphs[batch]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time(fn: Callable[[], Any], device: torch.device, reps: int = 1) -> float:
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / reps


@torch.no_grad()
def _logprobs(r: _Runner, prompts: torch.Tensor) -> torch.Tensor:
    with r._pin():
        logits = r.v.model(input_ids=prompts, use_cache=False).logits
    return torch.log_softmax(logits.float(), dim=-1)


def measure(a: Variant, b: Variant, **kw: Any) -> ModelE2EResult:
    """Interleaved A/B: TTFT per prefill size, time per output token per decode batch, log-prob agreement."""
    replaced = kw.pop("replaced", None)
    return measure_many(a, [b], replaced=[replaced or {}], **kw)[0]


def measure_many(a: Variant, others: Sequence[Variant], *, device: torch.device, dtype: str,
                 prefill_tokens: Sequence[int], decode_batches: Sequence[int], rounds: int = 3,
                 decode_steps: int = 16, max_cache_len: int = 1024, prompt_len: int = 32, n_prompts: int = 4,
                 topk: int = 5, compiled: bool | None = None, seed: int = 0, prefill_reps: int | None = None,
                 model_info: Mapping[str, Any] | None = None,
                 replaced: Sequence[Mapping[str, int]] = ()) -> list[ModelE2EResult]:
    """A against each B, all interleaved in one run (rotating order per round); one result per B."""
    from kernelpack.integrations import transformers as kt

    t_start = time.perf_counter()
    cuda = device.type == "cuda"
    compiled = cuda if compiled is None else compiled
    prefill_reps = prefill_reps or (3 if cuda else 1)
    if compiled:  # one code object serves several shapes and models: room for all their graphs
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        torch._dynamo.config.accumulated_recompile_limit = max(
            torch._dynamo.config.accumulated_recompile_limit, 1024)
    shared: dict[Any, Any] = {}
    variants = [a, *others]
    runners = {v.name: _Runner(v, device, compiled, max_cache_len, shared) for v in variants}
    vocab = a.model.config.vocab_size
    gen = torch.Generator(device="cpu").manual_seed(seed)
    prompts = {n: torch.randint(0, vocab, (1, n), generator=gen).to(device) for n in prefill_tokens}
    kt.FALLBACKS.clear()
    # warm-up (compile, capture) outside the timed rounds
    for r in runners.values():
        for n in prefill_tokens:
            r.prefill(prompts[n])
        for bs in decode_batches:
            r.decode(bs)
    samples: dict[tuple[str, str, int], list[float]] = {}
    names = [v.name for v in variants]
    for rnd in range(rounds):
        k = rnd % len(names)
        order = names[k:] + names[:k] if rnd % 2 == 0 else list(reversed(names[k:] + names[:k]))
        for name in order:
            r = runners[name]
            for n in prefill_tokens:
                samples.setdefault((name, "prefill", n), []).append(
                    _time(lambda r=r, n=n: r.prefill(prompts[n]), device, reps=prefill_reps))
            for bs in decode_batches:
                window = r.decode(bs)
                step = r.graphs[(bs, "step")]  # type: ignore[index]
                window()  # reset the cache (positions restart) and run one step
                samples.setdefault((name, "decode", bs), []).append(
                    _time(step, device, reps=decode_steps))
    # log-prob agreement on the same prompts (eager forward, all positions)
    lp_prompts = torch.randint(0, vocab, (n_prompts, prompt_len), generator=gen).to(device)
    lp_a = _logprobs(runners[a.name], lp_prompts)
    top_a = lp_a.topk(topk, dim=-1).indices
    results = []
    for i, b in enumerate(others):
        res = ModelE2EResult(a.name, b.name, str(device), dtype, compiled, cuda, dict(model_info or {}),
                             dict(replaced[i]) if i < len(replaced) else {}, topk=topk)
        res.prefill = [{"tokens": n, "a_s": samples[(a.name, "prefill", n)],
                        "b_s": samples[(b.name, "prefill", n)]} for n in prefill_tokens]
        res.decode = [{"batch": bs_, "a_s": samples[(a.name, "decode", bs_)],
                       "b_s": samples[(b.name, "decode", bs_)]} for bs_ in decode_batches]
        lp_b = _logprobs(runners[b.name], lp_prompts)
        diff = (lp_a.gather(-1, top_a) - lp_b.gather(-1, top_a)).abs().max().item()
        res.logprob_max_abs_diff = diff if math.isfinite(diff) else 1e30
        res.top1_agreement = (lp_a.argmax(-1) == lp_b.argmax(-1)).float().mean().item()
        res.fallbacks = {f"{k}: {why}": n for (k, why), n in kt.FALLBACKS.items()}
        res.seconds = time.perf_counter() - t_start
        results.append(res)
    return results


def model_info(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in dict(cfg).items() if v is not None}


def trial_model_e2e(cfg: Mapping[str, Any], stable: OpSet, candidate: OpSet, *, device: torch.device,
                    prefill_tokens: Sequence[int], decode_batches: Sequence[int], rounds: int = 3,
                    seed: int = 0) -> ModelE2EResult:
    """The trial: one model from ``cfg``, patched once; stable's ops against the candidate's, interleaved."""
    from kernelpack.integrations.transformers import apply_kernels

    dtype = str(cfg.get("dtype") or ("bf16" if device.type == "cuda" else "fp32"))
    model = build_model(cfg, device=device, dtype=DTYPES[dtype], seed=seed)
    replaced = apply_kernels(model)
    return measure(Variant("stable", model, bound_ops(stable, "stable")),
                   Variant("candidate", model, bound_ops(candidate, "candidate")),
                   device=device, dtype=dtype, prefill_tokens=prefill_tokens, decode_batches=decode_batches,
                   rounds=rounds, decode_steps=int(cfg.get("decode_steps") or (16 if device.type == "cuda" else 1)),
                   max_cache_len=int(cfg.get("max_cache_len") or (1024 if device.type == "cuda" else 16)),
                   prompt_len=32 if device.type == "cuda" else 4, n_prompts=4 if device.type == "cuda" else 1,
                   seed=seed, model_info=model_info(cfg), replaced=replaced)


def benchmark(cfg: Mapping[str, Any], ops: OpSet | None, *, device: torch.device, prefill_tokens: Sequence[int],
              decode_batches: Sequence[int], kinds_sets: Sequence[Sequence[str]] | None = None, rounds: int = 3,
              seed: int = 0, max_cache_len: int = 1024, decode_steps: int = 16) -> list[ModelE2EResult]:
    """transformers' model with SDPA (A) against the same weights patched with each set of kinds on ``ops``."""
    from kernelpack.integrations.transformers import KINDS, apply_kernels

    dtype = str(cfg.get("dtype") or "bf16")
    base = build_model(cfg, device=device, dtype=DTYPES[dtype], seed=seed)
    base.set_attn_implementation("sdpa")
    pinned = bound_ops(ops, "kernelctl") if ops is not None else None
    variants, replaced = [], []
    for kinds in kinds_sets or [KINDS]:  # ["measured"]: every kind where the bundle's wins table says so
        patched = copy.deepcopy(base)
        measured = list(kinds) == ["measured"]
        # other variants run their kinds' kernels everywhere in their domains, whatever the table says
        replaced.append(apply_kernels(patched, kinds=KINDS if measured else kinds,
                                      policy=None if measured else dict.fromkeys(kinds, (1, None))))
        variants.append(Variant("kernelctl[" + ",".join(kinds) + "]", patched, pinned))
    return measure_many(Variant("sdpa", base, None), variants, device=device, dtype=dtype,
                        prefill_tokens=prefill_tokens, decode_batches=decode_batches, rounds=rounds,
                        decode_steps=decode_steps, max_cache_len=max_cache_len, seed=seed,
                        model_info=model_info(cfg), replaced=replaced)


LLAMA3_8B = {"architecture": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
             "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "rope_theta": 500000.0,
             "max_position_embeddings": 16384, "rms_norm_eps": 1e-5,  # Llama-3's own eps and rope scaling
             "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192}}


def main(argv: list[str] | None = None) -> int:
    """``python -m kernelpack.harness.model_e2e``: the serving benchmark of docs/gpu.md (SDPA vs kernelctl)."""
    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--prefill", type=int, nargs="*", default=[2048, 8192])
    p.add_argument("--batches", type=int, nargs="*", default=[1, 8, 32, 64])
    p.add_argument("--kinds", action="append", default=None,
                   help="comma-separated kinds of one patched variant, or 'measured' (all kinds, run where the "
                   "bundle's per-arch wins table says the kernel wins); "
                "repeatable; default: all kinds")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--bundle-src", default="kernelpack/bundles/llm-fused/1.1.0")
    p.add_argument("--json", default=None)
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--identical-trial", action="store_true",
                   help="instead: the trial's measurement (trial_model_e2e) of a candidate identical to stable")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ops = _installed_bundle_ops(args.bundle_src)
    cfg = {**LLAMA3_8B, "num_hidden_layers": args.layers, "dtype": "bf16"}
    kinds_sets = [k.split(",") for k in args.kinds] if args.kinds else None
    if args.identical_trial:
        cfg = {**cfg, "decode_steps": args.decode_steps}
        results = [trial_model_e2e(cfg, ops, dict(ops), device=device, prefill_tokens=args.prefill,
                                   decode_batches=args.batches, rounds=args.rounds)]
    else:
        results = benchmark(cfg, ops, device=device, prefill_tokens=args.prefill, decode_batches=args.batches,
                            kinds_sets=kinds_sets, rounds=args.rounds, decode_steps=args.decode_steps)
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    out = {"gpu": gpu, "torch": torch.__version__, "results": [{**r.summary(), "raw": asdict(r)} for r in results]}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    for r in results:
        print(json.dumps({"gpu": gpu, **r.summary()}, indent=1))
    return 0


def _installed_bundle_ops(src: str) -> dict[str, Any]:
    """The bundle source's ops with its launch configs for this arch, from the installed kernel modules
    (the benchmark measures kernels, not signing: ``kernelctl bundle build`` + the runtime serve the same)."""
    from kernelpack.loader import detect_arch, detect_device
    from kernelpack.manifest import load_source
    from kernelpack.torch_ops import _installed_ops

    source = load_source(Path(src))
    arch = detect_arch()
    installed = _installed_ops()
    ops: dict[str, Any] = {}
    for k in source.kernels:
        if k.op in installed and (not k.archs or arch in k.archs):
            ops[k.op] = (installed[k.op], {**installed[k.op].default_config, **k.config_for(arch, detect_device())})
    bound = bound_ops(ops, f"{source.name}@{source.version}")
    for k in source.kernels:  # the serving policy: where the bundle says each kernel wins on this arch
        if k.op in bound and (wins := k.wins_for(arch)) is not None:
            bound[k.op].wins = tuple((w.lo, w.hi) for w in wins)
    return bound


if __name__ == "__main__":
    raise SystemExit(main())
