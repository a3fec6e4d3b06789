"""The API process logs a garbage collection that stalled it (issue 28's heartbeat tail): the generation, how
long it held the GIL (wall and CPU time) and what it freed, only when it took at least ``GC_PAUSE_WARN_SECONDS``.
And it freezes what survives a collection, so later collections do not scan it again; a reference cycle
that dies frozen is freed by the periodic ``refreeze``."""

from __future__ import annotations

import gc
import logging
import re
import weakref

import pytest

from controller import server


def _collect(generation: int) -> None:
    gc.callbacks.append(server._log_long_collection)
    try:
        gc.collect(generation)
    finally:
        gc.callbacks.remove(server._log_long_collection)


def test_a_long_collection_is_logged_and_a_short_one_is_not(caplog: pytest.LogCaptureFixture,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    with caplog.at_level(logging.WARNING, logger="kernelctl.server"):
        monkeypatch.setattr(server, "GC_PAUSE_WARN_SECONDS", 60.0)
        _collect(1)
        assert "garbage collection" not in caplog.text  # well under the threshold
        monkeypatch.setattr(server, "GC_PAUSE_WARN_SECONDS", 0.0)
        _collect(1)
    line = r"garbage collection of generation 1 took \d+ ms, \d+ ms of it on a CPU \(the process stood still\): \d+"
    assert re.search(line, caplog.text), caplog.text


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_survivors_of_a_collection_are_frozen_and_a_refreeze_frees_a_cycle_that_died_frozen() -> None:
    gc.callbacks.append(server._after_collection)
    try:
        cycle = _Cycle()
        alive = weakref.ref(cycle)
        frozen = gc.get_freeze_count()
        gc.collect(0)
        assert gc.get_freeze_count() > frozen  # the survivors, the cycle among them, left the scanned generations
        del cycle
        gc.collect(1)  # the young generations only
        assert alive() is not None  # a cycle is not freed by reference counting, and it is frozen
        assert server.refreeze() >= 1
        assert alive() is None
        assert gc.get_freeze_count() > 0  # frozen again after the full collection
    finally:
        gc.callbacks.remove(server._after_collection)
        gc.unfreeze()  # the test process's other tests see an unfrozen heap
