"""The README's main job end to end: `kernelctl demo` promotes the identical 1.1.1 and rolls back the drift fault.

Real processes throughout (controller on loopback, six agents whose kernels run through Triton's
interpreter, SQLite); the test reads the demo's JSON summary and then the changelog it kept.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from controller.db.engine import make_engine, session_factory
from controller.db.models import Bundle, Event
from tests import reaper
from tests.controller.webhook import WebhookReceiver

# The demo decides on evidence and has no wall-clock limit of its own; on a machine that other work keeps busy it
# took up to 11 minutes (issue 27). The test's limit is this one figure: the demo is stopped (SIGTERM: it stops its
# controller and agents) before pytest's own timeout for this test, which leaves room for that.
DEMO_LIMIT_S = 1800
pytestmark = [pytest.mark.slow, pytest.mark.timeout(DEMO_LIMIT_S + 120)]


@contextlib.contextmanager
def running_demo(args: list[str], keep: Path) -> Iterator[subprocess.Popen[str]]:
    """The demo as a child process, always stopped with everything it started, however the test ends (a failed
    assertion, pytest-timeout): SIGTERM to the demo, then any process still running that it started."""
    before = reaper.children()
    proc = subprocess.Popen([sys.executable, "-m", "cli.app", "demo", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "COLUMNS": "160"},
                            start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            reaper.stop_processes([proc.pid], grace=60)  # its own SIGTERM handler stops its fleet first
        # orphans re-parented to this (subreaper) process, and anything else running from the demo's directory
        left = reaper.children() - before - {proc.pid}
        found = subprocess.run(["pgrep", "-f", str(keep)], capture_output=True, text=True, check=False).stdout
        reaper.stop_processes(left | {int(p) for p in found.split()})


def test_demo_promotes_the_candidate_and_rolls_back_the_fault(tmp_path: Path) -> None:
    keep = tmp_path / "demo"
    with WebhookReceiver() as hook, running_demo(  # a real local webhook: the demo forwards it to its controller
            ["--json", "--keep", str(keep), "--notify-url", hook.url + "?token=demo-secret"], keep) as proc:
        try:
            out, err = proc.communicate(timeout=DEMO_LIMIT_S)
        except subprocess.TimeoutExpired:
            proc.terminate()
            out, err = proc.communicate(timeout=60)
            pytest.fail(f"the demo did not finish in {DEMO_LIMIT_S}s; its progress:\n{err[-3000:]}")
    summary = json.loads(out)
    assert proc.returncode == 0, (summary.get("error"), err[-3000:])
    assert summary["ok"] is True
    states = {r["bundle"]: r["state"] for r in summary["rollouts"]}
    assert states == {"llm-fused@1.1.0": "promoted", "llm-fused@1.1.1": "promoted",
                      "llm-fused@1.2.0-fault.drift": "rolled_back"}
    fault = next(r for r in summary["rollouts"] if r["bundle"].endswith("fault.drift"))
    assert any(v["decision"] == "rollback" and v["gate"] == "numeric" for v in fault["verdicts"]), fault
    assert fault["back_to_stable_seconds"] is not None  # every canary switched back to stable
    assert fault["served_on"] == 0  # trial before serve: the drift fault never served on any node
    candidate = next(r for r in summary["rollouts"] if r["bundle"].endswith("@1.1.1"))
    assert [v["decision"] for v in candidate["verdicts"]].count("promote") >= 1
    assert candidate["served_on"] >= 1

    # the webhook got the promotion of 1.1.1 and the judge's rollback of the fault, with the gate
    got = {(b["kind"], b["bundle"]) for b in hook.bodies}
    assert ("promoted", "llm-fused@1.1.1") in got and ("started", "llm-fused@1.2.0-fault.drift") in got, got
    rolled = [b for b in hook.bodies if b["kind"] == "rolled_back" and b["bundle"].endswith("fault.drift")]
    assert rolled, hook.bodies  # one per stratum the judge rolled back
    for rb in rolled:
        assert rb["gate"] == "numeric" and rb["reason"].startswith("judge:"), rb
        assert rb["evidence"]["gate"] == "numeric" and rb["stratum"] and "ROLLED BACK" in rb["text"]
    assert {b["kind"] for b in hook.bodies if b["bundle"].endswith("@1.1.1")} >= {"started", "promoted"}
    assert summary["notifications"] == {"delivered": len(hook.bodies), "failed": 0}
    assert all(r["path"].endswith("?token=demo-secret") for r in hook.requests)
    logs = "".join(p.read_text(errors="replace") for p in (keep / "logs").glob("*.log"))
    assert "demo-secret" not in logs

    # the audit trail is in the kept database, and every process is gone
    engine = make_engine(f"sqlite:///{keep / 'kernelctl.db'}", read_only=True)
    with session_factory(engine)() as s:
        actions = [(e.action, e.bundle) for e in s.scalars(select(Event).order_by(Event.id))]
        revoked = s.scalar(select(Bundle.status).where(Bundle.version == "1.2.0-fault.drift"))
    engine.dispose()
    assert ("rollout.rolled_back", "llm-fused@1.2.0-fault.drift") in actions
    assert ("rollout.promoted", "llm-fused@1.1.1") in actions
    assert ("assignment.verified", "llm-fused@1.1.1") in actions  # canaries served it after their trial
    assert ("assignment.verified", "llm-fused@1.2.0-fault.drift") not in actions
    assert revoked == "revoked"
    leftover = subprocess.run(["pgrep", "-f", str(keep)], capture_output=True, text=True)
    assert leftover.stdout.strip() == "", f"processes left running: {leftover.stdout}"


def test_demo_stops_on_a_paused_stratum_and_says_which(tmp_path: Path) -> None:
    """A stratum the demo cannot finish (here an operator pauses the rollout from outside) ends the demo at once
    with exit 1 and one line naming the rollout, the stratum and why; the next rollout is not started (before,
    the demo waited out its wall-clock timeout, then blamed the next rollout's 409). Two agents (one per stratum,
    the fewest the demo takes): what is tested is how the demo ends, and the test above runs the default fleet."""
    keep = tmp_path / "demo"
    with running_demo(["--json", "--keep", str(keep), "--nodes", "2"], keep) as proc:
        port_file, tokens = keep / "controller" / "port", keep / "bootstrap-tokens"
        deadline = time.monotonic() + DEMO_LIMIT_S
        rollout = None
        while rollout is None and time.monotonic() < deadline and proc.poll() is None:
            if port_file.is_file() and port_file.read_text().strip() and tokens.is_file():
                operator = next(ln.split()[2] for ln in tokens.read_text().splitlines() if ln.startswith("operator "))
                url = f"http://127.0.0.1:{port_file.read_text().strip()}"
                with contextlib.suppress(httpx.HTTPError):
                    listed = httpx.get(f"{url}/v1/rollouts", headers={"Authorization": f"Bearer {operator}"}).json()
                    rollout = next((r for r in listed if r["bundle"] == "llm-fused@1.1.1"
                                    and r["state"] == "progressing"), None)
            time.sleep(0.5)
        assert rollout is not None, "the demo never started rolling out 1.1.1"
        r = httpx.post(f"{url}/v1/rollouts/{rollout['id']}/pause", json={"reason": "e2e: an operator pauses it"},
                       headers={"Authorization": f"Bearer {operator}"}, timeout=30)
        assert r.status_code == 200, r.text
        out, err = proc.communicate(timeout=DEMO_LIMIT_S)
    summary = json.loads(out)
    assert proc.returncode == 1 and summary["ok"] is False
    error = summary["error"]
    assert error.startswith(f"rollout {rollout['id']} (llm-fused@1.1.1), stratum sm_") and \
        error.endswith(" at step 1/2: paused: e2e: an operator pauses it"), error
    assert f"demo failed: {error}" in " ".join(err.split()), err[-2000:]
    states = {r["bundle"]: r["state"] for r in summary["rollouts"]}
    assert states == {"llm-fused@1.1.0": "promoted", "llm-fused@1.1.1": "paused",
                      "llm-fused@1.2.0-fault.drift": "not started"}
    assert "409" not in error
    leftover = subprocess.run(["pgrep", "-f", str(keep)], capture_output=True, text=True)
    assert leftover.stdout.strip() == "", f"processes left running: {leftover.stdout}"
