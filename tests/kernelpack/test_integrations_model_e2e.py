"""kernelpack.harness.model_e2e on CPU: a tiny Llama from a config, stable vs candidate interleaved."""

from __future__ import annotations

import pytest
import torch
import transformers  # noqa: F401  - a test dependency (the [test] extra): missing it is an error, not a skip

from kernelpack.harness import model_e2e
from kernelpack.kernels import add_rmsnorm, rope, swiglu
from tests.kernelpack.bundle_fixtures import *  # noqa: F403
from tests.kernelpack.serving_fixtures import *  # noqa: F403

TINY = {"architecture": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 32,
        "max_position_embeddings": 32, "dtype": "fp32", "max_cache_len": 8}


def _ops(**cfg: dict) -> dict:
    return {m.OP.name: (m.OP, {**m.OP.default_config, **cfg.get(m.OP.name, {})})
            for m in (add_rmsnorm, swiglu, rope)}


def test_trial_measures_ttft_tpot_and_logprob_agreement() -> None:
    res = model_e2e.trial_model_e2e(TINY, _ops(), _ops(swiglu={"BLOCK": 1024}), device=torch.device("cpu"),
                                    prefill_tokens=[3], decode_batches=[2], rounds=2)
    s = res.summary()
    assert res.replaced == {"rmsnorm": 1, "mlp": 1, "rope": 1, "attention": 1}
    assert [p["tokens"] for p in s["ttft"]] == [3] and [p["batch"] for p in s["tpot"]] == [2]
    assert len(res.prefill[0]["a_s"]) == 2 and all(t > 0 for t in res.decode[0]["b_s"])
    assert res.logprob_max_abs_diff < 1e-4 and res.top1_agreement == 1.0  # same math, another launch config


def test_a_wrong_candidate_shows_in_the_logprobs() -> None:
    bad_op = add_rmsnorm.OP.__class__(**{**add_rmsnorm.OP.__dict__, "name": "add_rmsnorm"})
    bad_op.run = lambda inputs, outs, cfg: (outs[0].copy_(inputs["x"] * 3), outs[1].copy_(inputs["x"] + inputs["residual"]))
    cand = {**_ops(), "add_rmsnorm": (bad_op, {})}
    res = model_e2e.trial_model_e2e(TINY, _ops(), cand, device=torch.device("cpu"),
                                    prefill_tokens=[3], decode_batches=[1], rounds=1)
    assert res.logprob_max_abs_diff > model_e2e.LOGPROB_BOUND["fp32"]


def test_rejects_other_architectures() -> None:
    with pytest.raises(ValueError, match="not supported"):
        model_e2e.llama_config({**TINY, "architecture": "gpt2"})


def test_trial_worker_measures_the_profile_model(tmp_path, keys, serve_bundles) -> None:
    """The hook: a profile naming a model makes the trial child measure it instead of the decoder block."""
    import json

    from agents.trial_protocol import ModelProfile, TrafficProfile, WorkerSpec
    from agents.trial_worker import Worker

    prof = TrafficProfile.model_validate({"model": TINY})
    assert isinstance(prof.model, ModelProfile)
    s, c = serve_bundles["0.1.0"], serve_bundles["0.2.0"]
    spec = WorkerSpec(candidate_path=str(c.path), candidate_digest=c.digest, stable_path=str(s.path),
                      stable_digest=s.digest, trusted_keys_dir=str(keys.trusted),
                      loader_cache_dir=str(tmp_path / "cache"), device="cpu", arch="sm_90", batch_sizes=[2],
                      prefill_tokens=[3], rounds=1, fuzz_shapes=0, dtypes=["fp32"], model=prof.model)
    result = Worker(spec).run()
    assert result.outcome == "ok", result.detail
    assert result.e2e_stable_s and result.e2e_candidate_s
    # every TTFT and TPOT point reaches the judge: one matched pair per round, the judged e2e signal
    assert len(result.e2e_pairs) == spec.rounds
    line = next(n for n in result.detail.splitlines() if n.startswith("model_e2e "))
    summary = json.loads(line.split(" ", 1)[1])
    assert summary["replaced"]["mlp"] == 1 and summary["tpot"][0]["batch"] == 2
    assert summary["logprob_max_abs_diff"] == 0.0  # the same kernels in both versions: bit-identical
