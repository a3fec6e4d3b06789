"""The README's main job end to end: `kernelctl demo` promotes 1.1.0 and rolls back the drift fault.

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

pytestmark = pytest.mark.slow


def test_demo_promotes_the_candidate_and_rolls_back_the_fault(tmp_path: Path) -> None:
    keep = tmp_path / "demo"
    env = {**os.environ, "COLUMNS": "160"}
    proc = subprocess.run([sys.executable, "-m", "kernelctl.cli", "demo", "--json", "--keep", str(keep)],
                          capture_output=True, text=True, env=env, timeout=900)
    summary = json.loads(proc.stdout)
    assert proc.returncode == 0, (summary.get("error"), proc.stderr[-2000:])
    assert summary["ok"] is True
    states = {r["bundle"]: r["state"] for r in summary["rollouts"]}
    assert states == {"llm-fused@1.0.0": "promoted", "llm-fused@1.1.0": "promoted",
                      "llm-fused@1.2.0-fault.drift": "rolled_back"}
    fault = next(r for r in summary["rollouts"] if r["bundle"].endswith("fault.drift"))
    assert any(v["decision"] == "rollback" and v["gate"] == "numeric" for v in fault["verdicts"]), fault
    assert fault["back_to_stable_seconds"] is not None  # every canary switched back to stable
    candidate = next(r for r in summary["rollouts"] if r["bundle"].endswith("@1.1.0"))
    assert [v["decision"] for v in candidate["verdicts"]].count("promote") >= 1

    # the audit trail is in the kept database, and every process is gone
    engine = make_engine(f"sqlite:///{keep / 'kernelctl.db'}", read_only=True)
    with session_factory(engine)() as s:
        actions = [(e.action, e.bundle) for e in s.scalars(select(Event).order_by(Event.id))]
        revoked = s.scalar(select(Bundle.status).where(Bundle.version == "1.2.0-fault.drift"))
    engine.dispose()
    assert ("rollout.rolled_back", "llm-fused@1.2.0-fault.drift") in actions
    assert ("rollout.promoted", "llm-fused@1.1.0") in actions
    assert revoked == "revoked"
    leftover = subprocess.run(["pgrep", "-f", str(keep)], capture_output=True, text=True)
    assert leftover.stdout.strip() == "", f"processes left running: {leftover.stdout}"
