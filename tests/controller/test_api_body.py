"""controller.api.body.json_body answers exactly as a FastAPI body parameter of the same model: the same model
for every body FastAPI accepts, the same status and error list (``loc`` from ``body``) for every body it
refuses. Two routes of one real FastAPI app, one declaring ``wire.ReportBatch``, one reading it with
``json_body``, get the same requests."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient

from controller.api.body import json_body, openapi_body
from kernelctl import wire
from tests.controller.serverutil import ok_report

TRIAL = {"rollout_id": 7, "stratum": "sm_90/drv550/triton3.6.0",
         "candidate": {"name": "llm-fused", "version": "1.0.0", "digest": "a" * 64}, "stable": None}


@pytest.fixture(scope="module")
def client() -> TestClient:
    app = FastAPI()

    @app.exception_handler(RequestValidationError)
    async def _errors(_r: Request, exc: RequestValidationError) -> JSONResponse:
        # ascii(): the errors' inputs may hold NaN or a lone surrogate, which JSON cannot carry
        return JSONResponse({"detail": ascii(exc.errors()), "locs": [list(e["loc"]) for e in exc.errors()]}, 422)

    @app.post("/declared")
    async def declared(batch: wire.ReportBatch) -> Any:
        return {"batch": ascii(batch.model_dump())}

    @app.post("/fast", openapi_extra=openapi_body(wire.ReportBatch))
    async def fast(request: Request) -> Any:
        return {"batch": ascii((await json_body(request, wire.ReportBatch)).model_dump())}

    return TestClient(app)


def _batch(**change: Any) -> dict:
    report = {**ok_report("body-key-000001", TRIAL), **change}
    return {"node_name": "gpu-body-1", "reports": [report]}


def _nan(field: str) -> bytes:
    doc = _batch()
    doc["reports"][0]["latency"][0][field] = "__NAN__"
    return json.dumps(doc).replace('"__NAN__"', "NaN").encode()


JSON = {"Content-Type": "application/json"}
CASES: list[tuple[str, bytes, dict[str, str]]] = [
    ("valid", json.dumps(_batch()).encode(), JSON),
    ("valid, +json type with charset", json.dumps(_batch()).encode(),
     {"Content-Type": "application/vnd.kctl+json; charset=utf-8"}),
    ("valid, UTF-8 BOM", b"\xef\xbb\xbf" + json.dumps(_batch()).encode(), JSON),
    ("valid, UTF-16", json.dumps(_batch()).encode("utf-16"), JSON),
    ("numeric strings and ints for floats", json.dumps(_batch(duration_s="0.5", latency=[
        {"op": "a", "tokens": 8, "stable_s": 1, "candidate_s": "0.0001"}])).encode(), JSON),
    ("NaN timing", _nan("candidate_s"), JSON),
    ("negative timing", json.dumps(_batch(latency=[{"op": "a", "tokens": 8, "stable_s": -1.0,
                                                    "candidate_s": 1e-4}])).encode(), JSON),
    ("unknown field", json.dumps(_batch(bogus=1)).encode(), JSON),
    ("lone surrogate", json.dumps(_batch(detail="\ud800")).encode(), JSON),
    ("bad JSON", b'{"node_name": "gpu-body-1", "reports": [', JSON),
    ("trailing garbage", json.dumps(_batch()).encode() + b" x", JSON),
    ("invalid UTF-8", b'{"node_name": "\xff"}', JSON),
    ("a list", b"[]", JSON),
    ("null", b"null", JSON),
    ("empty", b"", JSON),
    ("no content type", json.dumps(_batch()).encode(), {}),
    ("text/plain", json.dumps(_batch()).encode(), {"Content-Type": "text/plain"}),
    ("no reports", b'{"node_name": "gpu-body-1", "reports": []}', JSON),
]


@pytest.mark.parametrize(("what", "body", "headers"), CASES, ids=[c[0] for c in CASES])
def test_json_body_answers_like_a_declared_body(client: TestClient, what: str, body: bytes,
                                                headers: dict[str, str]) -> None:
    a = client.post("/declared", content=body, headers=headers)
    b = client.post("/fast", content=body, headers=headers)
    assert (b.status_code, b.json()) == (a.status_code, a.json()), what
    if what.startswith("valid"):
        assert a.status_code == 200
    elif what in ("NaN timing", "negative timing", "unknown field"):
        assert a.status_code == 422 and a.json()["locs"][0][:3] == ["body", "reports", 0]


def test_openapi_body_is_the_declared_schema_inline(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    components = spec["components"]["schemas"]

    def deref(x: Any) -> Any:
        if isinstance(x, dict):
            if "$ref" in x:
                return deref(components[x["$ref"].rsplit("/", 1)[1]])
            return {k: deref(v) for k, v in x.items()}
        if isinstance(x, list):
            return [deref(v) for v in x]
        return x

    declared, fast = spec["paths"]["/declared"]["post"], spec["paths"]["/fast"]["post"]
    assert deref(declared["requestBody"]) == fast["requestBody"]
    assert declared["responses"]["422"] == fast["responses"]["422"]
