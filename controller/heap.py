"""The cyclic garbage collector of a long-lived controller process: start-up heap frozen, young collections
rarer, survivors frozen (:func:`settle_heap`), long pauses logged.

Every process that serves or ingests runs it once its start-up is done: the API processes (``controller.server``,
issue 28's heartbeat tail) and the report worker processes (``controller.intake``): a worker with the default
thresholds (700, 10, 10) and its imported modules unfrozen spent about as much CPU in the collector as in parsing,
validating and storing the reports (docs/benchmarks.md, "Ingest: CPU per report").
"""

from __future__ import annotations

import gc
import logging
import threading
import time

log = logging.getLogger("kernelctl.server")


def settle_heap() -> None:
    """Before serving or ingesting: keep the cyclic garbage collector's pauses short and its work small (issue 28:
    at 10,000 nodes every API worker stood still 100-600 ms every 2-5 s, docs/benchmarks.md runs Q6-Q8).

    - What start-up built (modules, the app and its state) lives as long as the process: frozen out of the
      collector's scans (``gc.freeze``).
    - Young collections every 10,000 allocations instead of 700, a full one considered after 100 middle ones.
    - What survives a collection is frozen too (:func:`_after_collection`), so each object is scanned at most
      once: held watches (each with its coroutines, futures and request objects, ~75 tracked objects per watch)
      and snapshots live for seconds, and without this they piled up in the middle generation (150,000 objects
      at 2,000 nodes, a 100-140 ms pause each time it was collected) and then in the full ones. Frozen objects
      are still freed by reference counting the moment they are dropped; only a reference *cycle* that dies
      after being frozen waits, for :func:`refreeze` every ``GC_REFREEZE_SECONDS`` (one full collection).
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 10, 100)
    if _after_collection not in gc.callbacks:
        gc.callbacks.append(_after_collection)
    if not any(t.name == "kernelctl-refreeze" for t in threading.enumerate()):
        threading.Thread(target=_refreeze_forever, name="kernelctl-refreeze", daemon=True).start()


GC_PAUSE_WARN_SECONDS = 0.1  # a collection this long stalls the event loop past the heartbeat goal (200 ms p99)
GC_REFREEZE_SECONDS = 600.0  # how long a frozen reference cycle may wait to be collected (one full pause each)
_gc_started = [0.0, 0.0]  # wall clock and this thread's CPU time when the running collection started


def _after_collection(phase: str, info: dict[str, int]) -> None:
    """(gc callback) Freezes what survived a collection (:func:`settle_heap`) and logs a long one
    (:func:`_log_long_collection`)."""
    _log_long_collection(phase, info)
    if phase == "stop":
        gc.freeze()  # the collected generations are empty right after: only survivors of a collection are frozen


def refreeze() -> int:
    """Every frozen object back to the collector, one full collection, everything left frozen again: the reference
    cycles that died while frozen are freed. Returns how many objects the collection freed."""
    gc.unfreeze()
    try:
        return gc.collect()
    finally:
        gc.freeze()


def _refreeze_forever() -> None:
    while True:
        time.sleep(GC_REFREEZE_SECONDS)
        started = time.perf_counter()
        freed = refreeze()
        log.info("full garbage collection of the frozen heap: %d objects freed in %.0f ms", freed,
                 (time.perf_counter() - started) * 1000)


def _log_long_collection(phase: str, info: dict[str, int]) -> None:
    """A collection that held the GIL longer than ``GC_PAUSE_WARN_SECONDS`` is logged with its
    generation, the CPU time it used (the rest of its wall time the process waited for a core: a busy machine)
    and what it freed: every request of the process stood still that long. (Logging takes re-entrant locks
    only, so a collection that starts inside a log call cannot deadlock here.)"""
    if phase == "start":
        _gc_started[0], _gc_started[1] = time.perf_counter(), time.thread_time()
        return
    took = time.perf_counter() - _gc_started[0]
    if took >= GC_PAUSE_WARN_SECONDS:
        cpu = time.thread_time() - _gc_started[1]
        log.warning("garbage collection of generation %d took %.0f ms, %.0f ms of it on a CPU (the process stood "
                    "still): %d collected, %d uncollectable", info.get("generation", -1), took * 1000, cpu * 1000,
                    info.get("collected", 0), info.get("uncollectable", 0))
