"""Report intake: ``POST /v1/agents/reports`` bodies to stored reports, group-committed, in the API process or
in worker processes.

One request is parsed and validated (:func:`parse`: ``controller.api.body.parse_body``, the caller's token
checked against the batch's node); the batches of every request waiting together are stored in **one**
transaction with the statements of one (:func:`store_many`: the nodes in one read, ``controller.ingest.ingest_many``
set-based, each batch still answered on its own; retried when the database aborted it to break a lock cycle or
a concurrent replay of the same keys won the unique-key race; when it raises, each batch alone). Each request
gets an :class:`Outcome` that the API process turns into metrics and the reply. A transaction per report
request made the commit's flush, 40+ ms on a busy machine, the ceiling (two threads, about 60 real-sized
reports/s); a savepoint and 3-5 statements per request cost 7 ms a request here.

Where it runs (``controller.desired.writers.Writers.ingest``, admitted first): in the API process's report
threads (``ingest_processes = 0``): :func:`parse` there, then the report group commit (one thread) runs
:func:`store_many`; or in a pool of worker processes (``ingest_processes = N``): the group commit there sends
the requests waiting together, as received, to one worker process, up to N groups at once (one per process),
and the worker runs :func:`take_many` (:func:`parse` each, :func:`store_many` them all): the parsing, the
validation of 6-46 KB bodies and the ORM work run past the API process's GIL, which then serves heartbeats,
watches and downloads. :func:`take` is :func:`take_many` of one request, a transaction of its own. A worker
process has its own engine (two connections) and generation hooks; the patches its commits declare (a canary
verified by a report) travel back with the group's outcomes and are applied by the API process's store as its
own commits' are before the requests are answered, so the node's watch answers at once (the NOTIFY wakes every
other replica as before). A body that fails validation comes back as ``invalid``: the API process parses it
again to raise FastAPI's exact answer (bad bodies are rare and small next to the limit).
"""

from __future__ import annotations

import functools
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

from fastapi import HTTPException
from fastapi.exceptions import RequestValidationError
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker
from tenacity import retry, retry_if_exception_type, stop_after_attempt, wait_random

from controller import ingest, registry
from controller.api.body import parse_body, too_many
from controller.auth import Principal, require_node
from controller.db.engine import DatabaseError, retry_lock_cycles, session_scope
from controller.db.models import utcnow
from controller.desired.generation import Patch
from controller.errors import Invalid, first_line
from controller.group_commit import write_isolated
from kernelctl import wire


@dataclass
class Outcome:
    """What one report request came to (see the module docstring)."""

    invalid: bool = False  # the body did not validate: parse it again where the answer is made
    reply: wire.ReportBatchResponse | None = None
    reports: int = 0
    error: Exception | None = None  # storing the batch failed: nothing of it was stored
    refused_reasons: list[str] = field(default_factory=list)


# a body larger than an agent sends (its reports and the envelope) has its items counted first, so a batch of
# too many is refused before any is validated; an agent-sized one is validated at once and its count checked
# after (counting is a JSON parse of its own: about 0.08 ms of a real report's 0.2-0.3 ms of parsing)
COUNT_FIRST_ABOVE = wire.MAX_REPORT_BATCH_BYTES + 65536


def parse(body: bytes, json_type: bool, principal: Principal, max_report_batch: int) -> wire.ReportBatch | Outcome:
    """The request's batch, validated and checked against the caller's token; ``Outcome(invalid=True)`` for a
    body that does not validate (raises for another node's token or too many reports)."""
    count_first = ("reports", max_report_batch) if len(body) > COUNT_FIRST_ABOVE else None
    try:
        batch = parse_body(body, json_type, wire.ReportBatch, max_items=count_first)
    except (RequestValidationError, HTTPException):
        return Outcome(invalid=True)
    require_node(principal, batch.node_name)
    if len(batch.reports) > max_report_batch:  # a body parse_body could not count first
        raise Invalid(f"reports: {too_many('reports', len(batch.reports), max_report_batch)}")
    return batch


def take(factory: sessionmaker[Session], body: bytes, json_type: bool, principal: Principal,
         max_report_batch: int) -> Outcome:
    """The report request ``body`` from ``principal``, stored in a transaction of its own: :func:`take_many` of
    one request (raises what it refuses the request with)."""
    (out,) = take_many(factory, [(body, json_type, principal)], max_report_batch)
    if isinstance(out, Exception):
        raise out
    return out


Request = tuple[bytes, bool, Principal]  # a report request's body, whether it is JSON, its caller


def take_many(factory: sessionmaker[Session], requests: list[Request],
              max_report_batch: int) -> list[Outcome | Exception]:
    """Many report requests: each parsed (:func:`parse`), then every parsed batch stored in **one** transaction
    (:func:`store_many`; when that raises, each batch alone: ``controller.group_commit.write_isolated``). One
    answer per request: its :class:`Outcome` (``invalid``; a storing failure in ``error``), or the exception
    :func:`parse` refused it with (another node's token, too many reports), for the caller to raise."""
    out: list[Outcome | Exception | None] = [None] * len(requests)
    parsed: list[tuple[int, wire.ReportBatch]] = []
    for i, (body, json_type, principal) in enumerate(requests):
        try:
            batch = parse(body, json_type, principal, max_report_batch)
        except Exception as exc:  # this request's own refusal
            out[i] = exc
            continue
        if isinstance(batch, Outcome):
            out[i] = batch
        else:
            parsed.append((i, batch))
    if parsed:
        stored = write_isolated(functools.partial(store_many, factory), [b for _i, b in parsed])
        for (i, batch), result in zip(parsed, stored, strict=True):
            # a failure is raised where the answer is made, after counting the batch as rejected
            out[i] = Outcome(reports=len(batch.reports), error=result) if isinstance(result, Exception) else result
    done = [o for o in out if o is not None]
    assert len(done) == len(requests)  # each request answered
    return done


def _answer(batch: wire.ReportBatch, stored: ingest.Result | Invalid) -> Outcome:
    if isinstance(stored, Invalid):  # this batch's own refusal: nothing of it was stored
        return Outcome(reports=len(batch.reports), error=stored)
    accepted, duplicates, refused = stored
    if not refused:  # the common case keeps the historical shape {"accepted", "duplicates"}
        reply = wire.ReportBatchResponse(accepted=accepted, duplicates=duplicates)
    else:
        reply = wire.ReportBatchResponse(accepted=accepted, duplicates=duplicates,
                                         refused={k: m for k, (_r, m) in refused.items()})
    return Outcome(reply=reply, reports=len(batch.reports), refused_reasons=[r for r, _m in refused.values()])


@retry_lock_cycles
@retry(retry=retry_if_exception_type(IntegrityError), stop=stop_after_attempt(3), wait=wait_random(0, 0.05),
       reraise=True)
def store_many(factory: sessionmaker[Session], batches: list[wire.ReportBatch]) -> list[Outcome]:
    """Many requests' batches in **one** transaction with the statements of one (``controller.group_commit``: one
    commit, one WAL flush, for every request that arrived while the previous one was written; the nodes read in
    one statement, then ``controller.ingest.ingest_many``: set-based). Each batch is answered on its own: one
    the controller refuses (unknown node, ``Invalid``) stores nothing and gets its error, the others commit. A
    transaction the database aborted to break a lock cycle is run again, one that lost a unique-key race with a
    concurrent replay too (its keys are then duplicates); another database failure raises (the group commit
    then writes each batch alone). Canaries verified here are declared (``mark_verified_many``): the nodes'
    watches answer at once; their rows are updated in node id order, the order of every writer of many nodes'
    rows (``controller.desired.liveness``)."""
    now = utcnow()
    out: list[Outcome | None] = [None] * len(batches)
    with session_scope(factory) as session:
        nodes = registry.get_nodes(session, {b.node_name for b in batches})
        known = [i for i, b in enumerate(batches) if b.node_name in nodes]
        stored = ingest.ingest_many(session, [(nodes[batches[i].node_name], batches[i]) for i in known], now)
    for i, result in zip(known, stored, strict=True):
        out[i] = _answer(batches[i], result)
    for i, b in enumerate(batches):
        if b.node_name not in nodes:
            out[i] = Outcome(reports=len(b.reports), error=registry.not_registered(b.node_name))
    done = [o for o in out if o is not None]
    assert len(done) == len(batches)  # each batch answered
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


def take_many_in_worker(requests: list[Request]) -> tuple[list[Outcome | Exception], list[tuple[int, Patch]]]:
    """(worker process) :func:`take_many` on the worker's engine, and the patches its commits declared (for the
    API process's store); a database failure comes back as a ``DatabaseError`` (503), picklable, with its first
    line."""
    patches: list[tuple[int, Patch]] = _worker["patches"]  # type: ignore[assignment]
    patches.clear()
    outs = take_many(_worker["factory"], requests, _worker["max_report_batch"])  # type: ignore[arg-type]
    for i, out in enumerate(outs):  # its driver state does not travel between processes
        if isinstance(out, SQLAlchemyError):
            outs[i] = DatabaseError(f"database unavailable: {first_line(out)}")
        elif isinstance(out, Outcome) and isinstance(out.error, SQLAlchemyError):
            out.error = DatabaseError(f"database unavailable: {first_line(out.error)}")
    return outs, list(patches)


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
