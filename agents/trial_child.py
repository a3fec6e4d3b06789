"""The trial child as a process: it dies with the agent, caps its address space on CPU, and sorts an exception
raised by candidate code into a trial outcome (``oom``, ``compile_error``, ``crash``).

Used by :mod:`agents.trial_worker`; imports only the standard library (torch and Triton when classifying).
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import sys
import traceback
from contextlib import suppress


class TrialFailure(Exception):
    """Ends the trial with ``outcome`` (raised by the phases)."""

    def __init__(self, outcome: str, detail: str) -> None:
        super().__init__(detail)
        self.outcome = outcome
        self.detail = detail


def die_with_parent(agent_pid: int | None) -> None:
    """Ask the kernel to SIGKILL this process when its parent (the agent's fork server, which exits with the
    agent: :mod:`agents.trial_spawn`) dies (no libc: nothing armed); exit 3 if the agent is already gone."""
    with suppress(OSError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    if agent_pid is not None:
        try:
            os.kill(agent_pid, 0)
        except ProcessLookupError:
            sys.exit(3)  # the agent died before we could arm the death signal
        except PermissionError:
            pass  # alive, another user's


def _vm_size_bytes() -> int:
    """This process's address-space size from /proc (0 where it cannot be read)."""
    with suppress(OSError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def limit_memory(budget: int | None) -> None:
    if not budget:
        return
    limit = _vm_size_bytes() + budget
    _soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def classify(exc: BaseException) -> tuple[str, str]:
    """Map an exception raised by candidate code to (outcome, detail)."""
    import torch

    name = type(exc).__name__
    msg = str(exc)
    first = msg.strip().splitlines()[0][:400] if msg.strip() else ""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-4))[-2500:]
    text = f"{name}: {first}\n{tb}"
    low = msg.lower()
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)) or "can't allocate memory" in low or (
        "out of memory" in low and "cuda error: an illegal" not in low
    ):
        return "oom", text
    try:
        from triton.compiler.errors import CompilationError
        from triton.runtime.errors import OutOfResources
    except ImportError:  # pragma: no cover
        CompilationError = OutOfResources = ()  # type: ignore[assignment,misc]
    if isinstance(exc, (CompilationError, OutOfResources)) or "CompilationError" in name:
        return "compile_error", text
    return "crash", text
