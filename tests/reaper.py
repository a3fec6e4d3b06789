"""No test leaves a process behind, even when it is cut short (pytest-timeout, a crash of the code under test).

Tests start real processes (controllers, agents, the demo, PostgreSQL clusters) in sessions of their own, so a
process that dies without stopping its children orphans them. Every pytest process that runs tests becomes a
*child subreaper* (Linux ``PR_SET_CHILD_SUBREAPER``): orphans of its descendants are re-parented to it instead of
to init, and :func:`stop_children` (called when the session ends, after every fixture's finalizer) stops every
child still running, by process group. A test that must stop its processes sooner (the demo) calls
:func:`stop_processes` itself. A pytest plugin (tests/conftest.py loads it).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import pytest

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Make this process the subreaper of its descendants (Linux); False where that is not available."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def children(pid: int | None = None) -> set[int]:
    """Live (not zombie) child processes of ``pid`` (default: this process)."""
    pid = os.getpid() if pid is None else pid
    found: set[int] = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                found.add(int(stat.parent.name))
    return found


def _signal(pid: int, sig: int) -> None:
    """``sig`` to ``pid``'s process group when it leads one of its own (its children go with it), else to it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        pgid = os.getpgid(pid)
        if pgid == pid and pgid != os.getpgrp():
            os.killpg(pgid, sig)
        else:
            os.kill(pid, sig)


def _reap(pids: Iterable[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def stop_processes(pids: Iterable[int], grace: float = 10.0) -> list[int]:
    """SIGTERM each process (its group when it leads one), SIGKILL what is left after ``grace`` seconds; reaps
    those that are this process's children. Returns the pids that were still running."""
    pids = sorted(p for p in set(pids) if _alive(p))
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        _reap(pids)
        if not any(_alive(p) for p in pids):
            break
        time.sleep(0.1)
    for pid in pids:
        if _alive(pid):
            _signal(pid, signal.SIGKILL)
    time.sleep(0.1)
    _reap(pids)
    return pids


def stop_children(grace: float = 10.0, rounds: int = 5) -> list[int]:
    """Stop every child process still running, and the orphans that stopping them re-parents here."""
    stopped: list[int] = []
    for _ in range(rounds):
        left = children()
        if not left:
            break
        stopped += stop_processes(left, grace)
    return stopped


def pytest_sessionstart(session: pytest.Session) -> None:
    if runs_tests(session.config):
        become_subreaper()


@pytest.hookimpl(trylast=True)  # after the conftest's own clean-up (the session's PostgreSQL cluster)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Every fixture has been finalized: whatever still runs was left behind (multiprocessing's own helpers, the
    trials' fork server and its resource tracker, live as long as the test process by design: stopped, not
    reported)."""
    helpers = {p for p in children() if _is_multiprocessing_helper(p)}
    if runs_tests(session.config):
        left = [p for p in stop_children() if p not in helpers]
        if left:
            sys.stderr.write(f"stopped {len(left)} process(es) that tests left running: pids {left}\n")


def _is_multiprocessing_helper(pid: int) -> bool:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"multiprocessing.forkserver" in cmd or b"multiprocessing.resource_tracker" in cmd


def runs_tests(config: pytest.Config) -> bool:
    """This process runs tests: an xdist worker, or a run without workers (``-n 0``)."""
    return hasattr(config, "workerinput") or not config.pluginmanager.has_plugin("dsession")
