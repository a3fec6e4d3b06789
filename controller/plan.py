"""The rollout plan (``PlanSpec``): steps, bake and sample rules, the judge's margins (latency per cell and
aggregate, end-to-end, peak memory), the launch gate's mode and blast-radius limits.

A plan is validated with pydantic when a rollout starts and stored as JSON in ``rollouts.plan`` (the plan
as started); the engine reads it back with :func:`load_plan`. The default is 1 node per stratum, then 10%,
50% and 100% of each stratum's eligible nodes. ``serve_before_trial`` (default false) opts out of trial
before serve.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from controller.errors import Invalid
from kernelctl.vocab import DEFAULT_MEMORY_MARGIN, LaunchGate


class StepSpec(BaseModel):
    """One step: ``nodes`` (a count per stratum) or ``percent`` (of each stratum's eligible nodes)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # Infinity is not JSON: refused

    nodes: int | None = Field(None, ge=1, le=1_000_000)
    percent: float | None = Field(None, gt=0, le=100)
    bake_seconds: float = Field(300.0, ge=0, le=30 * 86400)
    min_samples: int = Field(5, ge=1, le=1_000_000)
    deadline_seconds: float = Field(3600.0, gt=0, le=90 * 86400)
    deadline_extension: float = Field(
        1.0, ge=0, le=10,
        description="Past deadline_seconds, a stratum still holding with every judged metric sampled and none in "
                    "regression keeps collecting for this fraction of the deadline more before it pauses (the "
                    "judge's tests are anytime-valid, so looking longer costs no error level); 0: pause at the "
                    "deadline.")

    @model_validator(mode="after")
    def _one_size(self) -> StepSpec:
        if (self.nodes is None) == (self.percent is None):
            raise ValueError("a step needs exactly one of 'nodes' (count per stratum) or 'percent'")
        if self.deadline_seconds < self.bake_seconds:
            raise ValueError(
                f"deadline_seconds {self.deadline_seconds} is shorter than bake_seconds {self.bake_seconds}"
            )
        return self

    @property
    def extended_deadline_seconds(self) -> float:
        """The latest a stratum holding on running tests may go on before it pauses."""
        return self.deadline_seconds * (1.0 + self.deadline_extension)

    def target(self, eligible: int) -> int:
        """How many canaries this step asks for in a stratum of ``eligible`` nodes (before any clamp)."""
        if eligible <= 0:
            return 0
        if self.nodes is not None:
            return min(self.nodes, eligible)
        return min(eligible, max(1, math.ceil(eligible * (self.percent or 0) / 100.0 - 1e-9)))

    def describe(self) -> str:
        return f"{self.nodes} node(s)" if self.nodes is not None else f"{self.percent:g}%"


def _default_steps() -> list[StepSpec]:
    return [StepSpec(nodes=1), StepSpec(percent=10), StepSpec(percent=50), StepSpec(percent=100)]


class PlanSpec(BaseModel):
    """How a rollout widens and how it is judged."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # Infinity is not JSON: refused

    steps: list[StepSpec] = Field(default_factory=_default_steps, min_length=1, max_length=20)
    latency_margin: float = Field(0.02, ge=0, lt=1, description="Allowed slowdown, 0.02 = 2%.")
    alpha: float = Field(0.05, gt=0, lt=1, description="Error level of the latency confidence sequence.")
    max_fleet_share: float = Field(0.5, gt=0, le=1)
    max_label_share: float = Field(0.5, gt=0, le=1)
    blast_radius_labels: list[str] = Field(default_factory=lambda: ["cluster", "rack"], max_length=16)
    hold_verdict_seconds: float = Field(
        60.0, ge=0, description="A repeated hold is recorded as a verdict at most this often."
    )
    memory_margin: float = Field(
        DEFAULT_MEMORY_MARGIN, ge=0, le=100,
        description="Allowed peak-memory growth over stable per (op, size), 0.10 = 10%.")
    launch_gate: LaunchGate = Field(
        "rollback", description="More Triton launches per call than stable at any size: roll back, or warn.")
    e2e_margin: float = Field(0.03, gt=0, lt=1, description="Allowed end-to-end decoder-block slowdown (mean).")
    p99_margin: float = Field(
        0.10, gt=0, le=10, description="Allowed p99 latency growth per cell, aggregate and end to end (the mean's "
                                      "margin when that is wider); 0.10 = 10%.")
    e2e_required: bool = Field(
        False, description="Hold until end-to-end samples arrive even when no report carried one yet.")
    trial_rounds: int = Field(5, ge=1, le=1000)
    trial_interval_seconds: float = Field(30.0, ge=0)
    cpu_max_batch: int = Field(8, ge=1, description="CPU (interpreter) nodes trial batch sizes up to this.")
    cpu_max_prefill: int = Field(128, ge=1, description="CPU nodes trial prefill sizes up to this.")
    serve_before_trial: bool = Field(
        False, description="Serve the candidate on a canary at once, before its pre-serve trial passed there "
                           "(for kernels whose only risk is speed). Default: trial before serve.")

    @property
    def margin_log(self) -> float:
        """The margin as a log-ratio (what the judge compares against)."""
        return math.log1p(self.latency_margin)

    @property
    def e2e_margin_log(self) -> float:
        return math.log1p(self.e2e_margin)


def load_plan(doc: dict[str, Any] | None) -> PlanSpec:
    """Parse a stored or submitted plan; a bad plan raises Invalid naming the field."""
    try:
        return PlanSpec.model_validate(doc or {})
    except ValidationError as exc:
        errs = "; ".join(
            f"{'.'.join(str(x) for x in e['loc']) or 'plan'}: {e['msg']}" for e in exc.errors()[:5]
        )
        raise Invalid(f"invalid rollout plan: {errs}") from None
