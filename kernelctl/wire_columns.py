"""The compact encoding of a trial report's per-cell tables (issue 28): columns instead of rows.

A real report's size comes from repeated structure: per (op, tokens) cell both arms' ``n``/``mean_s``/
``p50_s``/``p99_s``/``windows_s``, the cell's resources and its traffic weight, each an object repeating the
same keys (``kernelctl.wire.CellLatency``, ``CellResources``, ``CellWeight``). :class:`ReportColumns` sends the
same figures as one array per field, one row per cell: about half the bytes, and a few typed lists for the
controller to validate instead of hundreds of small objects (validated by pydantic in the same pass, with the
same bounds as the row models; a table whose columns differ in length, a cell twice or a p50 above its p99 is
refused with 422 naming the table and the row).

Encoding 1 (``cells``, ``resources``, ``weights`` as lists of objects) stays accepted: older agents send it.
A report carries one encoding or the other, never both (``TrialReport.columns``). An agent falls back to
encoding 1 by itself when a controller that predates this module refuses the field.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kernelctl.wire_limits import MAX_LATENCY_S, MIN_LATENCY_S, LaunchCount

MAX_CELLS = 10_000
ENCODING = 2  # what a report with ``columns`` is called in logs and answers (encoding 1: lists of objects)
OpName = Annotated[str, Field(max_length=64)]
Tokens = Annotated[int, Field(ge=1, le=10_000_000)]
Calls = Annotated[int, Field(ge=1, le=10_000_000)]
# the bounds of ``wire_limits.LatencySeconds``; finite by the models' ``allow_inf_nan=False`` (checked in Rust:
# no Python call per value, and a table holds thousands)
LatencySeconds = Annotated[float, Field(ge=MIN_LATENCY_S, lt=MAX_LATENCY_S)]
Windows = Annotated[list[LatencySeconds], Field(max_length=1000)]
Contended = Annotated[int, Field(ge=0, le=1000)]
MemoryBytes = Annotated[int, Field(ge=0, le=2**50)]
Weight = Annotated[float, Field(ge=0, le=1e9)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def _lengths(rows: int, columns: dict[str, Sequence[object]], optional: bool) -> None:
    """Every column has ``rows`` entries (an optional column may also be empty: absent for every row)."""
    for name, col in columns.items():
        if len(col) != rows and not (optional and not col):
            raise ValueError(f"column {name} has {len(col)} entries, the table has {rows} rows")


def _unique(op: Sequence[str], tokens: Sequence[int]) -> None:
    if len(set(zip(op, tokens, strict=True))) == len(op):  # the common case without a Python loop per row
        return
    seen: set[tuple[str, int]] = set()
    for i, cell in enumerate(zip(op, tokens, strict=True)):
        if cell in seen:
            raise ValueError(f"row {i}: cell {cell[0]}@{cell[1]} appears twice")
        seen.add(cell)


class ArmColumns(_Strict):
    """One version's timed calls of every cell (``wire.ArmLatency`` as columns); ``windows_s`` empty when no
    cell has window means."""

    n: list[Calls] = Field(max_length=MAX_CELLS)
    mean_s: list[LatencySeconds] = Field(max_length=MAX_CELLS)
    p50_s: list[LatencySeconds] = Field(max_length=MAX_CELLS)
    p99_s: list[LatencySeconds] = Field(max_length=MAX_CELLS)
    windows_s: list[Windows] = Field(default_factory=list, max_length=MAX_CELLS)

    @model_validator(mode="after")
    def _rows(self) -> ArmColumns:
        _lengths(len(self.n), {"mean_s": self.mean_s, "p50_s": self.p50_s, "p99_s": self.p99_s}, False)
        _lengths(len(self.n), {"windows_s": self.windows_s}, True)
        if any(map(operator.gt, self.p50_s, self.p99_s)):  # the loop below only to name the row
            for i, (p50, p99) in enumerate(zip(self.p50_s, self.p99_s, strict=True)):
                if p50 > p99:
                    raise ValueError(f"row {i}: p50_s {p50!r} is above p99_s {p99!r}")
        return self


class CellColumns(_Strict):
    """``TrialReport.cells`` as columns: row i is cell ``op[i]@tokens[i]``."""

    op: list[OpName] = Field(max_length=MAX_CELLS)
    tokens: list[Tokens] = Field(max_length=MAX_CELLS)
    stable: ArmColumns
    candidate: ArmColumns
    contended_windows: list[Contended] = Field(default_factory=list, max_length=MAX_CELLS)  # empty: all 0

    @model_validator(mode="after")
    def _rows(self) -> CellColumns:
        rows = len(self.op)
        _lengths(rows, {"tokens": self.tokens, "stable.n": self.stable.n, "candidate.n": self.candidate.n}, False)
        _lengths(rows, {"contended_windows": self.contended_windows}, True)
        _unique(self.op, self.tokens)
        return self


class ResourceColumns(_Strict):
    """``TrialReport.resources`` as columns (a column empty: None for every row)."""

    op: list[OpName] = Field(max_length=MAX_CELLS)
    tokens: list[Tokens] = Field(max_length=MAX_CELLS)
    stable_peak_bytes: list[MemoryBytes | None] = Field(default_factory=list, max_length=MAX_CELLS)
    candidate_peak_bytes: list[MemoryBytes | None] = Field(default_factory=list, max_length=MAX_CELLS)
    stable_launches: list[LaunchCount | None] = Field(default_factory=list, max_length=MAX_CELLS)
    candidate_launches: list[LaunchCount | None] = Field(default_factory=list, max_length=MAX_CELLS)

    @model_validator(mode="after")
    def _rows(self) -> ResourceColumns:
        rows = len(self.op)
        _lengths(rows, {"tokens": self.tokens}, False)
        _lengths(rows, {"stable_peak_bytes": self.stable_peak_bytes, "candidate_peak_bytes": self.candidate_peak_bytes,
                        "stable_launches": self.stable_launches, "candidate_launches": self.candidate_launches}, True)
        _unique(self.op, self.tokens)
        return self

    def column(self, name: str) -> list[int | None]:
        """A column with its rows (an empty one as None for every row)."""
        col: list[int | None] = {"stable_peak_bytes": self.stable_peak_bytes,
                                 "candidate_peak_bytes": self.candidate_peak_bytes,
                                 "stable_launches": self.stable_launches,
                                 "candidate_launches": self.candidate_launches}[name]
        return col or [None] * len(self.op)


class WeightColumns(_Strict):
    """``TrialReport.weights`` as columns."""

    op: list[OpName] = Field(max_length=MAX_CELLS)
    tokens: list[Tokens] = Field(max_length=MAX_CELLS)
    weight: list[Weight] = Field(max_length=MAX_CELLS)

    @model_validator(mode="after")
    def _rows(self) -> WeightColumns:
        _lengths(len(self.op), {"tokens": self.tokens, "weight": self.weight}, False)
        _unique(self.op, self.tokens)
        return self


class ReportColumns(_Strict):
    """Encoding 2 of a report's per-cell tables (see the module docstring); a table absent: no rows."""

    cells: CellColumns | None = None
    resources: ResourceColumns | None = None
    weights: WeightColumns | None = None
