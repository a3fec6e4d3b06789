"""Operator/viewer request and response models of the HTTP API (agent models live in kernelctl.wire)."""

from __future__ import annotations

import datetime as dt
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from controller.plan import PlanSpec

BUNDLE_REF_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,127}@\d+\.\d+\.\d+(?:-[0-9A-Za-z.-]+)?(?:\+[0-9A-Za-z.-]+)?$"
Reason = Field(None, max_length=4000)


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RolloutStartRequest(_Request):
    bundle: str = Field(pattern=BUNDLE_REF_PATTERN, description="NAME@VERSION of a registered bundle.")
    plan: PlanSpec | None = Field(None, description="The rollout plan (default: 1 node, 10%, 50%, 100%).")
    force: bool = False
    reason: str | None = Reason


class PromoteRequest(_Request):
    full: bool = Field(False, description="Promote every stratum to 100% now, skipping the remaining steps.")
    reason: str | None = Reason


class RollbackRequest(_Request):
    reason: str = Field(min_length=1, max_length=4000)
    strata: list[str] | None = Field(None, max_length=1000, description="Only these strata (default: all).")


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
    nodes: dict[str, int] = Field(default_factory=dict)  # eligible / assigned / active / staged
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


class ReportBatchOut(BaseModel):
    accepted: int
    duplicates: int
