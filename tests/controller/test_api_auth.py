"""Auth against a REAL `kernelctl serve` (uvicorn on loopback), on SQLite and PostgreSQL: 401/403 by role and
node, viewers change nothing, tokens never appear in the server's logs."""

from __future__ import annotations

import httpx

from tests.controller.serverutil import (
    ControllerProcess,
    TestBundles,
    controller_fixtures,
    register_node,
)

bundles, ctl = controller_fixtures("auth")


def test_no_and_unknown_token_401(ctl: ControllerProcess) -> None:
    for path in ("/v1/bundles", "/v1/rollouts", "/v1/nodes", "/v1/audit", "/v1/compat"):
        r = httpx.get(ctl.url + path)
        assert r.status_code == 401, path
        assert "missing bearer token" in r.json()["detail"]
        assert r.headers["www-authenticate"] == "Bearer"
    with ctl.client(token="kctl_not-a-real-token-at-all") as c:
        r = c.get("/v1/bundles")
        assert r.status_code == 401 and r.json() == {"detail": "unknown token"}
    r = httpx.get(ctl.url + "/v1/bundles", headers={"Authorization": "Basic Zm9vOmJhcg=="})
    assert r.status_code == 401 and "malformed Authorization" in r.json()["detail"]


def test_viewer_reads_but_changes_nothing(ctl: ControllerProcess, bundles: TestBundles) -> None:
    with ctl.client("viewer") as v, ctl.client("operator") as op:
        before = op.get("/v1/audit", params={"limit": 1000}).json()
        for path in ("/v1/bundles", "/v1/rollouts", "/v1/nodes", "/v1/compat", "/v1/audit"):
            assert v.get(path).status_code == 200, path
        attempts = [
            v.post("/v1/bundles", content=bundles.files["1.0.0"].read_bytes()),
            v.post("/v1/rollouts", json={"bundle": "llm-fused@1.0.0"}),
            v.post("/v1/rollouts/1/promote", json={"reason": "x"}),
            v.post("/v1/rollouts/1/rollback", json={"reason": "x"}),
            v.post("/v1/rollouts/1/pause", json={}),
            v.post("/v1/rollouts/1/resume", json={}),
            v.post("/v1/agents/register", json={"node_name": "gpu-v", "inventory": {}}),
        ]
        for r in attempts:
            assert r.status_code in (403, 422), r.request.url
        assert all(r.status_code == 403 for r in attempts[:6])
        assert "role 'viewer' may not do this" in attempts[0].json()["detail"]
        after = op.get("/v1/audit", params={"limit": 1000}).json()
        assert after == before  # not one event: nothing changed
        assert op.get("/v1/bundles").json() == []


def test_agent_tokens_bound_to_their_node(ctl: ControllerProcess) -> None:
    n1 = register_node(ctl, "gpu-auth-1")
    n2 = register_node(ctl, "gpu-auth-2")
    with n1, n2, ctl.client("enroll") as enroll, ctl.client("operator") as op:
        assert n1.post("/v1/agents/heartbeat", json={"node_name": "gpu-auth-1"}).status_code == 200
        r = n1.post("/v1/agents/heartbeat", json={"node_name": "gpu-auth-2"})
        assert r.status_code == 403 and "belongs to node 'gpu-auth-1'" in r.json()["detail"]
        r = n1.post("/v1/agents/reports", json={"node_name": "gpu-auth-2", "reports": [_dummy_report()]})
        assert r.status_code == 403
        # a node token cannot re-register as another node, nor act as operator/viewer
        r = n1.post("/v1/agents/register", json={"node_name": "gpu-auth-2", "inventory": _inv()})
        assert r.status_code == 403
        assert n1.get("/v1/rollouts").status_code == 403
        assert n1.post("/v1/rollouts", json={"bundle": "llm-fused@1.0.0"}).status_code == 403
        # the enrollment token only registers
        r = enroll.post("/v1/agents/heartbeat", json={"node_name": "gpu-auth-1"})
        assert r.status_code == 403 and "enrollment token may only register" in r.json()["detail"]
        assert enroll.get("/v1/bundles/llm-fused/1.0.0/content").status_code == 403
        # operators cannot pose as agents
        assert op.post("/v1/agents/heartbeat", json={"node_name": "gpu-auth-1"}).status_code == 403
        # n2's state was never touched by n1's refused calls
        events = op.get("/v1/audit", params={"node": "gpu-auth-2"}).json()
        assert {e["action"] for e in events} <= {"node.registered", "token.created"}


def test_tokens_never_logged(ctl: ControllerProcess) -> None:
    node = register_node(ctl, "gpu-auth-log")
    with node:
        node.post("/v1/agents/heartbeat", json={"node_name": "gpu-auth-log"})
        node_token = node.headers["authorization"].split()[1]
    with ctl.client("operator") as op:
        op.get("/v1/bundles")
        op.get("/v1/nodes")
    httpx.get(ctl.url + "/v1/nodes", headers={"Authorization": "Bearer kctl_wrong-token-value-123456"})
    log = ctl.log_text()
    assert '"GET /v1/nodes HTTP/1.1" 200' in log  # the access log is on, and it saw these requests
    for secret in (*ctl.tokens.values(), node_token, "kctl_wrong-token-value-123456"):
        assert secret not in log
    assert "authorization" not in log.lower()


def _inv() -> dict:
    from tests.controller.serverutil import inventory

    return inventory()


def _dummy_report() -> dict:
    digest = "0" * 64
    ref = {"name": "llm-fused", "version": "1.0.0", "digest": digest}
    return {"idempotency_key": "auth-test-0001", "rollout_id": 1, "stratum": "sm_90/drv550/triton3.6.0",
            "candidate": ref, "stable": None, "outcome": "ok", "measured_at": "2026-11-22T00:00:00Z"}

