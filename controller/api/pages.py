"""The HTTP side of paging (controller.paging): the ``limit`` and ``cursor`` query parameters of every list
route, their 422s, and the ``Link: <...>; rel="next"`` header that hands out the next page's cursor."""

from __future__ import annotations

from typing import Any

from fastapi import Query, Request, Response
from fastapi.exceptions import RequestValidationError

from controller.paging import MAX_CURSOR, PAGE_MAX, PageError, check_limit

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
