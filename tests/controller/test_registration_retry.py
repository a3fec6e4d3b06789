"""Registration that survives lost replies and bad neighbours (issues 26 item 4, 28), on SQLite and PostgreSQL.

* Idempotent: a retry of a registration whose reply was lost (same registration key, enrollment token) gets the
  same node and a valid token; an enrollment token without that key cannot take an existing node over.
* Ordered: an attempt answered after its own retry (queued behind load) is refused rather than revoking the
  token the retry issued (the agent stamps each attempt when it sends it).
* Per-item: each row of a group-committed batch is checked as the database will check it
  (``controller.db.fit``): a value that does not fit its column (``memory_total_mb = 2**31`` in an INTEGER) is
  refused for its own request only; and should a refusal slip past that check, the group commit writes the
  batch's items one by one, so it still fails only its own request.
* Over HTTP through a proxy that loses the first reply: the agent client retries and is registered once.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from sqlalchemy import func, select

from agents.client import ControllerClient
from controller import enrollment
from controller.auth import authenticate
from controller.db.models import Node
from controller.desired.writers import Writers
from controller.enrollment import Registered, Registration, register_many
from controller.errors import Conflict, Invalid
from kernelctl import wire
from tests.agents.proxy import Proxy
from tests.controller.enginekit import T0, Kit, inventory
from tests.controller.serverutil import ControllerProcess, Zygote

KEY = "k" * 40


@pytest.fixture
def kit(db_url, tmp_path):
    k = Kit(db_url, tmp_path)
    yield k
    k.close()


def _reg(name: str, key: str | None = None, sent_at_ns: int | None = None, **inv) -> Registration:
    raw = {**inventory().model_dump(), **inv}
    return Registration(wire.RegisterRequest.model_construct(
        node_name=name, inventory=wire.Inventory.model_construct(**raw), registration_key=key,
        sent_at_ns=sent_at_ns), "agent:enroll", True)


def test_a_retry_with_the_registration_key_gets_the_same_node_and_a_fresh_token(kit: Kit) -> None:
    with kit.tx() as s:
        (first,) = register_many(s, [_reg("gpu-0", KEY)], now=T0)  # the reply is lost
    with kit.tx() as s:
        (again,) = register_many(s, [_reg("gpu-0", KEY)], now=T0)
        (thief,) = register_many(s, [_reg("gpu-0", "x" * 40)])
        (keyless,) = register_many(s, [_reg("gpu-0")])
    assert isinstance(first, Registered) and isinstance(again, Registered)
    assert again.node_id == first.node_id and again.token != first.token
    assert isinstance(thief, Conflict) and isinstance(keyless, Conflict)  # no takeover without the key
    with kit.tx() as s:
        assert authenticate(s, again.token).node == "gpu-0"
        with pytest.raises(Exception, match="revoked"):
            authenticate(s, first.token)  # the lost reply's token is no longer valid
        assert s.scalar(select(func.count()).select_from(Node)) == 1


def test_a_retry_in_the_same_batch_as_its_lost_original_gets_the_same_node(kit: Kit) -> None:
    """Under load the original (its agent timed out) and the retry can be committed in one batch."""
    with kit.tx() as s:
        first, again, other = register_many(s, [_reg("gpu-1", KEY), _reg("gpu-1", KEY), _reg("gpu-1", "y" * 40)])
    assert isinstance(first, Registered) and isinstance(again, Registered) and isinstance(other, Conflict)
    assert again.node_id == first.node_id
    with kit.tx() as s:
        assert authenticate(s, again.token).node == "gpu-1"  # the retry's token is the live one


def test_an_original_answered_after_its_retry_does_not_revoke_the_retry_token(kit: Kit) -> None:
    """Issue 28 (run C): the agent timed out on its first attempt and sent another; the first, queued behind the
    load, is taken after the second. It must not revoke the token the agent now holds (a 401 there sends the
    agent to register again: a cascade); it is refused and changes nothing. The order is the agent's own (each
    attempt stamped when sent), not the server's, whose event loop may start a late request's handler last."""
    original = _reg("gpu-late", KEY, sent_at_ns=1_000)
    retry = _reg("gpu-late", KEY, sent_at_ns=2_000, driver_version="560.28.03")
    with kit.tx() as s:
        (got,) = register_many(s, [retry])  # the retry is taken first
    with kit.tx() as s:
        (late,) = register_many(s, [original])
        (again,) = register_many(s, [_reg("gpu-late", KEY, sent_at_ns=2_000)])  # the same attempt twice
    assert isinstance(got, Registered) and isinstance(late, Conflict) and "superseded" in str(late)
    assert isinstance(again, Conflict)
    with kit.tx() as s:  # nothing changed: the retry's inventory and token stand
        assert s.scalar(select(Node.driver_version).where(Node.name == "gpu-late")) == "560.28.03"
        assert authenticate(s, got.token).node == "gpu-late"
    with kit.tx() as s:  # a later attempt, through the node's own token or the enrollment token, still rotates
        (own,) = register_many(s, [dataclasses.replace(_reg("gpu-late", KEY, sent_at_ns=3_000), new_only=False)])
        (later,) = register_many(s, [_reg("gpu-late", KEY, sent_at_ns=4_000)])
        (unstamped,) = register_many(s, [_reg("gpu-late", KEY)])  # an agent that does not stamp: as before
    assert all(isinstance(r, Registered) for r in (own, later, unstamped))
    with kit.tx() as s:
        assert authenticate(s, unstamped.token).node == "gpu-late"
        for old in (got, own, later):
            with pytest.raises(Exception, match="revoked"):
                authenticate(s, old.token)


def test_re_registrations_are_written_together_and_the_latest_attempt_of_a_node_wins(kit: Kit) -> None:
    """A storm of retries (issue 28): many nodes registering again in one batch, some with several attempts
    queued together. Per node the latest attempt is taken (the earlier ones are answered superseded: their agent
    timed out on them), its inventory and the state active written, its earlier tokens revoked, one token live;
    the changelog says what changed, per node, as a registration one at a time did."""
    with kit.tx() as s:
        first = register_many(s, [_reg(f"gpu-s{i}", KEY, sent_at_ns=100) for i in range(4)], now=T0)
        s.execute(Node.__table__.update().where(Node.name == "gpu-s1").values(state="stale"))
    batch = [_reg("gpu-s0", KEY, sent_at_ns=200), _reg("gpu-s0", KEY, sent_at_ns=300, driver_version="580.1"),
             _reg("gpu-s1", KEY, sent_at_ns=200), _reg("gpu-s2", KEY, sent_at_ns=50),  # older than its last
             _reg("gpu-s3", KEY, sent_at_ns=400), _reg("gpu-s3", KEY, sent_at_ns=300)]  # the older one queued last
    with kit.tx() as s:
        out = register_many(s, batch, now=T0)
    assert isinstance(out[0], Conflict) and "superseded" in str(out[0])
    assert isinstance(out[1], Registered) and not out[1].new and out[1].node_id == first[0].node_id
    assert isinstance(out[2], Registered) and isinstance(out[4], Registered)
    assert isinstance(out[3], Conflict) and isinstance(out[5], Conflict)
    with kit.tx() as s:
        rows = {r.name: r for r in s.execute(select(Node.name, Node.state, Node.driver_version,
                                                    Node.registration_sent_ns))}
        for name, reply in (("gpu-s0", out[1]), ("gpu-s1", out[2]), ("gpu-s3", out[4])):
            assert authenticate(s, reply.token).node == name
        for old in first[:2] + first[3:]:
            with pytest.raises(Exception, match="revoked"):
                authenticate(s, old.token)
        assert authenticate(s, first[2].token).node == "gpu-s2"  # its late attempt changed nothing
    assert rows["gpu-s0"].driver_version == "580.1" and rows["gpu-s0"].registration_sent_ns == 300
    assert rows["gpu-s1"].state == "active" and rows["gpu-s3"].registration_sent_ns == 400
    assert rows["gpu-s2"].registration_sent_ns == 100
    node_events = {n: [e.action for e in kit.events(node=n)][1:] for n in ("gpu-s0", "gpu-s1", "gpu-s2")}
    assert node_events["gpu-s0"] == ["token.created", "node.inventory_changed", "token.revoked", "token.created",
                                     "token.node_reissued"], node_events
    assert node_events["gpu-s1"] == ["token.created", "node.active", "token.revoked", "token.created",
                                     "token.node_reissued"], node_events
    assert node_events["gpu-s2"] == ["token.created"], node_events
    assert kit.events("node.inventory_changed")[-1].payload["driver_version"]["to"] == "580.1"


def test_a_row_that_does_not_fit_its_column_is_refused_alone(kit: Kit) -> None:
    items = [_reg(f"gpu-{i:02d}") for i in range(36)]
    items[17] = _reg("gpu-17", memory_total_mb=2**31)  # one past INTEGER's range
    with kit.tx() as s:
        out = register_many(s, items, now=T0)
    assert isinstance(out[17], Invalid) and "memory_total_mb" in str(out[17])
    assert all(isinstance(o, Registered) for i, o in enumerate(out) if i != 17)
    with kit.tx() as s:
        assert s.scalar(select(func.count()).select_from(Node)) == 35


def test_a_refusal_the_check_misses_still_fails_only_its_own_request(kit: Kit, monkeypatch, db_backend: str) -> None:
    monkeypatch.setattr(enrollment, "row_problem", lambda _table, _row: None)  # as if the check missed it

    async def run() -> list[object]:
        writers = Writers(kit.factory)
        writers.start()
        try:
            items = [_reg(f"gpu-{i:02d}") for i in range(36)]
            items[5] = _reg("gpu-05", memory_total_mb=2**31)
            return await asyncio.gather(*(writers.registrations.submit(it) for it in items), return_exceptions=True)
        finally:
            await writers.stop()

    out = asyncio.run(run())
    others = [o for i, o in enumerate(out) if i != 5]
    assert all(isinstance(o, Registered) for o in others), [o for o in others if not isinstance(o, Registered)]
    if db_backend == "postgres":  # SQLite stores 64-bit integers: only PostgreSQL refuses it
        assert isinstance(out[5], Exception) and "out of range" in str(out[5])


def test_agent_client_retries_a_lost_registration_reply_and_gets_its_node(db_url: str, tmp_path,
                                                                          zygote: Zygote) -> None:
    with ControllerProcess(db_url, tmp_path, zygote=zygote) as ctl, Proxy(ctl.url) as proxy:
        lost: list[str] = []

        def lose_first(path: str) -> bool:
            if path.endswith("/agents/register") and not lost:
                lost.append(path)
                return True
            return False

        proxy.lose = lose_first
        req = wire.RegisterRequest(node_name="gpu-lost", inventory=inventory(), registration_key=KEY)
        client = ControllerClient(proxy.url, ctl.tokens["enroll"], backoff_initial=0.05, backoff_max=0.2)
        try:
            reply = client.register(req)
            hb = client.heartbeat(wire.HeartbeatRequest(node_name="gpu-lost"))
        finally:
            client.close()
        assert lost and reply.node_name == "gpu-lost" and hb.node_name == "gpu-lost"
        assert [s for m, p, s in proxy.requests if p.endswith("/agents/register")] == [200, 200]  # both committed
        with ctl.client("enroll") as c:  # the enrollment token without the key: no takeover
            r = c.post("/v1/agents/register", json={"node_name": "gpu-lost",
                                                    "inventory": inventory().model_dump()})
            assert r.status_code == 409, r.text
        with ctl.client("operator") as op:
            nodes = [n["name"] for n in op.get("/v1/nodes").json()]
            assert nodes.count("gpu-lost") == 1
            audit = op.get("/v1/audit", params={"node": "gpu-lost"}).json()
        assert sum(1 for e in audit if e["action"] == "node.registered") == 1


