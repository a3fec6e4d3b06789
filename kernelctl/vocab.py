"""The domain vocabulary, one home for each word the packages share: rollout and stratum states, canary
phases, trial outcomes, dtypes, and the stratum key (its format and its parse).

Pure data and two small functions; imports nothing of the project, so every layer may import it. The
database stores these strings, the wire carries them and the CLI prints them: change one only with a
migration and a wire-contract change.
"""

from __future__ import annotations

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
# What more Triton launches per call than stable does: roll back (and never serve on the node), or warn only.
LaunchGate = Literal["rollback", "warn"]
# Allowed peak-memory growth over stable per (op, size) when a plan does not say (0.10 = 10%): the plan's
# default, and the node-local gate's when a controller sends no margin with the trial.
DEFAULT_MEMORY_MARGIN = 0.10


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
