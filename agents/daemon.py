"""The agent's main loop: register, heartbeat, apply the desired state, run trials, flush the outbox.

A watch thread keeps one heartbeat open at a time: it sends the generation of the desired state it applied
and the controller holds the request until that changes (a rollback arrives in one round trip) or for
``heartbeat_seconds``; it switches the published active version atomically among the staged versions (a
rollback is a switch to the staged stable, at once) and hands what it lacks to ``agents.downloader`` (its
own thread, never under the agent's lock; heartbeats go on meanwhile): what serves keeps serving until the
version is staged, then the desired state is applied again and reported at once (``tick(report=True)``).
The main thread blocks in ``Event.wait`` (no busy loop) and flushes the outbox and starts trials when a
trial ends or every ``heartbeat_seconds``. Trial before serve: the controller names a canary's candidate as
the active version only after it accepted this node's hard-gates-passed trial report; that bumps the
generation, so the watch returns with the switch; after every switch the next heartbeat goes at once (the
controller learns what serves). The node's own verdict on each trial (``agents.serve_gate``: memory over
stable's margin or past the free memory, more launches than stable) is recorded before its report is sent; a
candidate it refused is never served, whatever the controller names. What the controller does not name is
unpublished (withdrawn: serving falls back to the PyTorch reference). Overload (429/503 with ``Retry-After``) is retried with backoff and jitter;
reports stay in the outbox meanwhile. Trials run one at a time in a helper thread that owns the trial child; the duty cycle and
the memory headroom are checked before a trial starts. SIGTERM (``request_stop``) kills a running trial's
process group, keeps the outbox and ends the loop; a restarted agent resumes from its cache dir (node token,
outbox, staged bundles, last trial).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from agents.cache import BundleCache, BundleRefused
from agents.client import ControllerClient, ControllerError
from agents.downloader import Downloader, Wanted
from agents.inventory import NodeInventory, collect_inventory, memory_free_fraction
from agents.metrics import AgentMetrics
from agents.outbox import Outbox, new_idempotency_key
from agents.registration import register
from agents.serve_gate import ServeVerdict, annotate, judge_trial
from agents.trial import TrialAborted, TrialConfig, TrialRunner
from agents.trial_protocol import TrafficProfile
from agents.trial_spawn import is_trial_child
from kernelctl.wire import (
    BundleRef,
    DesiredBundle,
    HeartbeatRequest,
    ReportBatchResponse,
    TrialReport,
    TrialSpec,
)

log = logging.getLogger("kernelctl.agent")

REFUSAL_RETRY_S = 300.0  # a refused download is tried again after this long (a fixed upload gets through)
# while the controller is unreachable, trials of the last desired state go on for this long (then stop: a
# rollback may have happened meanwhile)
DESIRED_STATE_TTL_S = 600.0


@dataclass
class AgentConfig:
    controller_url: str
    token: str
    node_name: str
    cache_dir: Path
    runtime_dir: Path
    trusted_keys_dir: Path
    profile: TrafficProfile | None = None
    inventory_overrides: Path | None = None
    metrics_port: int = 0
    metrics_addr: str = "0.0.0.0"
    duty_cycle: float = 0.1
    memory_headroom: float = 0.2
    trial_timeout_s: float = 600.0
    max_bundle_bytes: int = 64 * 1024 * 1024
    heartbeat_seconds: float = 5.0  # until the controller says otherwise
    http_timeout_s: float = 10.0
    download_jitter_s: float = 2.0  # a download starts after a random delay up to this long
    download_backoff_s: float = 1.0  # a failed download is tried again after about this long, doubling
    trial_env: dict[str, str] = field(default_factory=dict)

    @property
    def trials_dir(self) -> Path:
        """Where the trial children work (a directory each)."""
        return self.cache_dir / "trials"


@dataclass
class _RunningTrial:
    spec: TrialSpec
    thread: threading.Thread


class Agent:
    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        self.stop_event = threading.Event()
        self._wake = threading.Event()
        self.metrics = AgentMetrics()
        self.node: NodeInventory | None = None
        self.outbox: Outbox | None = None
        self.cache: BundleCache | None = None
        self.client: ControllerClient | None = None
        self.runner: TrialRunner | None = None
        self.downloader: Downloader | None = None
        self._missing: list[Wanted] = []  # what the _apply in progress lacks (handed to the downloader)
        self.heartbeat_seconds = cfg.heartbeat_seconds
        self.desired: list[DesiredBundle] = []
        self.active: dict[str, BundleRef] = {}
        self.stable: dict[str, BundleRef] = {}
        self.refused: dict[str, tuple[float, str]] = {}  # digest -> (when, reason)
        self._trial: _RunningTrial | None = None
        self._lock = threading.Lock()
        self._flushing = threading.Lock()  # one outbox flush at a time (the main loop's, and shutdown's)
        self.metrics_port: int | None = None
        self._last_heartbeat_ok = -1e18
        self.generation: int | None = None  # of the last desired state applied (the watch sends it back)
        self._report_now = False
        self.verdicts: dict[str, ServeVerdict] = {}  # candidate digest -> this node's own serve verdict
        self._refusals_logged: set[str] = set()
        self._verdict_changed = False

    # ------------------------------------------------------------------------------------ control
    def request_stop(self, *_: object) -> None:
        """Ask the agent to stop (signal-safe): ends a running trial, keeps the outbox."""
        self.stop_event.set()
        self._wake.set()
        if self.runner is not None:
            self.runner.abort()

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)

    # ---------------------------------------------------------------------------------------- run
    def setup(self) -> None:
        cfg = self.cfg
        self.node = collect_inventory(cfg.inventory_overrides)
        cfg.cache_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(cfg.cache_dir, 0o700)
        self.outbox = Outbox(cfg.cache_dir / "outbox.db")
        self.cache = BundleCache(cfg.cache_dir, cfg.trusted_keys_dir)
        self._reap_stale_child()
        self.active = {k: BundleRef(**v) for k, v in (self.outbox.get_state("active") or {}).items()}
        self.stable = {k: BundleRef(**v) for k, v in (self.outbox.get_state("stable") or {}).items()}
        self.verdicts = {k: ServeVerdict.from_state(v)
                         for k, v in (self.outbox.get_state("serve_verdicts") or {}).items()}
        self.runner = TrialRunner(TrialConfig(
            node=self.node, trusted_keys_dir=cfg.trusted_keys_dir, loader_cache_dir=self.cache.loader_dir,
            work_root=cfg.trials_dir, timeout_s=cfg.trial_timeout_s, profile=cfg.profile,
            extra_env=dict(cfg.trial_env),
        ))
        self.metrics.outbox_depth.set(self.outbox.depth())
        self.metrics_port = self.metrics.serve(cfg.metrics_port, cfg.metrics_addr)
        self.downloader = Downloader(self._download, self._on_staged, self._on_refused, self.stop_event,
                                     jitter_s=cfg.download_jitter_s, backoff_initial_s=cfg.download_backoff_s,
                                     backoff_max_s=max(4 * cfg.heartbeat_seconds, 30.0))

    def _reap_stale_child(self) -> None:
        """Kill a trial child left by a previous agent process that died (SIGKILL) mid-trial."""
        assert self.outbox is not None
        st = self.outbox.get_state("trial_child")
        if st and isinstance(st.get("pid"), int) and is_trial_child(st["pid"], self.cfg.trials_dir):
            log.warning("killing trial child %d left by a previous agent run", st["pid"])
            with contextlib.suppress(OSError):
                os.killpg(st["pid"], signal.SIGKILL)
        if st:
            log.info("the previous agent run was interrupted mid-trial (rollout %s); it will be run again",
                     st.get("rollout_id"))
        self.outbox.set_state("trial_child", None)

    def run(self) -> int:
        """Run until stopped; returns the process exit code (0 on a requested stop).

        The watch thread holds one heartbeat open at a time (the controller answers when the desired state
        changes, or after ``heartbeat_seconds``) and applies each reply; this thread flushes the outbox and
        starts trials when woken (a trial finished) or every ``heartbeat_seconds``.
        """
        try:
            self.setup()
            self._register()
            assert self.downloader is not None
            self.downloader.start()
            watcher = threading.Thread(target=self._watch_loop, name="watch", daemon=True)
            watcher.start()
            while not self.stop_event.is_set():
                self._wake.wait(self.heartbeat_seconds)
                self._wake.clear()
                if self.stop_event.is_set() or self.client is None:
                    continue
                self._flush()  # off the heartbeat path: a slow report never delays applying a reply
                with self._lock:
                    if self._verdict_changed:  # a trial refused what serves (or cleared it): switch now
                        self._verdict_changed = False
                        self._report_now = self._apply(self.desired) or self._report_now
                    if time.monotonic() - self._last_heartbeat_ok < DESIRED_STATE_TTL_S:
                        self._maybe_trial()
            return 0
        finally:
            self.shutdown()

    def _watch_loop(self) -> None:
        """Heartbeat after heartbeat; after a failure wait about one period (with jitter) before the next."""
        while not self.stop_event.is_set():
            try:
                ok = self.tick()
            except Exception:  # never let the watch thread die: the controller or the network misbehaved
                log.exception("heartbeat round failed")
                ok = False
            if not ok:
                self.stop_event.wait(self.heartbeat_seconds * (0.5 + random.random()))

    def shutdown(self) -> None:
        self.stop_event.set()
        if self.runner is not None:
            self.runner.abort()
        t = self._trial
        if t is not None:
            t.thread.join(timeout=30)
        if self.downloader is not None:
            self.downloader.stop()
            self.downloader.join(timeout=1.0)  # a download in flight ends with the client (a daemon thread)
        if self.client is not None:
            self.client.close()
        self.metrics.close()
        if self.outbox is not None:
            self.outbox.close()
            self.outbox = None

    # ------------------------------------------------------------------------------- registration
    def _register(self) -> None:
        """Register until it succeeds or the agent stops (:func:`agents.registration.register`)."""
        assert self.node is not None
        done = register(self.cfg, self.node, self.stop_event)
        if done is not None:
            self.client, self.heartbeat_seconds, self.node = done.client, done.heartbeat_seconds, done.node

    # --------------------------------------------------------------------------------------- tick
    def tick(self, *, report: bool = False) -> bool:
        """One heartbeat round: heartbeat (a watch once the controller gave a generation), apply the desired
        state, maybe start a trial. Returns whether the controller answered.

        ``report=True``: the downloader's report of a version it staged, sent at once beside the watch in flight,
        as a watch (written on arrival; the controller never writes a held watch's body again, so the older
        watch does not undo it); its reply is applied unless a newer one was; a failure is the watch's business."""
        client = self.client
        if client is None:  # registering again (a 401 of the watch)
            return False
        try:
            reply = client.heartbeat(self._heartbeat_request(consume=not report))
        except ControllerError as exc:
            if self.stop_event.is_set():
                return False
            self.metrics.heartbeat_failures.inc()
            log.warning("heartbeat failed: %s", exc)
            if report:
                return False
            with self._lock:
                if exc.status == 401 and not self.stop_event.is_set() and self.client is client:
                    client.close()
                    self.client = None
                    self._register()
                if time.monotonic() - self._last_heartbeat_ok < DESIRED_STATE_TTL_S:
                    self._maybe_trial()  # keep measuring what was asked; reports wait in the outbox
            return False
        with self._lock:
            self._last_heartbeat_ok = time.monotonic()
            held = self.generation
            if report and held is not None and reply.generation is not None and reply.generation < held:
                return True  # the watch applied a newer desired state meanwhile
            self.heartbeat_seconds = reply.heartbeat_seconds
            self.generation = reply.generation
            self.desired = list(reply.desired)
            switched = self._apply(self.desired)
            self._report_now = switched or (self._report_now and report)  # the next watch reports a switch
            self._maybe_trial()
        self._wake.set()  # the main loop sends the outbox (never this watch thread)
        return True

    def _awaiting_serve(self) -> bool:
        """A candidate is staged for its pre-serve trial: it is desired, but not (yet) the active version."""
        return any(d.trial is not None and d.active != d.trial.candidate for d in self.desired)

    def _heartbeat_request(self, consume: bool = True) -> HeartbeatRequest:
        staged, seen = [], set()
        assert self.cache is not None
        for d in self.desired:
            for ref in self._refs(d):
                if ref.digest not in seen and self.cache.has(ref):
                    seen.add(ref.digest)
                    staged.append(ref)
        watch = self.generation is not None and not self._report_now
        if consume:
            self._report_now = False
        return HeartbeatRequest(
            node_name=self.cfg.node_name, staged=staged[:64], active=list(self.active.values())[:64],
            trial_running=self._trial is not None, generation=self.generation,
            wait_seconds=self.heartbeat_seconds if watch else 0.0,
        )

    @staticmethod
    def _refs(d: DesiredBundle) -> list[BundleRef]:
        refs = [d.active] if d.active is not None else []
        if d.stable is not None:
            refs.append(d.stable)
        if d.trial is not None:
            refs.append(d.trial.candidate)
            if d.trial.stable is not None:
                refs.append(d.trial.stable)
        return refs

    # ------------------------------------------------------------------------------ desired state
    def _ensure(self, ref: BundleRef, trial: TrialSpec | None) -> bool:
        """Whether ``ref`` is staged; if not (and not refused lately) it is queued for the downloader."""
        assert self.cache is not None
        if self.cache.has(ref):
            return True
        refused = self.refused.get(ref.digest)
        if refused is None or time.monotonic() - refused[0] >= REFUSAL_RETRY_S:
            self._missing.append(Wanted(ref, trial if trial is not None and trial.candidate == ref else None))
        return False

    def _download(self, ref: BundleRef) -> None:
        """Download and verify ``ref`` into the cache (the downloader's thread; no lock: bytes move here)."""
        if (client := self.client) is None or (cache := self.cache) is None:
            raise ControllerError("not registered (yet)")
        cache.install(client.download_bundle(ref, cache.downloads, self.cfg.max_bundle_bytes), ref)

    def _on_staged(self, ref: BundleRef) -> None:
        """``ref`` is staged: apply the desired state again, and report it at once (``tick(report=True)``)."""
        with self._lock:
            self.refused.pop(ref.digest, None)
            if self.stop_event.is_set():
                return
            self._apply(self.desired)
            self._maybe_trial()
        self.tick(report=True)  # failed: the watch after the one in flight reports it

    def _on_refused(self, wanted: Wanted, reason: str) -> None:
        """``wanted`` failed its digest, size cap or signature: refused for ``REFUSAL_RETRY_S`` (a candidate: a
        load error of its trial)."""
        with self._lock:
            ref = wanted.ref
            self.refused[ref.digest] = (time.monotonic(), reason)
            self.metrics.bundles_refused.inc()
            log.error("bundle %s@%s refused: %s", ref.name, ref.version, reason)
            if wanted.trial is not None:
                self._report_load_error(wanted.trial, f"candidate download refused: {reason}")

    def _report_load_error(self, trial: TrialSpec, detail: str) -> None:
        assert self.outbox is not None
        import datetime as dt

        done = self.outbox.get_state("load_error_reported") or []
        mark = f"{trial.rollout_id}:{trial.candidate.digest}"
        if mark in done:
            return
        report = TrialReport(
            idempotency_key=new_idempotency_key(self.cfg.node_name), rollout_id=trial.rollout_id,
            stratum=trial.stratum, candidate=trial.candidate, stable=trial.stable, outcome="load_error",
            measured_at=dt.datetime.now(dt.timezone.utc), detail=detail[:8192],
        )
        self.outbox.add(report)
        self.outbox.set_state("load_error_reported", [*done[-99:], mark])
        self.metrics.trials.labels("load_error").inc()
        self.metrics.outbox_depth.set(self.outbox.depth())

    def _apply(self, desired: list[DesiredBundle]) -> bool:
        """Stage and publish the desired state; True when the published active versions changed.

        The controller's desired state is the whole truth for serving: a bundle it does not name (a first
        version rolled back, a bundle removed), or names with no active version, is unpublished (serving falls
        back to the PyTorch reference); the stable version kept as a bundle's fallback is the one it names
        now (a withdrawn stable is no fallback). A candidate whose trial on this node failed a node-local gate
        (:mod:`agents.serve_gate`) is not served even when named: the stable version serves instead.
        """
        assert self.cache is not None and self.outbox is not None
        self._missing = []
        new_active: dict[str, BundleRef] = {}
        new_stable: dict[str, BundleRef] = {}
        for d in desired:
            if d.stable is not None and self._ensure(d.stable, None):
                new_stable[d.name] = d.stable
            if d.trial is not None:
                self._ensure(d.trial.candidate, d.trial)
                if d.trial.stable is not None:
                    self._ensure(d.trial.stable, None)
            want = self._gated(d)
            if want is None:
                continue  # a first version before its pre-serve trial passed, or withdrawn: serve none
            if self._ensure(want, d.trial if d.trial and d.trial.candidate == want else None):
                new_active[d.name] = want
            elif d.name in new_stable:
                new_active[d.name] = new_stable[d.name]  # the desired active is unavailable: serve the stable
            elif d.name in self.active:
                new_active[d.name] = self.active[d.name]  # not downloaded yet and no stable: keep what serves
        for name in sorted(set(self.active) - set(new_active)):
            self._withdraw(name)
        before = dict(self.active)
        if new_active != self.active or new_stable != self.stable:
            for name, ref in new_active.items():
                old = self.active.get(name)
                if old != ref:
                    log.info("switching %s: %s -> %s", name, old.version if old else "-", ref.version)
            self.cache.publish(self.cfg.runtime_dir, new_active, new_stable)
            self.active, self.stable = new_active, new_stable
            self.outbox.set_state("active", {k: v.model_dump() for k, v in new_active.items()})
            self.outbox.set_state("stable", {k: v.model_dump() for k, v in new_stable.items()})
        switched = new_active != before
        # a running trial whose candidate was withdrawn (rolled back, superseded) is stopped
        t = self._trial
        if t is not None:
            still = any(d.trial is not None and d.trial.rollout_id == t.spec.rollout_id
                        and d.trial.candidate == t.spec.candidate for d in desired)
            if not still and self.runner is not None:
                log.info("candidate %s@%s withdrawn: stopping its trial", t.spec.candidate.name,
                         t.spec.candidate.version)
                self.runner.abort()
        keep = {r.digest for d in desired for r in self._refs(d)}
        keep |= {r.digest for r in self.active.values()} | {r.digest for r in self.stable.values()}
        if t is not None:
            keep |= {r.digest for r in (t.spec.candidate, t.spec.stable) if r is not None}
        if desired:
            self.cache.gc(keep)
        if self.downloader is not None:
            self.downloader.want(self._missing)
        return switched

    def _gated(self, d: DesiredBundle) -> BundleRef | None:
        """The version of ``d`` to serve: the controller's active one, unless it is a candidate this node's own
        trial refused (a node-local gate failed): then the stable version (None: no stable, serve none)."""
        if d.active is None or d.role != "candidate" or d.active == d.stable:
            return d.active
        verdict = self.verdicts.get(d.active.digest)
        if verdict is None or verdict.ok:
            return d.active
        if d.active.digest not in self._refusals_logged:
            self._refusals_logged.add(d.active.digest)
            log.warning("%s (the controller names it active; serving %s instead)", verdict.line(),
                        f"stable {d.stable.version}" if d.stable is not None else "no version")
        return d.stable

    def _withdraw(self, name: str) -> None:
        """The controller names no version of ``name`` to serve any more: unpublish it."""
        assert self.cache is not None
        self.cache.unpublish(self.cfg.runtime_dir, name)
        log.warning("%s withdrawn (was %s): serving code falls back to the PyTorch reference", name,
                    self.active[name].version)

    # ---------------------------------------------------------------------------------------- trials
    def _next_trial_at(self, spec: TrialSpec) -> float:
        assert self.outbox is not None
        last = self.outbox.get_state("last_trial")
        if not last:
            return 0.0
        gap = max(spec.interval_seconds, last["duration"] * (1.0 / self.cfg.duty_cycle - 1.0))
        return float(last["end"]) + gap

    def _maybe_trial(self) -> None:
        if self._trial is not None or self.stop_event.is_set():
            return
        assert self.cache is not None and self.node is not None
        for d in self.desired:
            spec = d.trial
            if spec is None or spec.candidate.digest in self.refused:
                continue
            if not self.cache.has(spec.candidate) or (spec.stable is not None and not self.cache.has(spec.stable)):
                continue
            wait = self._next_trial_at(spec) - time.time()
            if wait > 0:
                log.debug("next trial in %.1fs (duty cycle %.2f)", wait, self.cfg.duty_cycle)
                return
            free = memory_free_fraction(self.node.has_gpu)
            if free is not None and free < self.cfg.memory_headroom:
                self.metrics.trials_skipped.labels("memory_headroom").inc()
                log.warning("trial postponed: %.0f%% memory free, headroom %.0f%% required", 100 * free,
                            100 * self.cfg.memory_headroom)
                return
            assert self.runner is not None
            self.runner.reset()
            if self.stop_event.is_set():
                return
            thread = threading.Thread(target=self._trial_main, args=(spec,), name="trial", daemon=True)
            self._trial = _RunningTrial(spec, thread)
            thread.start()
            return

    def _trial_main(self, spec: TrialSpec) -> None:
        assert self.runner is not None and self.cache is not None and self.outbox is not None
        outbox = self.outbox
        started = time.time()
        self.metrics.trial_running.set(1)

        def on_start(pid: int) -> None:
            outbox.set_state("trial_child", {"pid": pid, "rollout_id": spec.rollout_id, "started": started})

        try:
            try:
                cand = self.cache.reverify(spec.candidate)
                stable = self.cache.reverify(spec.stable) if spec.stable is not None else None
            except BundleRefused as exc:
                self.refused[exc.ref.digest] = (time.monotonic(), exc.reason)
                if exc.ref == spec.candidate:
                    self._report_load_error(spec, str(exc))
                return
            log.info("trial of %s@%s vs %s (rollout %d) started", spec.candidate.name, spec.candidate.version,
                     spec.stable.version if spec.stable else "-", spec.rollout_id)
            report = self.runner.run(spec, idempotency_key=new_idempotency_key(self.cfg.node_name),
                                     candidate_path=cand, stable_path=stable, on_start=on_start)
            report = self._judge_locally(spec, report)
            outbox.add(report)
            outbox.set_state("last_trial", {"end": time.time(), "duration": time.time() - started})
            self.metrics.trials.labels(report.outcome).inc()
            self.metrics.trial_duration.observe(report.duration_s)
            self.metrics.outbox_depth.set(outbox.depth())
            log.info("trial of %s@%s finished: %s in %.1fs", spec.candidate.name, spec.candidate.version,
                     report.outcome, report.duration_s)
            if report.outcome != "ok":
                log.warning("trial detail: %s", report.detail[:2000])
        except TrialAborted:
            log.info("trial of %s@%s aborted", spec.candidate.name, spec.candidate.version)
        except Exception:
            log.exception("trial of %s@%s failed in the agent", spec.candidate.name, spec.candidate.version)
            outbox.set_state("last_trial", {"end": time.time(), "duration": time.time() - started})
        finally:
            if not self.stop_event.is_set():
                outbox.set_state("trial_child", None)
            self.metrics.trial_running.set(0)
            self._trial = None
            self._wake.set()  # flush the report now, not at the next heartbeat

    def _judge_locally(self, spec: TrialSpec, report: TrialReport) -> TrialReport:
        """Record this node's own verdict on serving the candidate (before its report can reach the controller,
        so a candidate the controller verifies on this report is already judged here); returns the report with
        the verdict as the first line of its detail."""
        assert self.outbox is not None
        verdict = judge_trial(report, spec)
        verdicts = dict(self.verdicts)
        before = verdicts.pop(spec.candidate.digest, None)
        verdicts[spec.candidate.digest] = verdict
        self.verdicts = dict(list(verdicts.items())[-100:])  # the latest trial's verdict of the last 100
        self.outbox.set_state("serve_verdicts", {k: v.as_state() for k, v in self.verdicts.items()})
        if before is None or before.ok != verdict.ok:
            self._refusals_logged.discard(spec.candidate.digest)
            self._verdict_changed = True
        if report.outcome != "ok":  # a hard failure: its outcome and detail say it already
            return report
        (log.info if verdict.ok else log.warning)("%s", verdict.line())
        return annotate(report, verdict)

    # --------------------------------------------------------------------------------------- reports
    def _flush(self) -> int:
        """Send pending reports; returns how many the controller acknowledged. Called by the main loop only,
        without ``_lock`` (the outbox is thread-safe): the watch thread never waits behind a slow report."""
        with self._flushing:
            return self._flush_locked()

    def _flush_locked(self) -> int:
        if self.client is None or self.outbox is None:
            return 0
        client, outbox = self.client, self.outbox

        def send(batch: list[TrialReport]) -> ReportBatchResponse:
            return client.send_reports(self.cfg.node_name, batch)

        n = 0
        try:
            n = outbox.flush(send, refuses=_refused)  # a refused report is found, kept and never resent
        except ControllerError as exc:
            log.warning("report flush failed (%d pending, kept): %s", outbox.depth(), exc)
        if n:
            self.metrics.reports_sent.inc(n)
            log.info("%d report(s) acknowledged", n)
        self.metrics.outbox_depth.set(outbox.depth())
        return n


def _refused(exc: Exception) -> bool:
    """The controller refused a report request as invalid (4xx but auth and rate limits): not worth resending."""
    return isinstance(exc, ControllerError) and exc.status is not None and 400 <= exc.status < 500 \
        and exc.status not in (401, 403, 429)
