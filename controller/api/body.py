"""Request bodies validated straight from their bytes, with FastAPI's answers kept.

A route that declares a pydantic body parameter gets FastAPI's two passes: ``json.loads`` into dicts, then
validation of those dicts. :func:`json_body` does one (``model_validate_json`` on the raw bytes) for a
``application/json`` body; anything that pass refuses is handed to FastAPI's own path (``json.loads``,
then ``validate_python``), so the outcome of every request is what a declared body parameter gives: the same
model, the same ``422`` field list (``loc`` starting with ``body``; a JSON syntax error with its position),
the same refusal of a body that is empty or not JSON. :func:`openapi_body` documents such a body in the
OpenAPI schema (inline, with FastAPI's ``422`` answer): the route declares no body parameter for FastAPI to
describe.

The parse runs in a worker thread, never in the event loop (a 4 MiB batch takes a few hundred milliseconds
to validate); with ``max_items`` a list field's length is counted first from the bare JSON (``jiter``, fast,
holding the GIL only briefly), so an oversized batch is refused before its items are validated. No answer
echoes the input (the 422 handler drops it: ``controller.api.app``).
"""

from __future__ import annotations

import email.message
import json
from typing import Any, TypeVar

from fastapi import HTTPException, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic_core import from_json
from starlette.concurrency import run_in_threadpool

M = TypeVar("M", bound=BaseModel)


def is_json(content_type: str | None) -> bool:
    """FastAPI's test (strict content type): ``application/json`` or ``application/*+json``."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    if message.get_content_maintype() != "application":
        return False
    subtype = message.get_content_subtype()
    return subtype == "json" or subtype.endswith("+json")


async def json_body(request: Request, model: type[M], *, max_items: tuple[str, int] | None = None) -> M:
    """The request's body as ``model``, or the exception FastAPI raises for a body parameter of that type;
    parsed in a worker thread. ``max_items``: (field, n): more than n items in that top-level list field are
    refused (422 naming it) before any item is validated."""
    body = await request.body()
    return await run_in_threadpool(parse_body, body, is_json(request.headers.get("content-type")), model,
                                   max_items)


def parse_body(body: bytes, is_json: bool, model: type[M], max_items: tuple[str, int] | None = None) -> M:
    """:func:`json_body` on bytes already read."""
    if body and is_json:
        if max_items is not None:
            _count_items(body, *max_items)
        try:
            return model.model_validate_json(body)
        except ValidationError:
            pass  # FastAPI's path decides: its error shapes (and its JSON decoder's leniencies) are the contract
    return fastapi_body(body, is_json, model)


def too_many(field: str, n: int, limit: int) -> str:
    return f"{n} items in {field} is over the limit of {limit} in one request; split it"


def _count_items(body: bytes, field: str, limit: int) -> None:
    try:
        doc = from_json(body)
    except ValueError:
        return  # not JSON jiter reads (or another encoding): the full path answers it
    items = doc.get(field) if isinstance(doc, dict) else None
    if isinstance(items, list) and len(items) > limit:
        raise RequestValidationError([{"type": "too_long", "loc": ("body", field),
                                       "msg": too_many(field, len(items), limit),
                                       "ctx": {"field_type": "List", "max_length": limit, "actual_length": len(items)}}])


def fastapi_body(body: bytes, is_json: bool, model: type[M]) -> M:
    """What FastAPI does with a declared body parameter of type ``model`` (fastapi.routing, 0.11x-0.16x)."""
    value: Any
    if not body:
        raise RequestValidationError([_missing()])
    if is_json:
        try:
            value = json.loads(body)
        except json.JSONDecodeError as exc:
            raise RequestValidationError(
                [{"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error", "input": {},
                  "ctx": {"error": exc.msg}}], body=exc.doc) from exc
        except Exception as exc:  # e.g. bytes that are no Unicode text: FastAPI's answer
            raise HTTPException(status_code=400, detail="There was an error parsing the body") from exc
    else:
        value = body  # refused by validation: not an object
    try:
        return TypeAdapter(model).validate_python(value, from_attributes=True)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)],
                                     body=value) from None


def _missing() -> dict[str, Any]:
    error = ValidationError.from_exception_data("Field required", [
        {"type": "missing", "loc": ("body",), "input": {}}]).errors(include_url=False)[0]
    return {**error, "input": None}


def _inline(schema: Any, defs: dict[str, Any]) -> Any:
    if isinstance(schema, dict):
        ref = schema.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            return _inline(defs[ref.removeprefix("#/$defs/")], defs)
        return {k: _inline(v, defs) for k, v in schema.items() if k != "$defs"}
    if isinstance(schema, list):
        return [_inline(v, defs) for v in schema]
    return schema


def openapi_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` for a route reading ``model`` with :func:`json_body`: its JSON schema (inline, no
    recursion in wire models) as the required request body, and FastAPI's 422 answer."""
    schema = model.model_json_schema()
    return {
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": _inline(schema, schema.get("$defs", {}))}}},
        "responses": {"422": {"description": "Validation Error", "content": {"application/json": {
            "schema": {"$ref": "#/components/schemas/HTTPValidationError"}}}}},
    }
