"""The report outbox: durable, FIFO, acknowledged-only, same keys on resend, survives reopening."""

from __future__ import annotations

import datetime as dt
import sqlite3
from pathlib import Path

import pytest

from agents.outbox import Outbox, new_idempotency_key
from kernelctl.wire import BundleRef, ReportBatchResponse, TrialReport

REF = BundleRef(name="llm-fused", version="1.1.0", digest="a" * 64)


def report(node: str = "n1", outcome: str = "ok") -> TrialReport:
    return TrialReport(idempotency_key=new_idempotency_key(node), rollout_id=1, stratum="sm_90/drv550/triton3.6.0",
                       candidate=REF, stable=None, outcome=outcome, measured_at=dt.datetime.now(dt.timezone.utc))


def test_key_format_fits_wire() -> None:
    key = new_idempotency_key("n" * 250)
    assert len(key) <= 128 and key.startswith("n" * 80 + ":")
    assert new_idempotency_key("a") != new_idempotency_key("a")


def test_reports_survive_reopen_and_keep_order(tmp_path: Path) -> None:
    box = Outbox(tmp_path / "o.db")
    reps = [report() for _ in range(5)]
    for r in reps:
        box.add(r)
    box.close()
    box = Outbox(tmp_path / "o.db")  # an agent restart
    assert box.depth() == 5
    assert [r.idempotency_key for r in box.pending(10)] == [r.idempotency_key for r in reps]
    assert box.pending(10)[0] == reps[0]  # the full report round-trips
    box.close()


def test_flush_marks_sent_only_after_ack_and_resends_same_keys(tmp_path: Path) -> None:
    box = Outbox(tmp_path / "o.db")
    reps = [report() for _ in range(5)]
    for r in reps:
        box.add(r)
    seen: list[list[str]] = []

    def down(batch: list[TrialReport]) -> ReportBatchResponse:
        seen.append([r.idempotency_key for r in batch])
        raise ConnectionError("controller down")

    with pytest.raises(ConnectionError):
        box.flush(down, batch_size=2)
    assert box.depth() == 5  # nothing acknowledged: nothing marked

    def up(batch: list[TrialReport]) -> ReportBatchResponse:
        seen.append([r.idempotency_key for r in batch])
        return ReportBatchResponse(accepted=len(batch), duplicates=0)

    assert box.flush(up, batch_size=2) == 5
    assert box.depth() == 0
    assert seen[0] == seen[1]  # the unacknowledged batch was resent with the same keys
    assert [k for b in seen[1:] for k in b] == [r.idempotency_key for r in reps]
    assert box.flush(up) == 0  # nothing is sent twice once acknowledged
    assert len(seen) == 4
    box.close()


def test_duplicate_add_is_ignored_and_rejected_is_never_resent(tmp_path: Path) -> None:
    box = Outbox(tmp_path / "o.db")
    r = report()
    box.add(r)
    box.add(r)
    assert box.depth() == 1
    box.mark_rejected(r.idempotency_key, "422: bad")
    assert box.depth() == 0 and box.pending() == []
    assert box.rejected() == [(r.idempotency_key, "422: bad")]
    box.close()


def test_wal_and_state(tmp_path: Path) -> None:
    box = Outbox(tmp_path / "o.db")
    box.set_state("last_trial", {"end": 1.5, "duration": 2.0})
    assert box.get_state("last_trial") == {"end": 1.5, "duration": 2.0}
    box.set_state("last_trial", None)
    assert box.get_state("last_trial", "none") == "none"
    box.close()
    mode = sqlite3.connect(tmp_path / "o.db").execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


class Refused(Exception):
    """What ``send`` raises for a request the controller refused as invalid (the client's 4xx)."""


def test_requests_bounded_by_bytes_and_a_refused_report_found_and_kept(tmp_path: Path) -> None:
    """What is waiting goes in one request up to ``max_bytes`` (a report larger goes alone); a refused request
    is sent again one report at a time: the report at fault is kept as rejected (never resent), the others
    acknowledged; a report the controller's answer refuses by key is kept as rejected with its reason."""
    box = Outbox(tmp_path / "o.db")
    reps = [report() for _ in range(6)]
    bad, late = reps[2].idempotency_key, reps[4].idempotency_key
    for r in reps:
        box.add(r)
    size = len(reps[0].model_dump_json())
    assert len(box.pending(100, max_bytes=3 * size)) == 3 and len(box.pending(100, max_bytes=1)) == 1
    sent: list[list[str]] = []

    def send(batch: list[TrialReport]) -> ReportBatchResponse:
        keys = [r.idempotency_key for r in batch]
        sent.append(keys)
        if bad in keys:
            raise Refused(f"422: report {bad} is invalid")
        refused = {late: "not a current canary"} if late in keys else {}
        return ReportBatchResponse(accepted=len(keys) - len(refused), duplicates=0, refused=refused)

    assert box.flush(send, max_bytes=4 * size, refuses=lambda exc: isinstance(exc, Refused)) == 6
    keys = [r.idempotency_key for r in reps]
    assert sent == [keys[:4], *([k] for k in keys[:4]), keys[4:]]
    assert box.depth() == 0
    assert box.rejected() == [(bad, f"422: report {bad} is invalid"),
                              (late, "refused by the controller: not a current canary")]
    with pytest.raises(ConnectionError):  # another failure is not a refusal: the batch stays, nothing rejected
        box.add(report())
        box.flush(lambda batch: (_ for _ in ()).throw(ConnectionError("down")), refuses=lambda e: isinstance(e, Refused))
    assert box.depth() == 1 and len(box.rejected()) == 2
    box.close()
