"""Trial before serve is a controller fact (issue 26 item 2), on SQLite and PostgreSQL.

A staged canary with no accepted report that claims the candidate active is refused by the one heartbeat rule
(``controller.desired.effects.heartbeat_effects``) whichever writer applies it: the single-row writer
(``registry.heartbeat``), the batch writer (``controller.switches``) and the replica's fast path (the hub). The
phase stays ``staged`` (never ``serving``, then ``verified`` when the claim is dropped), the reply keeps the
stable version active, and one ``security.unverified_serve`` event is written.
"""

from __future__ import annotations

import asyncio
import datetime as dt

import pytest

from controller import registry
from controller.desired.effects import RowFacts, heartbeat_effects
from controller.desired.hub import DesiredHub
from controller.desired.snapshot import load_snapshot
from controller.switches import Switch, Switched, record_switches
from kernelctl import wire
from tests.controller.enginekit import T0, Kit, generation_kit
from tests.controller.test_serve_phase import _phase, _send, _stable_and_candidate

UNVERIFIED = "security.unverified_serve"


@pytest.fixture
def kit(db_url, tmp_path):
    yield from generation_kit(db_url, tmp_path)


def _hb(kit: Kit, node: str, active: list[wire.BundleRef], at: dt.datetime) -> wire.DesiredBundle:
    with kit.tx() as s:
        (d,) = registry.heartbeat(s, wire.HeartbeatRequest(node_name=node, active=active), at,
                                  heartbeat_seconds=5).desired
    return d


def test_the_rule_refuses_an_unverified_serve_and_allows_a_verified_one() -> None:
    row = RowFacts("k", active_id=1, desired_id=2, stable_id=1, rollout_id=7, phase="staged", phase_at=T0)
    e = heartbeat_effects({"k": row}, {"k": 2}, T0)
    (k,) = e.rows.values()
    assert (k.row.phase, k.row.active_id, k.tag) == ("staged", 2, None) and k.refused
    e = heartbeat_effects({"k": k.row}, {"k": 2}, T0)  # the same claim again: nothing new to write
    assert e.liveness_only
    verified = RowFacts("k", 1, 2, 1, 7, "verified", T0)
    (v,) = heartbeat_effects({"k": verified}, {"k": 2}, T0 + dt.timedelta(seconds=1)).rows.values()
    assert (v.row.phase, v.tag, v.refused) == ("serving", (7, T0), None)
    early = RowFacts("k", 1, 2, 1, 7, "staged", T0, trial_first=False)  # the plan serves before its trial
    (x,) = heartbeat_effects({"k": early}, {"k": 2}, T0).rows.values()
    assert (x.row.phase, x.tag, x.refused) == ("serving", (7, None), None)


def test_single_row_writer_refuses_a_canary_claiming_an_unverified_candidate(kit: Kit) -> None:
    _rid, stable, cand = _stable_and_candidate(kit)
    t = [T0 + dt.timedelta(seconds=i) for i in range(5)]
    d = _hb(kit, "gpu-000", [cand], t[1])  # zero reports: a claim, not a fact
    assert (d.active, d.phase) == (stable, "staged")
    assert _phase(kit, "gpu-000") == "staged"
    d = _hb(kit, "gpu-000", [stable], t[2])  # and back: it never passed through serving to verified
    assert (d.active, d.phase) == (stable, "staged") and _phase(kit, "gpu-000") == "staged"
    (ev,) = kit.events(UNVERIFIED)
    assert (ev.node, ev.bundle) == ("gpu-000", cand.name + "@" + cand.version) and "refused" in ev.reason
    assert kit.events("assignment.verified") == []


def test_batch_writer_refuses_it_the_same_way(kit: Kit) -> None:
    rid, stable, cand = _stable_and_candidate(kit)
    snap = load_snapshot(kit.factory)
    view = snap.nodes["gpu-001"]
    ids = snap.reported(view, wire.HeartbeatRequest(node_name="gpu-001", active=[cand]))
    assert ids is not None
    with kit.tx() as s:
        (res,) = record_switches(s, [Switch(view.id, "gpu-001", ids, T0)])
    assert isinstance(res, Switched) and res.rows["llm-fused"][0].phase == "staged"
    assert _phase(kit, "gpu-001") == "staged"
    assert [e.node for e in kit.events(UNVERIFIED)] == ["gpu-001"]
    _send(kit, "gpu-001", rid, cand, stable, "ok", T0 + dt.timedelta(seconds=1))  # a passing report: now it may
    assert _hb(kit, "gpu-001", [cand], T0 + dt.timedelta(seconds=2)).phase == "serving"


def test_the_hub_never_answers_such_a_claim_with_the_candidate(kit: Kit, db_url: str) -> None:
    _rid, stable, cand = _stable_and_candidate(kit)

    async def run() -> list[tuple[wire.HeartbeatResponse, float, str]]:
        hub = DesiredHub(kit.factory, db_url, poll_seconds=60)
        await hub.start()
        try:
            out = []
            for active in ([cand], [cand], [stable]):
                out.append(await hub.heartbeat(wire.HeartbeatRequest(node_name="gpu-000", active=active),
                                               heartbeat_seconds=5))
            return out
        finally:
            await hub.stop()

    replies = asyncio.run(run())
    assert [p for _r, _h, p in replies] == ["switch", "fast", "switch"]  # the repeated claim: nothing to write
    assert all((r.desired[0].active, r.desired[0].phase) == (stable, "staged") for r, _h, _p in replies)
    assert _phase(kit, "gpu-000") == "staged"
    assert len(kit.events(UNVERIFIED)) == 1
