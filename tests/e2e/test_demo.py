"""The README's main job end to end: `kernelctl demo` promotes the identical 1.1.1 and rolls back the drift fault.

Real processes throughout (controller on loopback, six agents whose kernels run through Triton's
interpreter, SQLite); the test reads the demo's JSON summary and then the changelog it kept.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import select

from controller.db.engine import make_engine, session_factory
from controller.db.models import Bundle, Event
from tests.controller.webhook import WebhookReceiver

pytestmark = pytest.mark.slow


def test_demo_promotes_the_candidate_and_rolls_back_the_fault(tmp_path: Path) -> None:
    keep = tmp_path / "demo"
    env = {**os.environ, "COLUMNS": "160"}
    with WebhookReceiver() as hook:  # a real local webhook: the demo forwards it to its controller
        proc = subprocess.run([sys.executable, "-m", "cli.app", "demo", "--json", "--keep", str(keep),
                               "--notify-url", hook.url + "?token=demo-secret"],
                              capture_output=True, text=True, env=env, timeout=1500)
    summary = json.loads(proc.stdout)
    assert proc.returncode == 0, (summary.get("error"), proc.stderr[-2000:])
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
