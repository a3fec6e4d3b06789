"""Operator/viewer request and response models of the HTTP API (agent models live in kernelctl.wire)."""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from controller.plan import PlanSpec

BUNDLE_REF_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,127}@\d+\.\d+\.\d+(?:-[0-9A-Za-z.-]+)?(?:\+[0-9A-Za-z.-]+)?$"
NO_NUL = r"^[^\x00]*$"  # PostgreSQL text cannot hold NUL: refused at the wire, naming the field
Reason = Field(None, max_length=4000, pattern=NO_NUL)


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class RolloutStartRequest(_Request):
    bundle: str = Field(pattern=BUNDLE_REF_PATTERN, description="NAME@VERSION of a registered bundle.")
    plan: PlanSpec | None = Field(None, description="The rollout plan (default: 1 node, 10%, 50%, 100%).")
    force: bool = False
    reason: str | None = Reason
    accept_contract_change: str | None = Field(
        None, min_length=1, max_length=2000,
        description="Why a candidate that loosens the stable version's numeric contract may roll out anyway.")


class PromoteRequest(_Request):
    full: bool = Field(False, description="Promote every stratum to 100% now, skipping the remaining steps.")
    from_step: int | None = Field(
        None, ge=-1, le=100, validate_default=True,
        description="The step this promote moves the rollout from (`promote_from_step` of its status; -1 while "
        "pending). Required unless `full`. A rollout no longer at that step answers 409 and nothing changes, so "
        "a duplicated or racing promote counts once.")
    reason: str | None = Reason

    @field_validator("from_step")
    @classmethod
    def _from_step_required(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is None and not info.data.get("full", False):
            raise PydanticCustomError(
                "missing", "from_step is required for a step promotion: the step you promote from, as shown by "
                "`kernelctl rollout status` (-1 for a pending rollout)")
        return v


class RollbackRequest(_Request):
    reason: str = Field(min_length=1, max_length=4000, pattern=NO_NUL)
    strata: list[Annotated[str, Field(max_length=256)]] | None = Field(
        None, max_length=1000, description="Only these strata (default: all).")


class ReasonRequest(_Request):
    reason: str | None = Reason


class BundleOut(BaseModel):
    name: str
    version: str
    ref: str
    digest: str
    status: str
    status_reason: str | None = None
    parent_version: str | None = None
    signer_key_id: str
    size_bytes: int
    created_at: dt.datetime
    created_by: str
    targets: list[dict[str, Any]] = Field(default_factory=list)
    manifest: dict[str, Any] | None = None


class StepOut(BaseModel):
    index: int
    nodes: int | None
    percent: float | None
    bake_seconds: float
    min_samples: int
    deadline_seconds: float


class VerdictOut(BaseModel):
    stratum: str
    step_index: int
    at: dt.datetime
    decision: str
    gate: str
    samples: int
    evidence: dict[str, Any]


class StratumOut(BaseModel):
    stratum: str
    state: str
    step_index: int
    step_started_at: dt.datetime
    baseline: str | None
    reason: str | None
    first_failure_at: dt.datetime | None = None
    # fleet / assigned / active, and canaries per phase: staged / verified / serving
    nodes: dict[str, int] = Field(default_factory=dict)
    latest_verdict: VerdictOut | None = None


class RolloutOut(BaseModel):
    id: int
    bundle: str
    state: str
    step_index: int
    created_by: str
    created_at: dt.datetime
    updated_at: dt.datetime
    reason: str | None
    forced: bool
    promote_from_step: int | None = Field(
        None, description="What a step promote of this rollout sends as from_step now (None when terminal).")


class RolloutDetail(RolloutOut):
    plan: dict[str, Any]
    steps: list[StepOut]
    strata: list[StratumOut]
    verdicts: list[VerdictOut]


class NodeOut(BaseModel):
    name: str
    state: str
    stratum: str
    gpu_name: str
    arch: str
    driver_version: str
    triton_version: str
    torch_version: str
    last_heartbeat_at: dt.datetime
    active: dict[str, str] = Field(default_factory=dict)  # bundle name -> active version
    desired: dict[str, str] = Field(default_factory=dict)
    # bundle name -> the candidate's phase on this node (staged / verified / serving); only canaries
    phases: dict[str, str] = Field(default_factory=dict)


class ReportBatchOut(BaseModel):
    accepted: int
    duplicates: int
