"""The wire contract between agents and the controller (pydantic v2 models).

No database, GPU or controller imports here: the agent imports only this module to talk to the
controller. Every numeric field is validated (finite, non-negative, bounded) so that NaN, negative or
absurd figures are refused with 422 and the field at fault, before anything is written; the bounds (what a
measurement can physically be, what a database column holds) are the types of :mod:`kernelctl.wire_limits`.
"""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, model_validator

from kernelctl.vocab import DEFAULT_MEMORY_MARGIN, DTypeName, LaunchGate, Outcome, Phase, Role
from kernelctl.wire_columns import ArmColumns, CellColumns, ReportColumns, ResourceColumns, WeightColumns
from kernelctl.wire_limits import (
    INT32_MAX,
    ElementCount,
    LatencySeconds,
    LaunchCount,
    LaunchesPerCall,
    NonNegFinite,
    Shape,
    TrialSeconds,
    finite,
)

API_PREFIX = "/v1"

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$"
BUNDLE_NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,127}$"
VERSION_PATTERN = r"^\d+\.\d+\.\d+(?:-[0-9A-Za-z.-]+)?(?:\+[0-9A-Za-z.-]+)?$"


ErrorValue = Annotated[float, AfterValidator(finite), Field(ge=0, le=1e30)]
MemoryBytes = Annotated[int, Field(ge=0, le=2**50)]
# max_length: the column's (tests/controller/test_redteam.py checks every stored field against its column)
NodeName = Annotated[str, Field(pattern=NAME_PATTERN, max_length=253)]
BundleName = Annotated[str, Field(pattern=BUNDLE_NAME_PATTERN, max_length=128)]
Version = Annotated[str, Field(pattern=VERSION_PATTERN, max_length=64)]
# A database id: a signed 64-bit integer (BIGINT); anything larger is refused at the wire, not by the driver.
RolloutId = Annotated[int, Field(ge=1, le=2**63 - 1)]
EARLIEST = dt.datetime(2000, 1, 1, tzinfo=dt.timezone.utc)
LATEST = dt.datetime(2200, 1, 1, tzinfo=dt.timezone.utc)


def _bounded_time(v: dt.datetime) -> dt.datetime:
    """A measurement time in UTC between 2000 and 2200 (naive means UTC); the datetime limits never reached."""
    try:
        utc = v.replace(tzinfo=dt.timezone.utc) if v.tzinfo is None else v.astimezone(dt.timezone.utc)
    except (OverflowError, ValueError):
        raise ValueError("is outside the range of representable times") from None
    if not EARLIEST <= utc < LATEST:
        raise ValueError(f"must be between {EARLIEST.date()} and {LATEST.date()} (UTC)")
    return utc


MeasuredAt = Annotated[dt.datetime, AfterValidator(_bounded_time)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


# ------------------------------------------------------------------------------------------ inventory
# Every inventory string is checked at the wire (ASCII digits only: "²" is a digit to str.isdigit but not to
# int()); what a node sends is later printed in operators' terminals and parsed by the compatibility matrix.
PRINTABLE = r"^[ -~]*$"  # printable ASCII: no control characters, no escape sequences
DRIVER_PATTERN = r"^([0-9]{1,6}(\.[0-9]{1,6}){0,3}|unknown)$"
CUDA_PATTERN = r"^([0-9]{1,3}(\.[0-9]{1,4}){0,2}|none|unknown|cpu|n/a)$"
# PEP 440-like: 3.6.0, 2.13.0+cpu, 2.5.0a0+git1234abc, 2.13.0.dev20260101+cu128
PY_VERSION_PATTERN = r"^[0-9]{1,4}(\.[0-9]{1,8}){0,3}([.+_-]?[A-Za-z0-9]{1,40}){0,6}$"
LABEL_KEY_PATTERN = r"^[A-Za-z0-9]([A-Za-z0-9._/-]{0,62}[A-Za-z0-9])?$"
MAX_LABELS = 64
MAX_LABEL_VALUE = 128
LabelKey = Annotated[str, StringConstraints(pattern=LABEL_KEY_PATTERN, max_length=64)]
LabelValue = Annotated[str, StringConstraints(pattern=PRINTABLE, max_length=MAX_LABEL_VALUE)]


class Inventory(Strict):
    """What a node is: the inputs of the compatibility matrix (every field bounded and format-checked).

    Labels: at most 64, keys 1-64 characters (letters, digits, ``. _ / -``, alphanumeric at both ends),
    values at most 128 printable ASCII characters.
    """

    gpu_name: str = Field(min_length=1, max_length=128, pattern=PRINTABLE)
    compute_capability: str = Field(max_length=8, pattern=r"^([0-9]{1,2}\.[0-9]{1,2}|cpu)$")
    arch: str = Field(max_length=16, pattern=r"^(sm_[0-9]{2,3}a?|cpu)$")
    driver_version: str = Field(max_length=32, pattern=DRIVER_PATTERN)
    cuda_version: str = Field(max_length=16, pattern=CUDA_PATTERN)
    triton_version: str = Field(max_length=32, pattern=PY_VERSION_PATTERN)
    torch_version: str = Field(max_length=64, pattern=PY_VERSION_PATTERN)
    memory_total_mb: int = Field(ge=0, le=INT32_MAX)  # nodes.memory_total_mb is an INTEGER column
    labels: dict[LabelKey, LabelValue] = Field(default_factory=dict, max_length=MAX_LABELS)


class RegisterRequest(Strict):
    node_name: NodeName
    inventory: Inventory
    # random, generated and kept on disk by the agent before its first attempt: a retry of a registration whose
    # reply was lost gets the same node (controller.enrollment)
    registration_key: str | None = Field(None, min_length=16, max_length=128, pattern=r"^[A-Za-z0-9_-]+$")
    # when the agent sent this attempt, on its own clock (ns since the epoch), new for every attempt: an attempt
    # answered after a later one of the same agent is refused (409) rather than revoking that one's token
    sent_at_ns: int | None = Field(None, ge=0, le=2**63 - 1)


class RegisterResponse(Strict):
    node_name: str
    node_token: str  # node-bound token the agent uses from now on
    heartbeat_seconds: float


class BundleRef(Strict):
    name: BundleName
    version: Version
    digest: str = Field(max_length=64, pattern=r"^[0-9a-f]{64}$")


class HeartbeatRequest(Strict):
    node_name: NodeName
    inventory: Inventory | None = None  # sent when it changed
    staged: list[BundleRef] = Field(default_factory=list, max_length=64)
    # the versions published to kernelpack.runtime, i.e. what serving processes run: a candidate listed here
    # moves the node's phase to "serving" (and opens its activation in the audit history)
    active: list[BundleRef] = Field(default_factory=list, max_length=64)
    trial_running: bool = False
    # push (long-poll watch): the desired-state generation this node last applied (from a HeartbeatResponse)
    # and how long the controller may hold the request until that desired state changes. The reply comes at
    # once when the node's desired state is newer than ``generation`` (or ``wait_seconds`` is 0), otherwise
    # when it changes (a rollback reaches a waiting node in one round trip) or after ``wait_seconds``.
    generation: int | None = Field(None, ge=0, le=2**63 - 1)
    wait_seconds: float = Field(0.0, ge=0, le=600)


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
    # the plan's resource gates, applied by the node to its own trial before it serves the candidate
    memory_margin: float = Field(DEFAULT_MEMORY_MARGIN, ge=0, le=100)
    launch_gate: LaunchGate = "rollback"


class DesiredBundle(Strict):
    """Desired state of one bundle on a node: which version is active, which are staged.

    Trial before serve: while a canary's ``phase`` is ``staged`` the candidate is only staged and trialled
    (``trial``), ``active`` stays the stable version (None when the bundle has no stable version yet: serve
    nothing, the PyTorch fallback); once the controller accepted a hard-gates-passed report from this node
    (``verified``) ``active`` is the candidate, and the node reporting it active makes it ``serving``.
    """

    name: BundleName
    active: BundleRef | None  # the version serving code should use now (None: publish no version of it)
    stable: BundleRef | None  # kept staged so a rollback is a switch, not a download
    role: Role
    trial: TrialSpec | None = None
    phase: Phase | None = None  # the candidate's phase on this node (None for role "stable")


class HeartbeatResponse(Strict):
    node_name: str
    desired: list[DesiredBundle]
    heartbeat_seconds: float
    server_time: dt.datetime
    # generation of this desired state: send it back as HeartbeatRequest.generation to watch for the next one
    generation: int | None = None


# ------------------------------------------------------------------------------------------- reports


class LatencyPair(Strict):
    """One interleaved stable/candidate measurement on the same node and inputs."""

    op: str = Field(max_length=64)
    tokens: int = Field(ge=1, le=10_000_000)
    stable_s: LatencySeconds
    candidate_s: LatencySeconds


NumericKind = Literal["golden", "stable_golden", "fuzz", "production", "edge"]


class NumericCheck(Strict):
    """One numeric check of the candidate: against the float64 reference and against stable (same inputs).

    ``kind``: golden (the candidate's own vectors), stable_golden (the stable version's vectors under the
    stricter of both tolerances), fuzz (small random shapes), production (the shapes the latency phase times,
    whole tensor vs stable, a row sample vs the reference), edge (edge-value inputs: a non-finite output where
    the reference and stable are finite fails). ``nonfinite``: such outputs counted."""

    op: str = Field(max_length=64)
    dtype: DTypeName
    shape: Shape
    max_abs_err: ErrorValue
    max_rel_err: ErrorValue
    within_tolerance: bool
    unwritten: ElementCount = 0
    vs_stable_max_abs: ErrorValue | None = None
    vs_stable_within: bool | None = None
    kind: NumericKind | None = None
    case: str | None = Field(None, max_length=64)  # e.g. the edge-value case ("zero_rows")
    nonfinite: ElementCount = 0


class CellResources(Strict):
    """Peak memory and Triton launches per call of both versions at one (op, tokens) cell, same shape."""

    op: str = Field(max_length=64)
    tokens: int = Field(ge=1, le=10_000_000)
    stable_peak_bytes: MemoryBytes | None = None
    candidate_peak_bytes: MemoryBytes | None = None
    stable_launches: LaunchCount | None = None
    candidate_launches: LaunchCount | None = None


class CellWeight(Strict):
    """How often one (op, tokens) cell runs per serving step on this node (its traffic profile)."""

    op: str = Field(max_length=64)
    tokens: int = Field(ge=1, le=10_000_000)
    weight: NonNegFinite = Field(le=1e9)


class E2EPair(Strict):
    """One interleaved round of the end-to-end decoder block: stable and candidate on the same inputs."""

    stable_s: LatencySeconds
    candidate_s: LatencySeconds


class ArmLatency(Strict):
    """One version's timed calls of one cell (or of the end-to-end block) in one trial (issue 25).

    ``n`` individual calls after a warm-up, interleaved with the other version's; ``mean_s``, ``p50_s`` and
    ``p99_s`` over those calls (quantiles are order statistics); ``windows_s`` the means of fixed consecutive
    windows of calls, in measurement order (what the judge's within-trial checks use)."""

    n: int = Field(ge=1, le=10_000_000)
    mean_s: LatencySeconds
    p50_s: LatencySeconds
    p99_s: LatencySeconds
    windows_s: list[LatencySeconds] = Field(default_factory=list, max_length=1000)

    @model_validator(mode="after")
    def _ordered(self) -> ArmLatency:
        if self.p50_s > self.p99_s:
            raise ValueError(f"p50_s {self.p50_s!r} is above p99_s {self.p99_s!r}")
        return self


class ArmsLatency(Strict):
    """Both versions' :class:`ArmLatency`, measured interleaved on the same node and inputs;
    ``contended_windows``: windows dropped from both arms because both ran slow in them (a busy device)."""

    stable: ArmLatency
    candidate: ArmLatency
    contended_windows: int = Field(0, ge=0, le=1000)


class CellLatency(ArmsLatency):
    """Both versions' timed calls at one (op, tokens) cell."""

    op: str = Field(max_length=64)
    tokens: int = Field(ge=1, le=10_000_000)


def _unique_cells(v: list[CellResources] | list[CellWeight] | list[CellLatency]) -> list:
    seen: set[tuple[str, int]] = set()
    for i, c in enumerate(v):
        if (c.op, c.tokens) in seen:
            raise ValueError(f"item {i}: cell {c.op}@{c.tokens} appears twice")
        seen.add((c.op, c.tokens))
    return v


class TrialReport(Strict):
    """The result of one trial of a candidate on a node (idempotency key: replay counts once)."""

    idempotency_key: str = Field(min_length=8, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$")
    rollout_id: RolloutId
    stratum: str = Field(max_length=96)
    candidate: BundleRef
    stable: BundleRef | None
    outcome: Outcome
    measured_at: MeasuredAt
    duration_s: TrialSeconds = 0.0
    latency: list[LatencyPair] = Field(default_factory=list, max_length=10_000)
    numerics: list[NumericCheck] = Field(default_factory=list, max_length=10_000)
    e2e_stable_s: LatencySeconds | None = None
    e2e_candidate_s: LatencySeconds | None = None
    launches_per_call: LaunchesPerCall = Field(default_factory=dict)
    peak_memory_bytes: MemoryBytes | None = None
    resources: Annotated[list[CellResources], AfterValidator(_unique_cells)] = Field(
        default_factory=list, max_length=10_000)
    weights: Annotated[list[CellWeight], AfterValidator(_unique_cells)] = Field(
        default_factory=list, max_length=10_000)
    e2e_pairs: list[E2EPair] = Field(default_factory=list, max_length=1000)
    # issue 25: per-call distributions (older agents send only ``latency`` pairs and ``e2e_pairs``)
    cells: Annotated[list[CellLatency], AfterValidator(_unique_cells)] = Field(default_factory=list, max_length=10_000)
    e2e: ArmsLatency | None = None
    free_memory_bytes: MemoryBytes | None = None  # the node's free device memory when the trial started
    detail: str = Field("", max_length=8192)  # human-readable: error text, signal, exit code
    # encoding 2 (issue 28): cells, resources and weights as columns (kernelctl.wire_columns); then those lists
    # are empty. The controller reads either; an agent sends columns (and lists to a controller without them).
    columns: ReportColumns | None = None

    @model_validator(mode="after")
    def _one_encoding(self) -> TrialReport:
        if self.columns is not None and (self.cells or self.resources or self.weights):
            raise ValueError("columns: send cells, resources and weights either as lists (encoding 1) or as "
                             "columns (encoding 2), not both")
        return self

    def compact(self) -> TrialReport:
        """This report in encoding 2 (columns; itself when it has no rows to turn)."""
        if self.columns is not None or not (self.cells or self.resources or self.weights):
            return self
        return self.model_copy(update={"cells": [], "resources": [], "weights": [], "columns": ReportColumns(
            cells=_cell_columns(self.cells) if self.cells else None,
            resources=_resource_columns(self.resources) if self.resources else None,
            weights=WeightColumns(op=[w.op for w in self.weights], tokens=[w.tokens for w in self.weights],
                                  weight=[w.weight for w in self.weights]) if self.weights else None)})

    def expanded(self) -> TrialReport:
        """This report in encoding 1 (lists of objects: what a controller without columns reads)."""
        c = self.columns
        if c is None:
            return self
        return self.model_copy(update={
            "columns": None, "cells": _cells(c.cells) if c.cells else [],
            "resources": [CellResources(op=op, tokens=t, stable_peak_bytes=a, candidate_peak_bytes=b,
                                        stable_launches=x, candidate_launches=y)
                          for op, t, a, b, x, y in zip(c.resources.op, c.resources.tokens,
                                                       c.resources.column("stable_peak_bytes"),
                                                       c.resources.column("candidate_peak_bytes"),
                                                       c.resources.column("stable_launches"),
                                                       c.resources.column("candidate_launches"), strict=True)]
            if c.resources else [],
            "weights": [CellWeight(op=op, tokens=t, weight=w)
                        for op, t, w in zip(c.weights.op, c.weights.tokens, c.weights.weight, strict=True)]
            if c.weights else []})


def _arm_columns(arms: list[ArmLatency]) -> ArmColumns:
    windows = [a.windows_s for a in arms]
    return ArmColumns(n=[a.n for a in arms], mean_s=[a.mean_s for a in arms], p50_s=[a.p50_s for a in arms],
                      p99_s=[a.p99_s for a in arms], windows_s=windows if any(windows) else [])


def _cell_columns(cells: list[CellLatency]) -> CellColumns:
    contended = [c.contended_windows for c in cells]
    return CellColumns(op=[c.op for c in cells], tokens=[c.tokens for c in cells],
                       stable=_arm_columns([c.stable for c in cells]),
                       candidate=_arm_columns([c.candidate for c in cells]),
                       contended_windows=contended if any(contended) else [])


def _resource_columns(rows: list[CellResources]) -> ResourceColumns:
    def col(values: list[int | None]) -> list[int | None]:
        return values if any(v is not None for v in values) else []
    return ResourceColumns(op=[r.op for r in rows], tokens=[r.tokens for r in rows],
                           stable_peak_bytes=col([r.stable_peak_bytes for r in rows]),
                           candidate_peak_bytes=col([r.candidate_peak_bytes for r in rows]),
                           stable_launches=col([r.stable_launches for r in rows]),
                           candidate_launches=col([r.candidate_launches for r in rows]))


def _arm(arms: ArmColumns, i: int) -> ArmLatency:
    return ArmLatency(n=arms.n[i], mean_s=arms.mean_s[i], p50_s=arms.p50_s[i], p99_s=arms.p99_s[i],
                      windows_s=arms.windows_s[i] if arms.windows_s else [])


def _cells(c: CellColumns) -> list[CellLatency]:
    return [CellLatency(op=op, tokens=t, stable=_arm(c.stable, i), candidate=_arm(c.candidate, i),
                        contended_windows=c.contended_windows[i] if c.contended_windows else 0)
            for i, (op, t) in enumerate(zip(c.op, c.tokens, strict=True))]


# what an agent sends in one report request at most: the reports' JSON (the envelope adds a few hundred bytes);
# the controller counts the items of a larger body before validating it (controller.intake.parse)
MAX_REPORT_BATCH_BYTES = 1024 * 1024


class ReportBatch(Strict):
    node_name: NodeName
    reports: list[TrialReport] = Field(min_length=1, max_length=1000)


class ReportBatchResponse(Strict):
    accepted: int
    duplicates: int
    # idempotency key -> why it does not count (not a current canary, rollout not live); not stored, not retried
    refused: dict[str, str] = Field(default_factory=dict)


class ErrorBody(Strict):
    detail: str
