"""Webhook notifications from the changelog: real transitions on both databases, a real HTTP receiver on
loopback (no mocks), retries, failures recorded as events, no double delivery after a restart, no secrets
in logs or events, bad settings refused at start-up with the setting named."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import select

from controller import rollouts
from controller.db.models import Event, Verdict
from controller.notify import DELIVERED, FAILED, Notifier, NotifyConfigError, Target, parse_targets, redact
from controller.rollouts import get_rollout, promote, start_rollout
from tests.controller.enginekit import T0, Kit
from tests.controller.serverutil import REPO_ROOT, cli_command
from tests.controller.webhook import WebhookReceiver

S90 = "sm_90/drv550/triton3.6.0"


@pytest.fixture
def kit(db_url: str, tmp_path: Path):
    k = Kit(db_url, tmp_path)
    yield k
    k.close()


@pytest.fixture
def hook():
    with WebhookReceiver() as r:
        yield r


def _notifier(kit: Kit, url: str, **kw) -> Notifier:
    kw = {"settle": 0.0, "backoff": 0.01, "timeout": 2.0, **kw}
    return Notifier(kit.factory, parse_targets(url), **kw)


def _history(kit: Kit) -> None:
    """1.0.0 promoted by the operator; 1.1.0 advanced a step, then rolled back by the judge (numeric gate);
    1.2.0 paused by the judge as inconclusive."""
    kit.nodes(4, prefix="h", arch="sm_90")
    kit.push("1.0.0")
    with kit.tx() as s:
        rid = start_rollout(s, "llm-fused@1.0.0", actor="alice", reason="first").id
    with kit.tx() as s:
        promote(s, rid, actor="alice", full=True, reason="initial")
    kit.push("1.1.0")
    with kit.tx() as s:
        rid = start_rollout(s, "llm-fused@1.1.0", actor="alice", reason="new gelu").id
    with kit.tx() as s:
        rollouts.begin(s, get_rollout(s, rid), actor="controller", now=T0)
    with kit.tx() as s:
        promote(s, rid, actor="bob", to_step=1, reason="looks fine")
    with kit.tx() as s:  # what a tick does for a rollback verdict: the transition and the verdict, one commit
        r = get_rollout(s, rid)
        rollouts.rollback_strata(s, r, [r.strata[0]], actor="controller", now=T0, mark_incompatible=True,
                                 reason="judge: numeric error 0.31 > atol 0.01 on add_rmsnorm",
                                 evidence={"gate": "numeric"})
        s.add(Verdict(rollout_id=rid, stratum=S90, step_index=1, at=T0, decision="rollback", gate="numeric",
                      samples=4, evidence={"reason": "numeric error 0.31 > atol 0.01 on add_rmsnorm",
                                           "max_abs_err": 0.31, "op": "add_rmsnorm", "detail": {"x": [1, 2]}}))
    kit.push("1.2.0")
    with kit.tx() as s:
        rid = start_rollout(s, "llm-fused@1.2.0", actor="alice").id
    with kit.tx() as s:
        rollouts.begin(s, get_rollout(s, rid), actor="controller", now=T0)
    with kit.tx() as s:
        r = get_rollout(s, rid)
        rollouts.pause_stratum(s, r, r.strata[0], actor="controller", now=T0,
                               reason="judge: inconclusive: deadline passed with 2 of 3 samples")
        s.add(Verdict(rollout_id=rid, stratum=S90, step_index=0, at=T0, decision="pause", gate="latency",
                      samples=2, evidence={"reason": "inconclusive: deadline passed with 2 of 3 samples"}))


def test_every_transition_is_delivered_once_with_text_and_fields(kit: Kit, hook: WebhookReceiver) -> None:
    n = _notifier(kit, hook.url)
    target = n.targets[0]
    assert n.run_once(target) == 0  # first run: the cursor starts at the changelog's head
    _history(kit)
    handled = n.run_once(target)
    kinds = [(b["kind"], b["bundle"]) for b in hook.bodies]
    assert kinds == [
        ("started", "llm-fused@1.0.0"), ("stratum_promoted", "llm-fused@1.0.0"), ("promoted", "llm-fused@1.0.0"),
        ("started", "llm-fused@1.1.0"), ("step_advanced", "llm-fused@1.1.0"), ("rolled_back", "llm-fused@1.1.0"),
        ("started", "llm-fused@1.2.0"), ("paused", "llm-fused@1.2.0"),
    ]
    assert handled == len(kinds)
    by_kind = {b["kind"]: b for b in hook.bodies}
    rb = by_kind["rolled_back"]
    assert rb["gate"] == "numeric" and rb["stratum"] == S90 and rb["rollout_state"] == "rolled_back"
    assert rb["reason"].startswith("judge: numeric error 0.31")
    assert rb["evidence"]["max_abs_err"] == 0.31 and rb["evidence"]["op"] == "add_rmsnorm"
    assert "detail" not in rb["evidence"]  # a summary: nested detail stays in the changelog
    assert "ROLLED BACK in sm_90" in rb["text"] and "gate numeric" in rb["text"] and "0.31" in rb["text"]
    paused = by_kind["paused"]
    assert "inconclusive" in paused["text"] and paused["evidence"]["gate"] == "latency"
    assert by_kind["step_advanced"]["text"].endswith("advanced to step 2 in " + S90 + ": looks fine")
    assert by_kind["step_advanced"]["step"] == 2 and rb["evidence"]["step"] == 2  # one numbering: from 1
    # the state when it happened, not when it was sent (every rollout here has ended by now)
    assert [b["rollout_state"] for b in hook.bodies if b["kind"] == "started"] == ["pending"] * 3
    assert by_kind["step_advanced"]["rollout_state"] == "progressing"
    assert by_kind["stratum_promoted"]["text"] == f"rollout 1: llm-fused@1.0.0 promoted in {S90} (at step 1): initial"
    assert all(b["url"] is None for b in hook.bodies)  # no KERNELCTL_PUBLIC_URL: no link
    assert all(isinstance(b["text"], str) and b["event_id"] for b in hook.bodies)
    assert all(r["headers"]["Content-Type"] == "application/json" for r in hook.requests)
    delivered = kit.events(DELIVERED)
    assert [e.payload["event_id"] for e in delivered] == [b["event_id"] for b in hook.bodies]
    assert all(e.payload["status"] == 200 and e.payload["attempts"] == 1 for e in delivered)

    # nothing twice: neither on the next run, nor after a restart (a new notifier reads its cursor back)
    assert n.run_once(target) == 0
    n.stop(drain_seconds=1)
    again = _notifier(kit, hook.url)
    assert again.run_once(again.targets[0]) == 0
    assert len(hook.bodies) == len(kinds)
    with kit.tx() as s:  # and a new transition after the restart is delivered
        rid = s.scalar(select(Event.rollout_id).where(Event.bundle == "llm-fused@1.2.0",
                                                   Event.action == "rollout.started"))
        rollouts.rollback(s, rid, actor="carol", reason="giving up on 1.2.0")
    assert again.run_once(again.targets[0]) == 1
    last = hook.bodies[-1]
    assert last["kind"] == "rolled_back" and last["actor"] == "carol" and last["evidence"] is None
    again.stop(drain_seconds=1)


def test_not_leading_delivers_nothing(kit: Kit, hook: WebhookReceiver) -> None:
    leading = {"now": False}
    n = _notifier(kit, hook.url, is_leader=lambda: leading["now"])
    assert n.run_once(n.targets[0]) == 0
    leading["now"] = True
    assert n.run_once(n.targets[0]) == 0  # cursor at the head when it first leads
    _history(kit)
    leading["now"] = False
    assert n.run_once(n.targets[0]) == 0 and hook.bodies == []
    leading["now"] = True
    assert n.run_once(n.targets[0]) == 8 and len(hook.bodies) == 8
    n.stop(drain_seconds=1)


def test_partly_promoted_rollout_is_said_so_with_a_link(kit: Kit, hook: WebhookReceiver) -> None:
    """One stratum promoted by the judge, the other rolled back by an operator: a stratum_promoted message, a
    rolled_back message and a partly_promoted one (never "promoted"), each with the rollout's state when it
    happened and a link to the rollout's page."""
    n = _notifier(kit, hook.url, public_url="https://kctl.example.com/")
    n.run_once(n.targets[0])
    s80 = "sm_80/drv550/triton3.6.0"
    kit.nodes(2, prefix="h", arch="sm_90")
    kit.nodes(2, prefix="a", arch="sm_80")
    kit.push("1.1.0", archs=("sm_90", "sm_80"))
    with kit.tx() as s:
        rid = start_rollout(s, "llm-fused@1.1.0", actor="alice").id
    with kit.tx() as s:
        rollouts.begin(s, get_rollout(s, rid), actor="controller", now=T0)
    with kit.tx() as s:
        r = get_rollout(s, rid)
        rollouts.promote_stratum(s, r, next(x for x in r.strata if x.stratum == S90), actor="controller", now=T0,
                                 reason="judge: within margin")
    with kit.tx() as s:
        rollouts.rollback(s, rid, actor="operator:bob", reason="p99 regressed on A100")
    n.run_once(n.targets[0])
    got = [(b["kind"], b["rollout_state"], b["stratum"]) for b in hook.bodies]
    assert got == [("started", "pending", None), ("stratum_promoted", "progressing", S90),
                   ("rolled_back", "partly_promoted", s80), ("partly_promoted", "partly_promoted", None)]
    page = f"https://kctl.example.com/ui/#/rollouts/{rid}"
    assert all(b["url"] == page and b["text"].endswith(f" <{page}>") for b in hook.bodies)
    last = hook.bodies[-1]
    assert (last["promoted"], last["rolled_back"]) == ([S90], [s80])
    assert last["text"].startswith(f"rollout {rid}: llm-fused@1.1.0 PARTLY PROMOTED: promoted on {S90}; "
                                   f"rolled back on {s80}: {s80}: p99 regressed on A100")
    assert not any(b["kind"] == "promoted" or "promoted on every" in b["text"] for b in hook.bodies)
    n.stop(drain_seconds=1)


def test_retries_then_delivery(kit: Kit, hook: WebhookReceiver) -> None:
    hook.statuses = [500, 503, 200]
    n = _notifier(kit, hook.url, attempts=4)
    n.run_once(n.targets[0])
    kit.push("1.0.0")
    kit.nodes(1)
    with kit.tx() as s:
        start_rollout(s, "llm-fused@1.0.0", actor="alice")
    assert n.run_once(n.targets[0]) == 1
    assert [r["status"] for r in hook.requests] == [500, 503, 200]
    [ev] = kit.events(DELIVERED)
    assert ev.payload["attempts"] == 3 and ev.payload["status"] == 200
    n.stop(drain_seconds=1)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("failure", ["http500", "unreachable", "slow", "http404"])
def test_a_failing_webhook_is_recorded_logged_once_and_skipped(failure: str, kit: Kit, hook: WebhookReceiver,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    url = hook.url
    if failure == "http500":
        hook.statuses = [500]
    elif failure == "unreachable":
        url = f"http://127.0.0.1:{_closed_port()}/hook"
    elif failure == "slow":
        hook.delay = 1.5
    else:
        hook.statuses = [404]
    n = _notifier(kit, url, attempts=3, timeout=0.3)
    n.run_once(n.targets[0])
    kit.push("1.0.0")
    kit.nodes(1)
    with kit.tx() as s:
        start_rollout(s, "llm-fused@1.0.0", actor="alice")
        start_rollout(s, "llm-fused@1.0.0", actor="alice")  # idempotent: one event
    with caplog.at_level(logging.WARNING, logger="kernelctl.notify"):
        started = time.monotonic()
        assert n.run_once(n.targets[0]) == 1
        took = time.monotonic() - started
    [ev] = kit.events(FAILED)
    assert ev.action == FAILED and ev.actor == "notifier" and ev.reason
    expected = {"http500": (3, 500, "HTTP 500"), "unreachable": (3, None, "ConnectError"),
                "slow": (3, None, "ReadTimeout"), "http404": (1, 404, "HTTP 404 (not retried)")}[failure]
    assert (ev.payload["attempts"], ev.payload["status"]) == expected[:2]
    assert expected[2] in ev.reason
    lines = [r for r in caplog.records if r.name == "kernelctl.notify"]
    assert len(lines) == 1 and "failed after" in lines[0].getMessage() and expected[2] in lines[0].getMessage()
    assert took < 5.0
    assert n.run_once(n.targets[0]) == 0  # the cursor moved on: carry on with the next event
    n.stop(drain_seconds=1)


def test_secrets_in_urls_never_reach_events_or_logs(kit: Kit, hook: WebhookReceiver,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    secret_url = f"http://bot:hunter2@127.0.0.1:{hook.port}/services/T0/SECRETPATH?token=s3cr3t"
    hook.statuses = [500, 500, 200, 200, 500]
    n = _notifier(kit, secret_url, attempts=2, period=600)
    with caplog.at_level(logging.DEBUG):  # httpx logs every request URL at INFO: it must be redacted
        n.start()  # logs its targets
        n.run_once(n.targets[0])
        kit.push("1.0.0")
        kit.nodes(1)
        with kit.tx() as s:
            rid = start_rollout(s, "llm-fused@1.0.0", actor="alice").id
        with kit.tx() as s:
            promote(s, rid, actor="alice", full=True)
        # started: 500, 500 -> failed; stratum promoted, promoted: 200 -> delivered
        assert n.run_once(n.targets[0]) == 3
        n.stop(drain_seconds=5)
    assert hook.requests[0]["path"] == "/services/T0/SECRETPATH?token=s3cr3t"  # the real URL was used
    assert hook.requests[0]["headers"]["Authorization"].startswith("Basic ")
    events = kit.events(FAILED) + kit.events(DELIVERED)
    assert [e.action for e in events] == [FAILED, DELIVERED, DELIVERED]
    assert "HTTP Request: POST" in caplog.text and "notifications to" in caplog.text
    dumped = json.dumps([[e.subject, e.reason, e.payload] for e in events]) + caplog.text
    for secret in ("hunter2", "SECRETPATH", "s3cr3t", "bot:"):
        assert secret not in dumped
    assert events[0].payload["target"] == f"http://***@127.0.0.1:{hook.port}/services/***?***"


def test_redact_and_parse() -> None:
    assert redact("https://hooks.slack.com/services/T00/B00/XXXX") == "https://hooks.slack.com/services/***"
    assert redact("http://u:p@[::1]:8080/a?b=c") == "http://***@[::1]:8080/a?***"
    assert [t.url for t in parse_targets(" http://a.example/x , https://b.example ,, http://a.example/x")] == [
        "http://a.example/x", "https://b.example"]
    assert parse_targets("") == [] and parse_targets(None) == []
    assert Target("http://a.example/x").id == Target("http://a.example/x").id != Target("http://b.example").id
    for bad in ("ftp://user:pw@files.example/drop", "hooks.slack.com/services/x", "http://", "http://h:0/x",
                "https://h:99999/x"):
        with pytest.raises(NotifyConfigError, match=r"^KERNELCTL_NOTIFY_URLS: entry 2 \(") as info:
            parse_targets(f"http://ok.example,{bad}")
        assert "pw" not in str(info.value)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNELCTL_")}
    return {**env, **extra}


def test_serve_refuses_a_bad_notify_url_naming_the_setting(tmp_path: Path) -> None:
    db = tmp_path / "k.db"
    proc = subprocess.run([*cli_command(), "serve", "--port", "0", "--db", f"sqlite:///{db}"], cwd=REPO_ROOT,
                          env=_env(KERNELCTL_NOTIFY_URLS="https://ok.example/h,ftp://bot:pw@x.example/hook"),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "KERNELCTL_NOTIFY_URLS: entry 2" in err[0] and "pw" not in proc.stderr
    assert not db.exists()  # refused before anything was created


def test_notify_test_command(hook: WebhookReceiver) -> None:
    ok = subprocess.run([*cli_command(), "notify", "test", "--json"], cwd=REPO_ROOT, capture_output=True,
                        text=True, timeout=60, env=_env(KERNELCTL_NOTIFY_URLS=hook.url + "?key=abc"))
    assert ok.returncode == 0, ok.stderr
    [row] = json.loads(ok.stdout)
    assert row["ok"] and row["status"] == 200 and "abc" not in ok.stdout
    assert hook.bodies[0]["kind"] == "test" and hook.bodies[0]["text"].startswith("kernelctl: test notification")
    hook.statuses = [500]
    bad = subprocess.run([*cli_command(), "notify", "test", "--url", hook.url], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=60, env=_env())
    assert bad.returncode == 1 and "failed after 2 attempt(s): HTTP 500" in bad.stdout
    none = subprocess.run([*cli_command(), "notify", "test"], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=60, env=_env())
    assert none.returncode == 2 and "KERNELCTL_NOTIFY_URLS" in none.stderr


def test_demo_refuses_a_bad_notify_url_before_starting_anything() -> None:
    proc = subprocess.run([sys.executable, "-m", "cli.app", "demo", "--notify-url", "hooks.example/x?k=sekret"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, env=_env())
    assert proc.returncode == 2, proc.stderr
    assert "KERNELCTL_NOTIFY_URLS: entry 1" in proc.stderr and "sekret" not in proc.stderr + proc.stdout
