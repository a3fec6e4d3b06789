"""Whether a row fits its table as the database will check it, before it joins a batch.

A group commit writes many requests' rows in one statement: one value the database refuses (a string past its
column's length, an integer past its column's range, a NUL character PostgreSQL does not store) would fail
every row of the statement. :func:`row_problem` checks one row against the column types of the table, so a
row refused on its own is refused alone and never fails another.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import JSON, BigInteger, Integer, SmallInteger, String, Table

INT_RANGE = {SmallInteger: 2**15, BigInteger: 2**63, Integer: 2**31}


def _int_limit(col_type: Any) -> int | None:
    for kind, limit in INT_RANGE.items():  # BigInteger and SmallInteger are Integers: most specific first
        if isinstance(col_type, kind):
            return limit
    return None


def _has_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, Mapping):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(_has_nul(v) for v in value)
    return False


def row_problem(table: Table, row: Mapping[str, Any]) -> str | None:
    """What the database would refuse in ``row`` (a column name and why), or None when it fits."""
    for name, value in row.items():
        col = table.columns.get(name)
        if col is None or value is None:
            continue
        t = col.type
        if isinstance(t, String):
            if not isinstance(value, str):
                return f"{name}: not a string"
            if t.length is not None and len(value) > t.length:
                return f"{name}: {len(value)} characters, the column holds at most {t.length}"
            if "\x00" in value:
                return f"{name}: contains a NUL character"
        elif (limit := _int_limit(t)) is not None:
            if isinstance(value, bool) or not isinstance(value, int) or not -limit <= value < limit:
                return f"{name}: {value!r} is outside the column's range [{-limit}, {limit - 1}]"
        elif isinstance(t, JSON) and _has_nul(value):
            return f"{name}: contains a NUL character"
    return None
