"""The API process logs a garbage collection that stalled it (issue 28's heartbeat tail): the generation, how
long it held the GIL (wall and CPU time) and what it freed, only when it took at least ``GC_PAUSE_WARN_SECONDS``."""

from __future__ import annotations

import gc
import logging
import re

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
