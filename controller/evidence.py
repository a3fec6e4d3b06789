"""The judge tick's step evidence, read incrementally (issue 28): only the reports that arrived since the last
tick are read and parsed; each live stratum's series of (node, signals) is kept in memory between ticks.

:class:`EvidenceCache` gives the same :class:`~controller.judge.gates.StepEvidence` as the full read
(:func:`controller.gates.step_evidence`): every ``ok`` report of the stratum in its rollout from a node that is
active *now*, in ``(received_at, id)`` order, so the pure decision function sees identical input and gives
identical verdicts (``tests/controller/test_tick_incremental.py`` compares them tick by tick).

Reports are append-only (a node's deletion cascades to its reports: the cache then rebuilds). Which reports are
new is decided by id, with a **watermark**: every report with ``id <= watermark`` has been read; those above it
that were read are remembered by id, and each tick reads the ids above the watermark it has not seen. The
watermark moves past a report only when no report with a lower id can still commit:

* PostgreSQL: a report's id comes from a sequence when its ``INSERT`` runs, but commits later; a report with a
  lower id may commit after a tick has read a higher one. Before each read the tick takes the oldest start of
  any transaction open in the database (``pg_stat_activity``, other sessions); a report first seen by a read
  that ran *before* that instant cannot have a lower-id report still uncommitted (that report's transaction
  would have started earlier and still be open). Sessions the role may not see count as doubt: the horizon
  then falls back to ``SETTLE_SECONDS`` before the read.
* SQLite: one writer at a time, ids committed in order: the watermark is the highest id seen.

Rebuilt from scratch (:meth:`EvidenceCache.reset`; the caller does it on a new leadership and after a failed
tick) on any doubt: a node of a cached report no longer exists, and every ``REBUILD_SECONDS`` regardless.

**The judge's state** rides along (issue 28): each stratum's evidence list is handed to the judge with a
:class:`~controller.judge.series.JudgeMemo` that keeps each gate's measurements (the latency series, the
memory and launch observations) and the betting tests' state (:mod:`controller.judge.running`) and reads only
the reports appended since the last tick. The list is the same
object, appended in place, only while the evidence grew at its end; a report placed before the end (received
earlier than one already read), a node going stale or coming back, or any rebuild above hands a fresh list and
a fresh state, and the judge starts again from the whole evidence. Either way the decision is the one the full
recomputation takes, bit for bit.
"""

from __future__ import annotations

import bisect
import datetime as dt
import time
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import and_, select, text
from sqlalchemy.orm import Session

from controller.db.models import Node, Report, RolloutStratum, as_utc
from controller.gates import SIGNALS_TEXT, Key
from controller.judge.gates import StepEvidence
from controller.judge.series import JudgeMemo
from controller.signals import ReportSignals

SETTLE_SECONDS = 30.0
"""Fallback horizon (PostgreSQL, when some session's transaction start is hidden from this role): a report
first read this long before the read is taken as settled."""

REBUILD_SECONDS = 600.0
"""A full re-read at least this often, whatever else happened (a guard, not a correctness need)."""

CHUNK = 5000  # ids per ``IN (...)`` list

PG_HORIZON = text(
    "SELECT clock_timestamp(), min(xact_start), "
    "count(*) FILTER (WHERE backend_type = 'client backend' AND state IS NULL) "
    "FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()")
PG_CLOCK = text("SELECT clock_timestamp()")

_COLUMNS = (Report.id, Report.rollout_id, Report.stratum, Report.node_id, Report.received_at, SIGNALS_TEXT)


@dataclass
class CacheStats:
    """What the cache did (for the benchmark and the tests): full reads, rows parsed, ticks served."""

    rebuilds: int = 0
    keys_loaded: int = 0
    rows_parsed: int = 0
    ticks: int = 0
    pending: int = 0  # ids above the watermark held after the last tick
    judge_restarts: int = 0  # a stratum's judged state started again (not an append: late report, node change)


@dataclass
class _Series:
    """One stratum's ok reports: sorted ``(received_at, id)`` keys, the same order of (node id, signals); and
    what the last tick judged: the reports of active nodes (``view``, a list only ever appended to while the
    evidence only grows at its end) with the judge's state carried on it (``memo``)."""

    order: list[tuple[dt.datetime, int]] = field(default_factory=list)
    items: list[tuple[int, ReportSignals]] = field(default_factory=list)
    nodes: set[int] = field(default_factory=set)
    view: list[tuple[str, ReportSignals]] = field(default_factory=list)
    viewed: int = 0  # items looked at for the view
    excluded: frozenset[int] = frozenset()  # nodes of the items not active at the last tick
    appended: bool = True  # every item added since the view was built went to the end
    memo: JudgeMemo = field(default_factory=JudgeMemo)

    def add(self, received_at: dt.datetime, rid: int, node_id: int, sig: ReportSignals) -> None:
        k = (as_utc(received_at), rid)
        i = bisect.bisect(self.order, k)  # a late-committing report lands where the full read puts it
        self.appended = self.appended and i == len(self.order)
        self.order.insert(i, k)
        self.items.insert(i, (node_id, sig))
        self.nodes.add(node_id)

    def evidence(self, active: set[int], stats: CacheStats) -> StepEvidence:
        """The reports of active nodes; the same list object (and judge state) as the last tick when that one
        only grew at its end, else a fresh list and a fresh judge state (the judge starts again)."""
        excluded = frozenset(n for n in self.nodes if n not in active)
        if not self.appended or excluded != self.excluded:
            self.view, self.viewed, self.excluded, self.appended = [], 0, excluded, True
            self.memo = JudgeMemo()
            stats.judge_restarts += 1
        self.view.extend((str(nid), sig) for nid, sig in self.items[self.viewed:] if nid not in excluded)
        self.viewed = len(self.items)
        return StepEvidence(ok_reports=len(self.view), reports=self.view, judge=self.memo)


class EvidenceCache:
    """Per-stratum evidence kept between ticks of one leader (see the module docstring). Not thread-safe: the
    leader's tick job runs one at a time (``max_instances=1``)."""

    def __init__(self) -> None:
        self.stats = CacheStats()
        self.reset()

    def reset(self) -> None:
        """Forget everything: the next tick reads every report of every live stratum."""
        self._series: dict[Key, _Series] = {}
        self._seen: set[int] = set()  # ids of every cached report (deduplication across reads)
        self._ignored: set[int] = set()  # ids above the watermark of strata not judged now (not fetched again)
        self._watermark = 0
        self._pending: dict[int, Any] = {}  # id above the watermark -> the clock of the read that first saw it
        self._node_ids: set[int] = set()
        self._built_at = time.monotonic()
        self.stats.rebuilds += 1

    # ------------------------------------------------------------------------------------------ the tick
    def step_evidence(self, session: Session, strata: dict[int, Key], *, _retry: bool = False
                      ) -> dict[Key, StepEvidence]:
        """The evidence of every stratum in ``strata`` (rollout_strata id -> (rollout id, stratum)), as
        :func:`controller.gates.step_evidence` reads it, from the reports read so far plus those new since."""
        if time.monotonic() - self._built_at >= REBUILD_SECONDS:
            self.reset()
        self.stats.ticks += 1
        wanted = set(strata.values())
        for key in [k for k in self._series if k not in wanted]:
            del self._series[key]  # a stratum no longer live: its reports are not read again
        pg = session.get_bind().dialect.name == "postgresql"
        horizon = self._horizon(session) if pg else None
        conn = session.connection()
        new_keys = {sid: key for sid, key in strata.items() if key not in self._series}
        for key in new_keys.values():
            self._series[key] = _Series()
        if new_keys:
            self.stats.keys_loaded += len(new_keys)
            self._read(conn.execute(
                select(*_COLUMNS).join(RolloutStratum, and_(RolloutStratum.rollout_id == Report.rollout_id,
                                                            RolloutStratum.stratum == Report.stratum))
                .where(RolloutStratum.id.in_(sorted(new_keys)), Report.outcome == "ok")
                .order_by(Report.received_at, Report.id)).all())
        rids = sorted({rid for rid, _ in wanted})
        if rids:
            ids = conn.execute(select(Report.id).where(Report.id > self._watermark, Report.outcome == "ok",
                                                       Report.rollout_id.in_(rids))).scalars().all()
            seen_at = conn.execute(PG_CLOCK).scalar() if pg else None
            for i in ids:
                self._pending.setdefault(i, seen_at)
            unseen = sorted(i for i in ids if i not in self._seen and i not in self._ignored)
            for j in range(0, len(unseen), CHUNK):
                self._read(conn.execute(select(*_COLUMNS).where(Report.id.in_(unseen[j:j + CHUNK]))
                                        .order_by(Report.received_at, Report.id)).all(), ignore=True)
        self._advance(horizon, pg)
        active, complete = self._active_nodes(session)
        if not complete and not _retry:  # a cached report's node was deleted, and its reports with it (on SQLite
            self.reset()  # a later report may even have taken a deleted one's id): read everything again
            return self.step_evidence(session, strata, _retry=True)
        self.stats.pending = len(self._pending)
        return {key: s.evidence(active, self.stats) for key, s in self._series.items() if s.items}

    def _read(self, rows: list[Any], *, ignore: bool = False) -> None:
        for rid, rollout_id, stratum, node_id, received_at, signals in rows:
            if rid in self._seen:
                continue
            series = self._series.get((rollout_id, stratum))
            if series is None:  # a stratum not judged now (read in full when it is)
                if ignore:
                    self._ignored.add(rid)
                continue
            self._seen.add(rid)
            self._node_ids.add(node_id)
            series.add(received_at, rid, node_id, ReportSignals.from_stored_text(signals))
            self.stats.rows_parsed += 1

    # ------------------------------------------------------------------------------------- the watermark
    def _horizon(self, session: Session) -> Any:
        """PostgreSQL: the instant before which every report that will ever commit has committed (the oldest
        open transaction's start; ``SETTLE_SECONDS`` back when some session is hidden from this role)."""
        now, oldest, hidden = session.connection().execute(PG_HORIZON).one()
        horizon = now if oldest is None else min(now, oldest)
        if hidden:
            horizon = min(horizon, now - dt.timedelta(seconds=SETTLE_SECONDS))
        return horizon

    def _advance(self, horizon: Any, pg: bool) -> None:
        if not self._pending:
            return
        if pg:  # settled: first seen by a read that ran before the horizon (see the module docstring)
            settled = [i for i, at in self._pending.items() if at is not None and at < horizon]
        else:  # SQLite commits in id order
            settled = list(self._pending)
        if not settled:
            return
        self._watermark = max(self._watermark, *settled)
        self._pending = {i: at for i, at in self._pending.items() if i > self._watermark}
        self._ignored = {i for i in self._ignored if i > self._watermark}

    # --------------------------------------------------------------------------------- the node filter
    def _active_nodes(self, session: Session) -> tuple[set[int], bool]:
        """Ids of the cached reports' nodes that are active now, and whether every one of them still exists."""
        ids = sorted(self._node_ids)
        active: set[int] = set()
        found = 0
        for j in range(0, len(ids), CHUNK):
            for nid, state in session.connection().execute(
                    select(Node.id, Node.state).where(Node.id.in_(ids[j:j + CHUNK]))):
                found += 1
                if state == "active":
                    active.add(nid)
        return active, found == len(ids)
