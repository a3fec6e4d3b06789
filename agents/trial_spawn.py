"""Start trial children from a fork server that has imported torch once, rather than a fresh interpreter each.

A fresh interpreter per trial spent ~3 CPU-s importing torch before the trial did anything (the trial's
``import`` phase: 3.2-4.7 s on the GPU nodes of docs/gpu.md); multiprocessing's fork server imports it once
per agent process and forks every trial child from there. The child is still a process of its own: in its own
session (the parent kills its whole group), with the trial's environment, working directory and log, and named
``kernelctl-trial`` (``/proc/PID/comm``) so that an agent restarted after a crash recognises a child its
predecessor left (:func:`is_trial_child`). It dies with the agent: the child's death signal is armed against
the fork server, which exits as soon as the agent does.

Preloaded: torch and the agent's main module (below). Triton decides when it is imported whether its own
library functions are interpreted (``TRITON_INTERPRET``), so Triton and everything that defines kernels are
imported in the child, after its environment is in place. Importing torch does not initialise CUDA, so a forked child can use the GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import sys
import warnings
from pathlib import Path

NAME = "kernelctl-trial"
"""The trial child's process name (``/proc/PID/comm``, at most 15 characters)."""

_PR_SET_NAME = 15
# multiprocessing prepares a forked child as the parent's: it runs the parent's main module again (as
# ``__mp_main__``, e.g. ``cli.app`` for ``python -m cli.app agent``: ~0.6 CPU-s of imports). Imported once in the
# server, that costs each child nothing; runpy's note that the module is already imported is expected there.
warnings.filterwarnings("ignore", message=r".*found in sys.modules after import of package", category=RuntimeWarning)


def _preload() -> list[str]:
    """What the fork server imports: this module (its warning filter), the agent's main module, torch."""
    spec = sys.modules["__main__"].__spec__  # None when run as a script or with -c
    by_name = [spec.name] if spec is not None and not spec.name.endswith("__main__") else []
    return [__name__, "__main__", *by_name, "torch"]


_CTX = multiprocessing.get_context("forkserver")
_CTX.set_forkserver_preload(_preload())


class TrialChild:
    """A running trial child: ``agents.trial_worker.main(argv)`` in a process forked from the fork server."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path, log_path: Path) -> None:
        self._proc = _CTX.Process(target=_child, args=(argv, dict(env), str(cwd), str(log_path)), name=NAME)
        self._proc.start()

    @property
    def pid(self) -> int:
        assert self._proc.pid is not None  # started in __init__
        return self._proc.pid

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit status (negative: killed by that signal), or None if still running after ``timeout`` s."""
        self._proc.join(timeout)
        return self._proc.exitcode


def is_trial_child(pid: int, work_root: Path) -> bool:
    """Whether ``pid`` is a live trial child working under ``work_root`` (an agent's trial directories; a zombie
    has no working directory)."""
    try:
        return (Path(f"/proc/{pid}/comm").read_text().strip() == NAME
                and os.readlink(f"/proc/{pid}/cwd").startswith(str(work_root)))
    except OSError:
        return False


def _child(argv: list[str], env: dict[str, str], cwd: str, log_path: str) -> None:
    """In the forked child: own session, name, output, directory and environment; then the trial worker."""
    os.setsid()
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_NAME, NAME.encode(), 0, 0, 0)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    from agents.trial_worker import main

    sys.exit(main(argv))
