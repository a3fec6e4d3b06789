"""The agent's bundle downloader: missing versions staged in a thread of their own, off the heartbeat path.

The watch thread's round (heartbeat, apply the reply) never moves a byte of a bundle: ``Agent._apply`` serves
what is staged and hands what is missing to :meth:`Downloader.want` (the whole list each time, most wanted
first). This thread downloads one version at a time, after a random delay of up to ``jitter_s`` (a fleet told
about a new version at once does not download it in the same instant), without the agent's lock. A transport
error or an answer of an overloaded controller (``ControllerError``: the client already retried and resumed
within its own limits) is retried with exponential backoff and jitter (tenacity), resuming the partial file
(``ControllerClient.download_bundle``), for as long as the version is still wanted; bytes that fail their
digest or signature (:class:`~agents.client.DownloadError`, :class:`~agents.cache.BundleRefused`) are not
retried here: ``on_refused`` records the refusal (the agent tries again after ``REFUSAL_RETRY_S``). A staged
version is announced through ``on_staged``: the agent applies its desired state again and reports at once.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tenacity import Retrying, retry_if_exception

from agents.cache import BundleRefused
from agents.client import ControllerError, DownloadError, backoff_wait
from kernelctl.wire import BundleRef, TrialSpec

log = logging.getLogger("kernelctl.agent.download")


@dataclass(frozen=True)
class Wanted:
    """A version the desired state names and the cache lacks; ``trial``: the trial whose candidate it is."""

    ref: BundleRef
    trial: TrialSpec | None = None


class NotWanted(Exception):
    """The version stopped being wanted (or the agent stops) while its download was being retried."""


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, ControllerError) and not isinstance(exc, DownloadError)


class Downloader:
    """One download at a time, in its own thread (see the module docstring).

    ``fetch(ref)`` downloads and installs one version (bytes move here, never under the agent's lock);
    ``on_staged(ref)`` and ``on_refused(wanted, reason)`` are called from this thread after it.
    """

    def __init__(self, fetch: Callable[[BundleRef], None], on_staged: Callable[[BundleRef], None],
                 on_refused: Callable[[Wanted, str], None], stop_event: threading.Event, *,
                 jitter_s: float = 2.0, backoff_initial_s: float = 1.0, backoff_max_s: float = 60.0) -> None:
        self._fetch, self._on_staged, self._on_refused = fetch, on_staged, on_refused
        self._stop = stop_event
        self.jitter_s, self.backoff_initial_s, self.backoff_max_s = jitter_s, backoff_initial_s, backoff_max_s
        self._cond = threading.Condition()
        self._wanted: list[Wanted] = []
        self.current: BundleRef | None = None  # the version being downloaded now
        self.failures = 0  # attempts that failed and were retried (all versions)
        self._thread = threading.Thread(target=self._run, name="download", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Wake the thread so it sees the stop event (the caller set it)."""
        with self._cond:
            self._cond.notify_all()

    def join(self, timeout: float | None = None) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    def want(self, wanted: list[Wanted]) -> None:
        """The versions to stage, most wanted first (replaces the previous list; duplicates by digest are
        dropped). A version being downloaded that is no longer wanted is given up after its current attempt."""
        seen: set[str] = set()
        out = []
        for w in wanted:
            if w.ref.digest not in seen:
                seen.add(w.ref.digest)
                out.append(w)
        with self._cond:
            if out != self._wanted:
                self._wanted = out
                self._cond.notify_all()

    def pending(self) -> list[BundleRef]:
        with self._cond:
            return [w.ref for w in self._wanted]

    def _still_wanted(self, ref: BundleRef) -> Wanted | None:
        with self._cond:
            return next((w for w in self._wanted if w.ref.digest == ref.digest), None)

    def _drop(self, ref: BundleRef) -> None:
        with self._cond:
            self._wanted = [w for w in self._wanted if w.ref.digest != ref.digest]

    def _next(self) -> Wanted | None:
        with self._cond:
            while not self._wanted and not self._stop.is_set():
                self._cond.wait()
            return None if self._stop.is_set() else self._wanted[0]

    def _run(self) -> None:
        while True:
            w = self._next()
            if w is None:
                return
            if self._stop.wait(random.random() * self.jitter_s):
                return
            w = self._still_wanted(w.ref)  # the desired state may have moved on during the jitter
            if w is None:
                continue
            try:
                self._stage(w)
            except NotWanted:
                continue
            except Exception:  # never let the thread die: this version is dropped until it is wanted again
                log.exception("download of %s@%s failed in the agent", w.ref.name, w.ref.version)
                self._drop(w.ref)

    def _stage(self, w: Wanted) -> None:
        ref = w.ref
        self.current = ref
        try:
            for attempt in Retrying(retry=retry_if_exception(_retryable), reraise=True, sleep=self._sleep,
                                    wait=backoff_wait(self.backoff_initial_s, self.backoff_max_s),
                                    before_sleep=self._log_retry):
                with attempt:
                    if self._stop.is_set() or self._still_wanted(ref) is None:
                        raise NotWanted
                    self._fetch(ref)
        except (BundleRefused, DownloadError) as exc:
            self._on_refused(w, exc.reason if isinstance(exc, BundleRefused) else str(exc))
            self._drop(ref)
            return
        finally:
            self.current = None
        self._drop(ref)
        self._on_staged(ref)

    def _sleep(self, seconds: float) -> None:
        self._stop.wait(seconds)

    def _log_retry(self, retry_state: Any) -> None:
        self.failures += 1
        exc = retry_state.outcome.exception() if retry_state.outcome else None
        log.warning("download failed (%s); retry %d in %.1fs", exc, retry_state.attempt_number,
                    retry_state.next_action.sleep if retry_state.next_action else 0.0)
