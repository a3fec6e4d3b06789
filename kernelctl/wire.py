"""The wire contract between agents and the controller (pydantic v2 models).

No database, GPU or controller imports here: the agent imports only this module to talk to the
controller. Every numeric field is validated (finite, non-negative, bounded) so that NaN, negative or
absurd figures are refused with 422 and the field at fault, before anything is written.
"""

from __future__ import annotations

import datetime as dt
import math
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

API_PREFIX = "/v1"

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$"
BUNDLE_NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,127}$"
VERSION_PATTERN = r"^\d+\.\d+\.\d+(?:-[0-9A-Za-z.-]+)?(?:\+[0-9A-Za-z.-]+)?$"


def _finite(v: float) -> float:
    if not math.isfinite(v):
        raise ValueError("must be a finite number (NaN and infinity are refused)")
    return v


Finite = Annotated[float, AfterValidator(_finite)]
NonNegFinite = Annotated[float, AfterValidator(_finite), Field(ge=0)]
# A kernel latency in seconds: positive and below an hour (anything else is a broken measurement).
LatencySeconds = Annotated[float, AfterValidator(_finite), Field(gt=0, lt=3600)]
ErrorValue = Annotated[float, AfterValidator(_finite), Field(ge=0, le=1e30)]
MemoryBytes = Annotated[int, Field(ge=0, le=2**50)]
NodeName = Annotated[str, Field(pattern=NAME_PATTERN)]
BundleName = Annotated[str, Field(pattern=BUNDLE_NAME_PATTERN)]
Version = Annotated[str, Field(pattern=VERSION_PATTERN, max_length=64)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# ------------------------------------------------------------------------------------------ inventory
class Inventory(Strict):
    """What a node is: the inputs of the compatibility matrix."""

    gpu_name: str = Field(max_length=128)
    compute_capability: str = Field(pattern=r"^(\d+\.\d+|cpu)$")
    arch: str = Field(pattern=r"^(sm_\d+a?|cpu)$")
    driver_version: str = Field(max_length=32)
    cuda_version: str = Field(max_length=32)
    triton_version: str = Field(max_length=32)
    torch_version: str = Field(max_length=64)
    memory_total_mb: int = Field(ge=0, le=2**31)
    labels: dict[str, str] = Field(default_factory=dict, max_length=64)


class RegisterRequest(Strict):
    node_name: NodeName
    inventory: Inventory


class RegisterResponse(Strict):
    node_name: str
    node_token: str  # node-bound token the agent uses from now on
    heartbeat_seconds: float


class BundleRef(Strict):
    name: BundleName
    version: Version
    digest: str = Field(pattern=r"^[0-9a-f]{64}$")


class HeartbeatRequest(Strict):
    node_name: NodeName
    inventory: Inventory | None = None  # sent when it changed
    staged: list[BundleRef] = Field(default_factory=list, max_length=64)
    active: list[BundleRef] = Field(default_factory=list, max_length=64)
    trial_running: bool = False


class TrialSpec(Strict):
    """What the agent must measure for a candidate against the stable version."""

    rollout_id: int
    stratum: str
    candidate: BundleRef
    stable: BundleRef | None
    batch_sizes: list[int] = Field(default_factory=list)  # decode tokens per call
    prefill_tokens: list[int] = Field(default_factory=list)
    rounds: int = Field(5, ge=1, le=1000)
    interval_seconds: float = Field(30, ge=0)  # minimum time between trials on a node


class DesiredBundle(Strict):
    """Desired state of one bundle on a node: which version is active, which are staged."""

    name: BundleName
    active: BundleRef  # the version serving code should use now
    stable: BundleRef | None  # kept staged so a rollback is a switch, not a download
    role: Literal["stable", "candidate"]
    trial: TrialSpec | None = None


class HeartbeatResponse(Strict):
    node_name: str
    desired: list[DesiredBundle]
    heartbeat_seconds: float
    server_time: dt.datetime


# ------------------------------------------------------------------------------------------- reports
Outcome = Literal["ok", "numeric_error", "mismatch", "oom", "crash", "hang", "compile_error", "load_error"]


class LatencyPair(Strict):
    """One interleaved stable/candidate measurement on the same node and inputs."""

    op: str = Field(max_length=64)
    tokens: int = Field(ge=1, le=10_000_000)
    stable_s: LatencySeconds
    candidate_s: LatencySeconds


class NumericCheck(Strict):
    op: str = Field(max_length=64)
    dtype: Literal["fp16", "bf16", "fp32"]
    shape: dict[str, int]
    max_abs_err: ErrorValue
    max_rel_err: ErrorValue
    within_tolerance: bool
    unwritten: int = Field(0, ge=0)
    vs_stable_max_abs: ErrorValue | None = None
    vs_stable_within: bool | None = None


class TrialReport(Strict):
    """The result of one trial of a candidate on a node (idempotency key: replay counts once)."""

    idempotency_key: str = Field(min_length=8, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$")
    rollout_id: int
    stratum: str = Field(max_length=96)
    candidate: BundleRef
    stable: BundleRef | None
    outcome: Outcome
    measured_at: dt.datetime
    duration_s: NonNegFinite = 0.0
    latency: list[LatencyPair] = Field(default_factory=list, max_length=10_000)
    numerics: list[NumericCheck] = Field(default_factory=list, max_length=10_000)
    e2e_stable_s: LatencySeconds | None = None
    e2e_candidate_s: LatencySeconds | None = None
    launches_per_call: dict[str, int] = Field(default_factory=dict)
    peak_memory_bytes: MemoryBytes | None = None
    detail: str = Field("", max_length=8192)  # human-readable: error text, signal, exit code


class ReportBatch(Strict):
    node_name: NodeName
    reports: list[TrialReport] = Field(min_length=1, max_length=1000)


class ReportBatchResponse(Strict):
    accepted: int
    duplicates: int


class ErrorBody(Strict):
    detail: str
