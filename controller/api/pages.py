"""The HTTP side of paging (controller.paging): the ``limit`` and ``cursor`` query parameters of every list
route, their 422s, and the ``Link: <...>; rel="next"`` header that hands out the next page's cursor."""

from __future__ import annotations

from typing import Any

from fastapi import Query, Request, Response
from fastapi.exceptions import RequestValidationError
from sqlalchemy import Select
from sqlalchemy.orm import InstrumentedAttribute, Session

from controller.paging import (
    MAX_CURSOR,
    PAGE_MAX,
    PageError,
    after,
    check_limit,
    decode_cursor,
    encode_cursor,
)

LIMIT_HELP = f"Rows per page, 1-{PAGE_MAX}; the next page's address is in the Link rel=\"next\" header."


def Limit(default: int) -> Any:  # a fresh Query per route: FastAPI must not share one FieldInfo
    return Query(default, description=LIMIT_HELP)


def Cursor() -> Any:
    return Query(None, max_length=MAX_CURSOR, pattern=r"^[A-Za-z0-9_-]*$",
                 description='The cursor of the previous page (from its Link rel="next" header).')


def query_error(name: str, msg: str) -> RequestValidationError:
    """A 422 naming the query parameter (FastAPI's error shape)."""
    return RequestValidationError([{"loc": ("query", name), "msg": msg, "type": "value_error"}])


def page_limit(limit: int) -> int:
    """``limit`` when it is a page size the lists serve, else a 422 naming ``limit`` and the way to page."""
    try:
        check_limit(limit)
    except PageError as exc:
        raise query_error("limit", str(exc)) from None
    return limit


def cursor_error(exc: PageError) -> RequestValidationError:
    return query_error("cursor", str(exc))


def link_next(request: Request, response: Response, cursor: str | None) -> None:
    """Point at the next page (a relative reference: the same path and filters, this cursor); none: last page."""
    if cursor is not None:
        nxt = request.url.include_query_params(cursor=cursor)
        response.headers["Link"] = f'<{nxt.path}?{nxt.query}>; rel="next"'


def keyset_page(session: Session, stmt: Select, kind: str, columns: tuple[InstrumentedAttribute, ...], *,
                cursor: str | None, limit: int, request: Request, response: Response,
                descending: bool = False) -> list[Any]:
    """One page of ``stmt`` (a select of one entity) in the order of ``columns`` (a unique key): at most
    ``limit`` rows after ``cursor``, and the Link to the next page when there is one."""
    page_limit(limit)
    if cursor is not None:
        try:
            key = decode_cursor(kind, cursor, *(c.type.python_type for c in columns))
        except PageError as exc:
            raise cursor_error(exc) from None
        stmt = stmt.where(after(columns, key, descending=descending))
    stmt = stmt.order_by(*(c.desc() if descending else c for c in columns)).limit(limit + 1)
    rows = list(session.scalars(stmt))
    if len(rows) > limit:
        rows = rows[:limit]
        link_next(request, response, encode_cursor(kind, *(getattr(rows[-1], c.key) for c in columns)))
    return rows
