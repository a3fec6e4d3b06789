"""The demo's supervision and views without running the fleet: it ends a rollout on evidence (a paused stratum,
samples without a decision, canaries silent for longer than their measured trials explain) and says which
rollout, which stratum and why; rollouts not started yet are "waiting", never "unexpected"; redirected output
gets the page's address at once and a line per stratum with its clean samples so far and needed."""

from __future__ import annotations

import datetime as dt
import io
from pathlib import Path
from typing import Any

from rich.console import Console

from cli.demo import EXPECTED_SAMPLES, SAMPLE_BUDGET, STALL_FACTOR, STALL_FLOOR_S, Outcome, Watch, demo_plan
from cli.demo_fleet import StratumEvidence
from cli.demo_view import LiveView, PlainView, RolloutProgress, StratumProgress
from controller.plan import PlanSpec

S80, S90 = "sm_80/drv535/triton3.6.0", "sm_90/drv550/triton3.6.0"
NOW = dt.datetime.now(dt.timezone.utc)


def detail(*strata: dict[str, Any]) -> dict[str, Any]:
    return {"id": 2, "state": "progressing", "steps": [{}, {}], "strata": list(strata)}


def stratum(name: str, state: str = "progressing", step: int = 0, reason: str | None = None,
            verdict: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"stratum": name, "state": state, "step_index": step, "reason": reason, "latest_verdict": verdict}


def evidence(ok: int, seconds_ago: float, slowest: float) -> StratumEvidence:
    return StratumEvidence(reports=ok, ok=ok, last_received=NOW - dt.timedelta(seconds=seconds_ago),
                           trial_s=[slowest / 2, slowest] * (ok // 2) + [slowest] * (ok % 2))


def check(watch: Watch, d: dict[str, Any], ev: dict[str, StratumEvidence]) -> str | None:
    return watch.check(Outcome("llm-fused@1.1.0", "promoted"), d, ev, NOW - dt.timedelta(seconds=5), Path("logs"),
                       now=NOW)


def test_a_paused_stratum_ends_the_rollout_naming_rollout_stratum_and_reason() -> None:
    hold = {"decision": "pause", "gate": "deadline", "evidence": {"reason": "inconclusive past the step deadline"}}
    problem = check(Watch(600), detail(stratum(S80), stratum(S90, "paused", 0, None, hold)),
                    {S80: evidence(4, 1, 20), S90: evidence(4, 1, 20)})
    assert problem == (f"rollout 2 (llm-fused@1.1.0), stratum {S90} at step 1/2: paused: pause (deadline): "
                       "inconclusive past the step deadline")


def test_slow_trials_are_not_a_failure_silence_beyond_them_is() -> None:
    slow = 120.0  # a trial on a machine busy enough to make it ten times slower than on a quiet one
    watch = Watch(600)
    quiet = STALL_FACTOR * slow - 60
    assert check(watch, detail(stratum(S80), stratum(S90)), {S80: evidence(3, quiet, slow),
                                                             S90: evidence(3, 1, slow)}) is None
    assert watch.quiet_limit() == max(STALL_FLOOR_S, STALL_FACTOR * slow)
    problem = check(watch, detail(stratum(S80), stratum(S90)), {S80: evidence(3, STALL_FACTOR * slow + 60, slow),
                                                                S90: evidence(3, 1, slow)})
    assert problem is not None and problem.startswith(f"rollout 2 (llm-fused@1.1.0), stratum {S80} at step 1/2: "
                                                      "no trial report from its canaries for 1260s"), problem
    assert "10x the slowest trial so far, 120s" in problem


def test_before_any_trial_the_limit_is_the_agents_trial_timeout() -> None:
    watch = Watch(600)
    assert watch.quiet_limit() == 600 + STALL_FLOOR_S
    assert check(watch, detail(stratum(S80)), {}) is None  # 5 s into the rollout, nothing yet: fine


def test_samples_without_a_decision_end_the_rollout_as_inconclusive() -> None:
    hold = {"decision": "hold", "gate": "latency", "evidence": {"reason": "latency:aggregate not yet within margin"}}
    watch = Watch(600)
    assert check(watch, detail(stratum(S80, verdict=hold)), {S80: evidence(SAMPLE_BUDGET - 1, 1, 10)}) is None
    problem = check(watch, detail(stratum(S80, verdict=hold)), {S80: evidence(SAMPLE_BUDGET, 1, 10)})
    assert problem == (f"rollout 2 (llm-fused@1.1.0), stratum {S80} at step 1/2: inconclusive after "
                       f"{SAMPLE_BUDGET} clean trial reports (the judge passed the demo's candidate after "
                       f"~{EXPECTED_SAMPLES} in every measured run); the judge: hold (latency): latency:aggregate not yet within margin")


def test_the_plan_deadline_outlasts_the_evidence_budget() -> None:
    plan = PlanSpec.model_validate(demo_plan(600.0))
    for step in plan.steps:  # two canaries' trials, each up to the agents' trial timeout
        assert step.deadline_seconds >= SAMPLE_BUDGET / 2 * 600.0
    assert plan.latency_margin == 0.25  # the demo's margin is unchanged


def _plans() -> list[Outcome]:
    return [Outcome("llm-fused@1.0.0", "promoted", state="promoted", ended=True),
            Outcome("llm-fused@1.1.0", "promoted", state="progressing"),
            Outcome("llm-fused@1.2.0-fault.drift", "rolled_back")]


def test_the_live_view_marks_rollouts_not_started_as_waiting() -> None:
    out = io.StringIO()
    view = LiveView(Console(file=out, width=160, force_terminal=False))
    view.planned(_plans())
    view.rollout(RolloutProgress(2, "llm-fused@1.1.0", "progressing", 42.0, [StratumProgress(
        S80, "progressing", 1, 2, 6, EXPECTED_SAMPLES, 6, 31.0, 3.0, "hold (latency): too few samples")]))
    Console(file=out, width=160).print(view.render())
    text = out.getvalue()
    assert "llm-fused@1.2.0-fault.drift: waiting (expected rolled_back)" in text
    assert "llm-fused@1.1.0: running" in text and "llm-fused@1.0.0: ok" in text
    assert "unexpected" not in text
    assert "elapsed" in text and f"6/~{EXPECTED_SAMPLES}" in text and "31s" in text


def test_plain_lines_say_the_address_at_once_and_the_samples_so_far_and_needed() -> None:
    out = io.StringIO()
    view = PlainView(Console(file=out, width=80), every_s=3600)
    view.link("http://127.0.0.1:1234", "kctl_viewer_x")
    assert "follow it in a browser: http://127.0.0.1:1234/ui/  (viewer token kctl_viewer_x)" in out.getvalue()
    view.planned(_plans())
    s = StratumProgress(S80, "progressing", 1, 2, 6, EXPECTED_SAMPLES, 7, 31.0, 3.0, "hold (latency): too few")
    progress = RolloutProgress(2, "llm-fused@1.1.0", "progressing", 42.0, [s])
    view.rollout(progress)
    view.rollout(progress)  # nothing changed: no second line before every_s
    lines = [ln for ln in out.getvalue().splitlines() if "rollout 2" in ln]
    assert len(lines) == 1, lines
    assert (f"{S80}: progressing, step 1/2, 6/~{EXPECTED_SAMPLES} clean samples, slowest trial 31s, last report 3s "
            "ago; judge: hold (latency): too few") in lines[0]
    assert "waiting" not in out.getvalue() and "unexpected" not in out.getvalue()
    assert "llm-fused@1.0.0: ok: promoted (expected promoted)" in out.getvalue()
