"""Report intake: a ``POST /v1/agents/reports`` body to stored reports, in a worker thread or a worker process.

:func:`take` is the one path: parse and validate the body (``controller.api.body.parse_body``), check that the
caller's token may report for the batch's node, store it in one transaction (``controller.ingest``), retried
when a concurrent replay of the same keys wins the unique-key race. It returns an :class:`Outcome` that the API
process turns into metrics and the reply.

Where it runs (``controller.desired.writers.Writers.ingest``, admitted first): in the API process's report
threads (``ingest_processes = 0``): :func:`parse` there, then :func:`store_many` **group-commits** the parsed
batches of every request waiting (one transaction and one WAL flush for all of them, each in its own savepoint;
a transaction per report request made the commit's flush, 40+ ms on a busy machine, the ceiling: two threads,
about 60 real-sized reports/s); or in a pool of worker processes (``ingest_processes = N``): there the
parsing, the validation of 6-46 KB bodies and the ORM work run past the API process's GIL, which then serves
heartbeats, watches and downloads only. A worker process has its own engine (two connections) and generation
hooks; the patches its commits declare (a canary verified by its report) travel back in the outcome and are
applied by the API process's store as its own commits' are, so the node's watch answers at once (the NOTIFY
wakes every other replica as before). A body that fails validation comes back as ``invalid``: the API process
parses it again to raise FastAPI's exact answer (bad bodies are rare and small next to the limit).
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

from fastapi import HTTPException
from fastapi.exceptions import RequestValidationError
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker
from tenacity import retry, retry_if_exception_type, stop_after_attempt, wait_random

from controller import ingest, registry
from controller.api.body import parse_body, too_many
from controller.auth import Principal, require_node
from controller.db.engine import DatabaseError, retry_lock_cycles, session_scope
from controller.db.models import Node, utcnow
from controller.desired.generation import Patch
from controller.errors import Invalid, KernelctlError, first_line
from kernelctl import wire


@dataclass
class Outcome:
    """What one report request came to (see the module docstring)."""

    invalid: bool = False  # the body did not validate: parse it again where the answer is made
    reply: wire.ReportBatchResponse | None = None
    reports: int = 0
    error: Exception | None = None  # storing the batch failed: nothing of it was stored
    refused_reasons: list[str] = field(default_factory=list)
    patches: list[tuple[int, Patch]] = field(default_factory=list)  # from a worker process's commits


def parse(body: bytes, json_type: bool, principal: Principal, max_report_batch: int) -> wire.ReportBatch | Outcome:
    """The request's batch, validated and checked against the caller's token; ``Outcome(invalid=True)`` for a
    body that does not validate (raises for another node's token or too many reports)."""
    try:
        batch = parse_body(body, json_type, wire.ReportBatch, max_items=("reports", max_report_batch))
    except (RequestValidationError, HTTPException):
        return Outcome(invalid=True)
    require_node(principal, batch.node_name)
    if len(batch.reports) > max_report_batch:  # a body parse_body could not count first
        raise Invalid(f"reports: {too_many('reports', len(batch.reports), max_report_batch)}")
    return batch


def take(factory: sessionmaker[Session], body: bytes, json_type: bool, principal: Principal,
         max_report_batch: int) -> Outcome:
    """The report request ``body`` from ``principal``, stored in a transaction of its own (see the module
    docstring; the API process's threads group-commit instead: :func:`parse` then :func:`store_many`)."""
    batch = parse(body, json_type, principal, max_report_batch)
    if isinstance(batch, Outcome):
        return batch
    try:
        accepted, duplicates, refused = _store(factory, batch)
    except Exception as exc:  # raised where the answer is made, after counting the batch as rejected
        return Outcome(reports=len(batch.reports), error=exc)
    return _answer(batch, accepted, duplicates, refused)


def _answer(batch: wire.ReportBatch, accepted: int, duplicates: int, refused: dict[str, tuple[str, str]]) -> Outcome:
    if not refused:  # the common case keeps the historical shape {"accepted", "duplicates"}
        reply = wire.ReportBatchResponse(accepted=accepted, duplicates=duplicates)
    else:
        reply = wire.ReportBatchResponse(accepted=accepted, duplicates=duplicates,
                                         refused={k: m for k, (_r, m) in refused.items()})
    return Outcome(reply=reply, reports=len(batch.reports), refused_reasons=[r for r, _m in refused.values()])


@retry_lock_cycles
@retry(retry=retry_if_exception_type(IntegrityError), stop=stop_after_attempt(3), wait=wait_random(0, 0.05),
       reraise=True)
def _store(factory: sessionmaker[Session], batch: wire.ReportBatch
           ) -> tuple[int, int, dict[str, tuple[str, str]]]:
    # A concurrent replay of the same batch loses the unique-key race: retrying sees the keys as duplicates.
    # A canary verified here (trial before serve) is declared by mark_verified: the node's watch answers at once.
    with session_scope(factory) as session:
        node = registry.get_node(session, batch.node_name)
        return ingest.ingest_batch(session, node, batch, utcnow())


@retry_lock_cycles
def store_many(factory: sessionmaker[Session], batches: list[wire.ReportBatch]) -> list[Outcome]:
    """Many requests' batches in **one** transaction (``controller.group_commit``: one commit, one WAL flush, for
    every request that arrived while the previous one was written), each in a savepoint of its own: a batch the
    controller refuses (``Invalid``, unknown node) is answered with its error and stores nothing, the others
    commit. A transaction the database aborted to break a lock cycle is run again; another database failure
    raises (the group commit then writes each batch alone)."""
    out: list[Outcome | None] = [None] * len(batches)
    with session_scope(factory) as session:
        # the batches written in node id order: verifying a canary updates its assignment row, and every writer of
        # many nodes' rows takes them in that order (controller.desired.liveness), so no lock cycle with a switch
        # batch or the liveness flush (written in arrival order, they deadlocked in a 10,000-node run)
        names = {b.node_name for b in batches}
        ids = dict(session.execute(select(Node.name, Node.id).where(Node.name.in_(names))).all())
        for i in sorted(range(len(batches)), key=lambda i: (ids.get(batches[i].node_name, 0), i)):
            batch = batches[i]
            for attempt in range(3):
                try:
                    with session.begin_nested():
                        node = registry.get_node(session, batch.node_name)
                        accepted, duplicates, refused = ingest.ingest_batch(session, node, batch, utcnow())
                    out[i] = _answer(batch, accepted, duplicates, refused)
                    break
                except IntegrityError:  # a concurrent replay won the unique-key race: again, its keys are duplicates
                    if attempt == 2:
                        raise
                except KernelctlError as exc:  # this batch's own refusal (unknown node, invalid)
                    out[i] = Outcome(reports=len(batch.reports), error=exc)
                    break
    done = [o for o in out if o is not None]
    assert len(done) == len(batches)  # each batch answered or raised
    return done


# ------------------------------------------------------------------------------------------ worker processes
_worker: dict[str, object] = {}  # in a worker process: its session factory, settings and declared patches


def _init_worker(database_url: str, max_report_batch: int) -> None:
    from controller.db.engine import make_engine, session_factory
    from controller.desired.generation import install_generation_hooks

    factory = session_factory(make_engine(database_url, pool_size=2))
    patches: list[tuple[int, Patch]] = []
    install_generation_hooks(factory, on_commit=lambda gen, patch: patches.append((gen, patch)))
    _worker.update(factory=factory, max_report_batch=max_report_batch, patches=patches)


def take_in_worker(body: bytes, json_type: bool, principal: Principal) -> Outcome:
    """(worker process) :func:`take` on the worker's engine; a database failure comes back as a
    ``DatabaseError`` (503), picklable, with its first line."""
    patches: list[tuple[int, Patch]] = _worker["patches"]  # type: ignore[assignment]
    patches.clear()
    out = take(_worker["factory"], body, json_type, principal, _worker["max_report_batch"])  # type: ignore[arg-type]
    if isinstance(out.error, SQLAlchemyError):  # its driver state does not travel between processes
        out.error = DatabaseError(f"database unavailable: {first_line(out.error)}")
    out.patches = list(patches)
    return out


def _ready() -> bool:
    return "factory" in _worker


def worker_pool(processes: int, database_url: str, max_report_batch: int) -> ProcessPoolExecutor:
    """``processes`` report workers (spawned: the API process has threads), each with its own engine."""
    return ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker,
                               initargs=(database_url, max_report_batch))


def warm(pool: ProcessPoolExecutor, processes: int) -> None:
    """Start the workers now (each imports the controller: seconds), not on the first report."""
    for _ in range(processes):
        pool.submit(_ready)
