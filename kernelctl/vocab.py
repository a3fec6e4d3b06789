"""The domain vocabulary, one home for each word the packages share: rollout and stratum states, canary
phases, trial outcomes, dtypes, and the stratum key (its format and its parse).

Pure data and two small functions; imports nothing of the project, so every layer may import it. The
database stores these strings, the wire carries them and the CLI prints them: change one only with a
migration and a wire-contract change.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal, NamedTuple

# ------------------------------------------------------------------------------------------ rollouts
# A rollout: pending -> progressing(step k) -> ... -> promoted; progressing <-> paused;
# pending|progressing|paused -> rolled_back (controller/rollouts.py is the state machine).
PENDING, PROGRESSING, PAUSED, PROMOTED, ROLLED_BACK = "pending", "progressing", "paused", "promoted", "rolled_back"
ROLLOUT_STATES = (PENDING, PROGRESSING, PAUSED, PROMOTED, ROLLED_BACK)
TERMINAL_STATES = (PROMOTED, ROLLED_BACK)
ACTIVE_STATES = (PENDING, PROGRESSING, PAUSED)
# Each stratum of a rollout has its own state, from the same set (the rollout's state summarises them).
STRATUM_STATES = ROLLOUT_STATES
RolloutState = Literal["pending", "progressing", "paused", "promoted", "rolled_back"]

# ------------------------------------------------------------------------------------------ canaries
# Trial before serve: a canary's candidate is staged (trialled, not served), verified (the controller
# accepted its trials), then serving.
STAGED, VERIFIED, SERVING = "staged", "verified", "serving"
CANARY_PHASES = (STAGED, VERIFIED, SERVING)
Phase = Literal["staged", "verified", "serving"]
Role = Literal["stable", "candidate"]

# ------------------------------------------------------------------------------------------ trials
OUTCOMES = ("ok", "numeric_error", "mismatch", "oom", "crash", "hang", "compile_error", "load_error")
Outcome = Literal["ok", "numeric_error", "mismatch", "oom", "crash", "hang", "compile_error", "load_error"]
DTYPES = ("fp16", "bf16", "fp32")
DTypeName = Literal["fp16", "bf16", "fp32"]
# The judge's per-metric decision.
Decision = Literal["regress", "pass", "hold"]


# ------------------------------------------------------------------------------------------ the judge
class MetricDecision(StrEnum):
    """One judged metric's state at a tick (``warn``: recorded, not a rollback; ``fail``: a hard gate)."""

    REGRESS = "regress"
    PASS = "pass"
    HOLD = "hold"
    WARN = "warn"
    FAIL = "fail"


class StepDecision(StrEnum):
    """What the engine does with a stratum at a tick (stored in ``verdicts.decision``)."""

    HOLD = "hold"
    ADVANCE = "advance"
    ROLLBACK = "rollback"
    PAUSE = "pause"


class GateName(StrEnum):
    """The gate that decided (stored in ``verdicts.gate``): hard outcomes first, then the judged gates."""

    NONE = "none"
    NUMERIC = "numeric"
    MISMATCH = "mismatch"
    CRASH = "crash"
    OOM = "oom"
    HANG = "hang"
    COMPILE = "compile"
    LOAD = "load"
    MEMORY = "memory"
    LAUNCHES = "launches"
    LATENCY = "latency"
    E2E = "e2e"
    SAMPLES = "samples"
    DEADLINE = "deadline"


class MetricKind(StrEnum):
    """What a judged metric measures (the explain view groups rows by it)."""

    LATENCY_CELL = "latency_cell"
    LATENCY_AGGREGATE = "latency_aggregate"
    E2E = "e2e"
    MEMORY = "memory"
    LAUNCHES = "launches"
    NUMERIC = "numeric"
    HARD = "hard"


class Statistic(StrEnum):
    """The statistic of a latency metric (issue 25): mean latency (cost, throughput) and p99 (SLOs)."""

    MEAN = "mean"
    P99 = "p99"


# ------------------------------------------------------------------------------------------ strata
class Stratum(NamedTuple):
    """A stratum key's parts: nodes of one arch, driver major and Triton version are judged together."""

    arch: str
    driver_major: str
    triton: str


def stratum_key(arch: str, driver_version: str, triton_version: str) -> str:
    """The stratum of a node: ``"{arch}/drv{driver_major}/triton{triton_version}"``."""
    return f"{arch}/drv{str(driver_version).strip().split('.')[0]}/triton{triton_version}"


def parse_stratum(key: str) -> Stratum:
    """Split a stratum key made by :func:`stratum_key`; ValueError when ``key`` is not of that form."""
    arch, sep1, rest = key.partition("/drv")
    major, sep2, triton = rest.partition("/triton")
    if not (sep1 and sep2 and arch and major and triton):
        raise ValueError(f"stratum {key!r} is not ARCH/drvMAJOR/tritonVERSION (e.g. sm_90/drv550/triton3.6.0)")
    return Stratum(arch, major, triton)
