"""Keyset paging of every list the API serves (audit, nodes, bundles, rollouts, compat): bounded pages and
opaque cursors.

A page holds at most :data:`PAGE_MAX` rows. Its cursor names the sort key of its last row (an opaque
base64url string, bound to the list it came from), and the next page is the rows strictly after that key in
the list's order: a stable position, so rows inserted meanwhile never shift a page (no row is skipped or
repeated, as an offset would) and each page is one index range scan, however deep. The API hands the cursor
out in a ``Link: <...>; rel="next"`` header (RFC 8288); no header means the last page.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import json
from typing import Any

from sqlalchemy import ColumnElement, and_, or_

PAGE_MAX = 1000  # rows per page, every list
MAX_CURSOR = 512  # characters of a cursor


class PageError(ValueError):
    """A page request this list cannot serve: a cursor it did not hand out (wrong list, edited), a page size
    over the limit."""


def encode_cursor(kind: str, *key: Any) -> str:
    """The cursor after a row of list ``kind`` whose sort key is ``key`` (str, int or datetime)."""
    values = [v.isoformat() if isinstance(v, dt.datetime) else v for v in key]
    raw = json.dumps([kind, *values], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(kind: str, cursor: str, *types: type) -> tuple[Any, ...]:
    """The sort key in ``cursor`` as ``types`` (str, int or datetime); PageError unless list ``kind``
    handed it out."""
    bad = PageError(f"not a cursor of this list ({kind}): pass the cursor of the previous page's "
                      'Link rel="next" header unchanged')
    if len(cursor) > MAX_CURSOR:
        raise bad
    try:
        values = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except (binascii.Error, ValueError, UnicodeDecodeError):
        raise bad from None
    if not isinstance(values, list) or len(values) != len(types) + 1 or values[0] != kind:
        raise bad
    out: list[Any] = []
    for value, typ in zip(values[1:], types, strict=True):
        if typ is dt.datetime and isinstance(value, str):
            try:
                value = dt.datetime.fromisoformat(value)
            except ValueError:
                raise bad from None
            value = value if value.tzinfo else value.replace(tzinfo=dt.timezone.utc)
        elif not (isinstance(value, typ) and not isinstance(value, bool)):
            raise bad
        out.append(value)
    return tuple(out)


def after(columns: tuple[Any, ...], key: tuple[Any, ...], *, descending: bool = False) -> ColumnElement[bool]:
    """Rows strictly after ``key`` in the order of ``columns`` (all ascending or all descending), written so
    that an index on the first column serves the range (``a >= x AND (a > x OR (b, ...) > (y, ...))``)."""
    first, rest = columns[0], columns[1:]
    beyond = first < key[0] if descending else first > key[0]
    if not rest:
        return beyond
    within = first <= key[0] if descending else first >= key[0]
    return and_(within, or_(beyond, and_(first == key[0], after(rest, key[1:], descending=descending))))


def check_limit(limit: int) -> None:
    """A page size within 1..PAGE_MAX (PageError naming the rule otherwise)."""
    if not 1 <= limit <= PAGE_MAX:
        raise PageError(f"limit must be between 1 and {PAGE_MAX} rows per page, got {limit}; for more rows "
                          'follow the cursor of the Link rel="next" header page by page')
