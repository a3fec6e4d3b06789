"""Parent side of a trial: run ``agents.trial_worker`` in a child process and turn its result into a report.

The child (forked from a fork server that has imported torch: :mod:`agents.trial_spawn`) gets its own session
(so its whole process group can be killed), a private work directory, the node's environment (``TRITON_INTERPRET=1`` on CPU nodes, ``KERNELCTL_ARCH`` when the arch is overridden) and
a wall-clock limit. The parent reads the child's RESULT file, not only its exit status: a result gives the
outcome; no result plus a signal or non-zero exit is ``crash`` (signal / exit code / stderr tail in
``detail``); a child past its limit is killed and reported as ``hang``. An abort request (agent shutdown,
candidate withdrawn) kills the child group and raises :class:`TrialAborted`.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
import secrets
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from agents.inventory import NodeInventory, child_env
from agents.trial_protocol import GPU_TIMING_LOCK_S, TrafficProfile, WorkerResult, WorkerSpec
from agents.trial_spawn import TrialChild
from kernelctl.wire import (
    ArmsLatency,
    CellLatency,
    CellResources,
    CellWeight,
    E2EPair,
    LatencyPair,
    NumericCheck,
    TrialReport,
    TrialSpec,
)

log = logging.getLogger("kernelctl.agent.trial")

DEFAULT_CPU_MEMORY_BUDGET = 2 * 1024**3


class TrialAborted(Exception):
    """The trial was stopped before it finished (shutdown or the candidate was withdrawn); no report."""


@dataclass
class TrialConfig:
    node: NodeInventory
    trusted_keys_dir: Path
    loader_cache_dir: Path
    work_root: Path
    timeout_s: float = 600.0
    profile: TrafficProfile | None = None
    extra_env: dict[str, str] = field(default_factory=dict)


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def kill_group(pid: int) -> None:
    """SIGKILL the process group led by ``pid`` (the child runs in its own session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _tail(path: Path, n: int = 2000) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-n:].decode("utf-8", "replace").strip()


def worker_spec(
    spec: TrialSpec, cfg: TrialConfig, candidate_path: Path, stable_path: Path | None, workdir: Path
) -> WorkerSpec:
    """The child's instructions: the controller's TrialSpec, overridden by the local traffic profile."""
    p = cfg.profile or TrafficProfile()
    node = cfg.node
    cpu = not node.has_gpu
    budget = (p.memory_limit_mb * 1024 * 1024) if p.memory_limit_mb else DEFAULT_CPU_MEMORY_BUDGET
    return WorkerSpec(
        candidate_path=str(candidate_path),
        candidate_digest=spec.candidate.digest,
        stable_path=str(stable_path) if stable_path else None,
        stable_digest=spec.stable.digest if spec.stable and stable_path else None,
        trusted_keys_dir=str(cfg.trusted_keys_dir),
        loader_cache_dir=str(cfg.loader_cache_dir),
        device=node.device,  # type: ignore[arg-type]
        arch=None if node.arch == "cpu" else node.arch,
        batch_sizes=p.batch_sizes if p.batch_sizes is not None else list(spec.batch_sizes),
        prefill_tokens=p.prefill_tokens if p.prefill_tokens is not None else list(spec.prefill_tokens),
        rounds=p.rounds or spec.rounds,
        seed=secrets.randbits(31),  # fresh random inputs and fuzz shapes on every trial
        fuzz_shapes=p.fuzz_shapes if p.fuzz_shapes is not None else (2 if cpu else 4),
        dtypes=p.dtypes,
        latency_dtype=p.latency_dtype,
        # the decoder block end to end: by default on GPUs only (under the interpreter its time is Python)
        e2e=(not cpu) if p.e2e is None else p.e2e,
        model=p.model,
        memory_limit_bytes=budget if cpu else None,
        numerics_max_tokens=p.numerics_max_tokens or 2048,
        numerics_memo=p.numerics_memo,
        timing_lock_s=p.timing_lock_s if p.timing_lock_s is not None else (0.0 if cpu else GPU_TIMING_LOCK_S),
        e2e_rounds=p.e2e_rounds,
        agent_pid=os.getpid(),
        progress_path=str(workdir / "progress.json"),
    )


def cell_weights(result: WorkerResult, profile: TrafficProfile | None) -> list[CellWeight]:
    """How often each measured (op, tokens) cell runs per serving step, from the node's traffic profile:
    ``op_calls_per_step[op]`` (default 1) times ``batch_share[tokens]`` (default 1: sizes equally often)."""
    p = profile or TrafficProfile()
    calls, share = p.op_calls_per_step or {}, p.batch_share or {}
    cells = sorted({(c["op"], int(c["tokens"])) for c in [*result.latency, *result.cells]})
    return [CellWeight(op=op, tokens=t, weight=float(calls.get(op, 1.0)) * float(share.get(str(t), 1.0)))
            for op, t in cells]


class TrialRunner:
    """Runs one trial at a time; :meth:`abort` kills a running child from another thread."""

    def __init__(self, cfg: TrialConfig) -> None:
        self.cfg = cfg
        self._proc: TrialChild | None = None
        self._abort = threading.Event()
        self._lock = threading.Lock()

    @property
    def running(self) -> bool:
        return self._proc is not None

    def reset(self) -> None:
        """Clear an earlier abort request (call before starting the next trial)."""
        self._abort.clear()

    def abort(self) -> None:
        self._abort.set()
        with self._lock:
            if self._proc is not None:
                kill_group(self._proc.pid)

    def run(
        self,
        spec: TrialSpec,
        *,
        idempotency_key: str,
        candidate_path: Path,
        stable_path: Path | None,
        on_start: Callable[[int], None] | None = None,
    ) -> TrialReport:
        """Run the trial in a child; return its report (raises TrialAborted when aborted, also when
        :meth:`abort` was called before this run started and :meth:`reset` was not called since)."""
        self.cfg.work_root.mkdir(parents=True, exist_ok=True)
        workdir = Path(tempfile.mkdtemp(prefix="trial-", dir=self.cfg.work_root))
        started = time.monotonic()
        measured_at = dt.datetime.now(dt.timezone.utc)
        try:
            wspec = worker_spec(spec, self.cfg, candidate_path, stable_path, workdir)
            (workdir / "spec.json").write_text(wspec.model_dump_json())
            result_path, log_path = workdir / "result.json", workdir / "child.log"
            env = child_env(self.cfg.node)
            env.update(self.cfg.extra_env)
            with self._lock:
                if self._abort.is_set():
                    raise TrialAborted("aborted before start")
                self._proc = TrialChild([str(workdir / "spec.json"), str(result_path)], env, workdir, log_path)
            proc = self._proc
            if on_start is not None:
                on_start(proc.pid)
            rc = proc.wait(self.cfg.timeout_s)
            timed_out = rc is None
            if timed_out:
                kill_group(proc.pid)
                rc = proc.wait()
            kill_group(proc.pid)  # anything the child left behind in its group
            with self._lock:
                self._proc = None
            if self._abort.is_set():
                raise TrialAborted("trial aborted")
            duration = time.monotonic() - started
            assert rc is not None  # waited without a timeout
            return self._report(spec, idempotency_key, measured_at, duration, rc, timed_out,
                                result_path, log_path, workdir / "progress.json")
        finally:
            with self._lock:
                self._proc = None
            shutil.rmtree(workdir, ignore_errors=True)

    def _report(
        self, spec: TrialSpec, key: str, measured_at: dt.datetime, duration: float, rc: int, timed_out: bool,
        result_path: Path, log_path: Path, progress_path: Path,
    ) -> TrialReport:
        base = {
            "idempotency_key": key, "rollout_id": spec.rollout_id, "stratum": spec.stratum,
            "candidate": spec.candidate, "stable": spec.stable, "measured_at": measured_at,
            "duration_s": round(duration, 3),
        }
        phase = ""
        with contextlib.suppress(OSError, ValueError):
            phase = json.loads(progress_path.read_text()).get("phase", "")
        if timed_out:
            return TrialReport(**base, outcome="hang", detail=(
                f"trial child still running after {self.cfg.timeout_s:.0f}s (phase {phase or 'unknown'}); "
                f"killed\n{_tail(log_path, 1500)}")[:8192])
        result: WorkerResult | None = None
        if result_path.exists():
            try:
                result = WorkerResult.model_validate_json(result_path.read_bytes())
            except (ValidationError, ValueError) as exc:
                return TrialReport(**base, outcome="crash", detail=f"trial child wrote an unreadable result: {exc}"[:8192])
        if result is None:
            if rc < 0:
                how = f"trial child killed by {_signal_name(-rc)} (exit status {rc})"
                if -rc == signal.SIGKILL:
                    how += " (possibly the kernel OOM killer)"
            else:
                how = f"trial child exited with code {rc} without a result"
            detail = f"{how} in phase {phase or 'unknown'}\n{_tail(log_path, 3000)}"
            return TrialReport(**base, outcome="crash", detail=detail[:8192])
        try:
            return TrialReport(
                **base,
                outcome=result.outcome,
                latency=[LatencyPair(**p) for p in result.latency],
                numerics=[NumericCheck(**c) for c in result.numerics],
                e2e_stable_s=result.e2e_stable_s,
                e2e_candidate_s=result.e2e_candidate_s,
                launches_per_call=result.launches_per_call,
                peak_memory_bytes=result.peak_memory_bytes,
                resources=[CellResources(**r) for r in result.resources],
                weights=cell_weights(result, self.cfg.profile),
                e2e_pairs=[E2EPair(**p) for p in result.e2e_pairs],
                cells=[CellLatency.model_validate(c) for c in result.cells],
                e2e=None if result.e2e is None else ArmsLatency.model_validate(result.e2e),
                free_memory_bytes=result.free_memory_bytes,
                detail=result.detail[:8192],
            )
        except ValidationError as exc:
            log.error("trial result does not fit the wire format: %s", exc)
            return TrialReport(**base, outcome="crash",
                               detail=f"trial produced measurements the wire refuses: {exc}"[:8192])
