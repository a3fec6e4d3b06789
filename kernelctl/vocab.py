"""The domain vocabulary, one home for each word the packages share: rollout and stratum states, canary
phases, trial outcomes, dtypes, and the stratum key (its format and its parse).

Pure data and two small functions; imports nothing of the project, so every layer may import it. The
database stores these strings, the wire carries them and the CLI prints them: change one only with a
migration and a wire-contract change.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal, NamedTuple

# ------------------------------------------------------------------------------------------ rollouts
# A rollout: pending -> progressing(step k) -> ... -> promoted; progressing <-> paused;
# pending|progressing|paused -> rolled_back; a rollout whose strata ended differently (some promoted, some
# rolled back) ends partly_promoted (controller/rollouts.py is the state machine).
PENDING, PROGRESSING, PAUSED, PROMOTED, ROLLED_BACK = "pending", "progressing", "paused", "promoted", "rolled_back"
PARTLY_PROMOTED = "partly_promoted"  # 15 characters: fits the rollouts.state column (String(16))
ROLLOUT_STATES = (PENDING, PROGRESSING, PAUSED, PROMOTED, PARTLY_PROMOTED, ROLLED_BACK)
TERMINAL_STATES = (PROMOTED, PARTLY_PROMOTED, ROLLED_BACK)
ACTIVE_STATES = (PENDING, PROGRESSING, PAUSED)
# Each stratum of a rollout has its own state (the rollout's state summarises them); a stratum ends promoted
# or rolled back, never partly.
STRATUM_STATES = (PENDING, PROGRESSING, PAUSED, PROMOTED, ROLLED_BACK)
RolloutState = Literal["pending", "progressing", "paused", "promoted", "partly_promoted", "rolled_back"]


def step_number(step_index: int) -> int:
    """The step as people and JSON documents number it: from 1 (``step 1 of 4``).

    One convention: every field or text called *step* is this number; only fields called ``step_index`` (the
    database, the REST API's ``step_index``/``from_step``/``promote_from_step``) hold the 0-based position.
    """
    return step_index + 1


def shown_steps(doc: dict[str, Any] | None) -> dict[str, Any]:
    """A stored document (a changelog event's payload, a verdict's evidence: both keep the 0-based index as
    ``step``, the database is not rewritten) as it is shown: ``step`` from 1."""
    doc = doc or {}
    return {**doc, "step": step_number(doc["step"])} if isinstance(doc.get("step"), int) else doc

# ------------------------------------------------------------------------------------------ nodes
NODE_STATES = ("active", "stale")  # a node without a heartbeat for stale_after_seconds is stale
NodeState = Literal["active", "stale"]

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
# What more Triton launches per call than stable does: roll back (and never serve on the node), or warn only.
LaunchGate = Literal["rollback", "warn"]
# Allowed peak-memory growth over stable per (op, size) when a plan does not say (0.10 = 10%): the plan's
# default, and the node-local gate's when a controller sends no margin with the trial.
DEFAULT_MEMORY_MARGIN = 0.10


class FullHeartbeat(StrEnum):
    """Why a heartbeat took the full transaction rather than the replica's snapshot (counted per reason in
    ``kernelctl_heartbeat_full_total``)."""

    UNKNOWN_NODE = "unknown_node"  # not in this replica's snapshot (registered since its last load)
    BEHIND = "behind"  # the node holds a generation newer than this replica's snapshot
    NOT_ACTIVE = "not_active"  # stale, drained or retired: the transaction brings it back or refuses it
    INVENTORY = "inventory"  # the agent sent its inventory (first heartbeat, restart, a change)
    NEEDS_SYNC = "needs_sync"  # a stored row the snapshot cannot write (an old ``staged`` shape)
    UNKNOWN_VERSION = "unknown_version"  # an active version this snapshot does not know
    NO_ROW = "no_row"  # a bundle the node reports but has no assignment row for
    SWITCH_FULL = "switch_full"  # a version switch the group commit handed back to the transaction


class NumericsMemoMode(StrEnum):
    """How a node avoids repeating a (candidate, stable) pair's deterministic numeric checks
    (``agents.trial_memo``): ``skip`` golden, edge and production checks once passed (the CPU interpreter's
    default: same inputs, same bits); ``fingerprint`` re-runs the candidate at each production shape and skips
    that shape's check only while its output bits equal the checked run's (the GPU default: a racy kernel may
    pass once); ``off`` checks everything every trial."""

    SKIP = "skip"
    FINGERPRINT = "fingerprint"
    OFF = "off"


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
