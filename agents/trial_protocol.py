"""What the agent hands its trial child (``WorkerSpec``) and what the child writes back (``WorkerResult``).

Both are JSON files: the parent writes the spec, the child writes its result atomically (temp file +
rename) and a small progress file naming the phase it is in, so a crash or hang report says where it died.
Also the traffic profile file format (``--profile``). No torch import here: the agent process stays light.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Literal

import tomllib
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kernelctl.vocab import DTypeName, NumericsMemoMode, Outcome


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelProfile(_Model):
    """A model architecture the end-to-end trial builds from its config (random weights, nothing downloaded);
    measured by ``kernelpack.harness.model_e2e`` (serving, issue 17). Unset sizes: transformers' defaults."""

    architecture: Literal["llama"] = "llama"
    hidden_size: int = Field(ge=8)
    intermediate_size: int = Field(ge=8)
    num_hidden_layers: int = Field(ge=1, le=256)
    num_attention_heads: int = Field(ge=1)
    num_key_value_heads: int | None = Field(None, ge=1)
    head_dim: int | None = Field(None, ge=8)
    vocab_size: int = Field(32000, ge=2)
    max_position_embeddings: int = Field(8192, ge=16)
    rms_norm_eps: float | None = Field(None, gt=0)
    rope_theta: float | None = Field(None, gt=0)
    dtype: DTypeName | None = Field(None, description="default: bf16 on GPUs, fp32 on CPU")
    max_cache_len: int | None = Field(None, ge=2, description="static KV cache length of the decode timing")
    decode_steps: int | None = Field(None, ge=1, le=4096, description="decode steps per timed window")


class TrafficProfile(_Model):
    """``--profile`` file (JSON or TOML): overrides the trial shapes and effort the controller asked for."""

    batch_sizes: list[int] | None = Field(None, description="decode tokens per call")
    prefill_tokens: list[int] | None = None
    rounds: int | None = Field(None, ge=1, le=1000)
    fuzz_shapes: int | None = Field(None, ge=0, le=1000, description="random shapes per op and dtype")
    dtypes: list[DTypeName] | None = Field(None, description="dtypes checked for numerics (default: all)")
    latency_dtype: DTypeName | None = None
    e2e: bool | None = Field(None, description="measure the decoder block end to end")
    model: ModelProfile | None = Field(None, description="measure this model end to end instead of the block")
    memory_limit_mb: int | None = Field(None, ge=64, description="CPU only: address-space budget of the child")
    numerics_max_tokens: int | None = Field(
        None, ge=1, le=1 << 20, description="CPU only: token count cap of the production-shape numerics")
    op_calls_per_step: dict[str, float] | None = Field(
        None, description="traffic weights: calls of each op per serving step (default 1 each)")
    batch_share: dict[str, float] | None = Field(
        None, description="traffic weights: share of serving steps at each token count (default equal)")
    e2e_rounds: int | None = Field(None, ge=1, le=1000, description="rounds of the end-to-end block timing")
    timing_lock_s: float | None = Field(
        None, ge=0, le=3600, description="longest wait for the host's per-GPU timing lock before timing anyway "
                                         "(agents.timing_lock; default 120 s on GPU nodes, off on CPU nodes; 0: off)")
    numerics_memo: NumericsMemoMode | None = Field(
        None, description="repeat trials of a pair: skip | fingerprint | off (default: skip on CPU nodes, "
                          "fingerprint on GPU nodes; kernelctl.vocab.NumericsMemoMode)")

    @field_validator("op_calls_per_step", "batch_share")
    @classmethod
    def _weights(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is not None and any(not (0 <= x < 1e9) for x in v.values()):
            raise ValueError("weights must be finite and >= 0")
        return v

    @field_validator("batch_sizes", "prefill_tokens")
    @classmethod
    def _positive(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and any(x < 1 for x in v):
            raise ValueError("sizes must be positive integers")
        return v


class ProfileError(ValueError):
    """The profile file is unreadable or invalid."""


def load_profile(path: Path) -> TrafficProfile:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ProfileError(f"traffic profile {path}: cannot read: {exc.strerror}") from None
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise ProfileError(f"traffic profile {path}: not valid {path.suffix.lstrip('.') or 'JSON'}: {exc}") from None
    try:
        return TrafficProfile.model_validate(data)
    except ValidationError as exc:
        errs = "; ".join(f"{'.'.join(map(str, e['loc'])) or '<root>'}: {e['msg']}" for e in exc.errors())
        raise ProfileError(f"traffic profile {path}: {errs}") from None


GPU_TIMING_LOCK_S = 120.0
"""Default longest wait for the host's per-GPU timing lock on GPU nodes (agents.timing_lock)."""


class WorkerSpec(_Model):
    candidate_path: str
    candidate_digest: str
    stable_path: str | None = None
    stable_digest: str | None = None
    trusted_keys_dir: str
    loader_cache_dir: str
    device: Literal["cpu", "cuda"]
    arch: str | None = None
    batch_sizes: list[int] = Field(default_factory=list)
    prefill_tokens: list[int] = Field(default_factory=list)
    rounds: int = 3
    seed: int = 0
    fuzz_shapes: int = 2
    dtypes: list[DTypeName] | None = None
    latency_dtype: DTypeName | None = None
    e2e: bool = True
    model: ModelProfile | None = None  # serving (issue 17): end to end on this model instead of the block
    memory_limit_bytes: int | None = None  # CPU: RLIMIT_AS budget above the child's footprint after imports
    numerics_max_tokens: int = 2048
    numerics_memo: NumericsMemoMode | None = None  # None: by device (agents.trial_memo.memo_mode)
    timing_lock_s: float = 0.0  # agents.timing_lock: longest wait for the per-device timing lock; 0: no lock
    e2e_rounds: int | None = None
    agent_pid: int | None = None
    progress_path: str | None = None


class WorkerResult(_Model):
    outcome: Outcome
    detail: str = ""
    phase: str = ""
    latency: list[dict[str, Any]] = Field(default_factory=list)
    numerics: list[dict[str, Any]] = Field(default_factory=list)
    e2e_stable_s: float | None = None
    e2e_candidate_s: float | None = None
    launches_per_call: dict[str, int] = Field(default_factory=dict)
    peak_memory_bytes: int | None = None
    resources: list[dict[str, Any]] = Field(default_factory=list)  # per (op, tokens): both versions
    e2e_pairs: list[dict[str, float]] = Field(default_factory=list)
    cells: list[dict[str, Any]] = Field(default_factory=list)  # kernelctl.wire.CellLatency documents
    e2e: dict[str, Any] | None = None  # a kernelctl.wire.ArmsLatency document
    free_memory_bytes: int | None = None
    seconds: dict[str, float] = Field(default_factory=dict)  # time spent per phase


def write_json_atomic(path: Path, data: Any, *, mode: int | None = None) -> None:
    """Write ``data`` as JSON to ``path`` via a temp file in the same directory and rename (``mode``: the
    file's permissions, e.g. 0o600 for secrets, set before anything is written)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
