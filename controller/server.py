"""``serve(settings)``: run the controller under uvicorn, programmatically, with graceful SIGTERM.

The socket is bound before uvicorn starts (port 0 picks a free port); the bound address is logged and,
with ``port_file``, written to a file so that tests and supervisors learn it without racing. On SIGTERM
or SIGINT uvicorn stops accepting, finishes in-flight requests, and the lifespan stops the scheduler and
releases leadership. Access logs carry method, path and status only: never headers, so never tokens.

Several API worker processes (``api_workers`` > 1, PostgreSQL only): uvicorn's own supervisor
(``uvicorn.supervisors.Multiprocess``) spawns them, each listening on the address with a socket of its own
(``SO_REUSEPORT``: the kernel spreads the connections evenly, :class:`WorkerSocket`), restarts one that dies and, on
SIGTERM/SIGINT, passes SIGTERM to each (each shuts down gracefully, as one process does). The parent checks
the database, schema and keys and hashes the bootstrap tokens in once; each worker (:class:`WorkerConfig`)
builds its own state: engine, desired-state snapshot woken by LISTEN/NOTIFY (as a second replica's is), leader
elector and scheduler (the advisory lock lets one of them lead). Metrics are summed over the workers with
prometheus-client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``, a fresh directory unless set).
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import uvicorn
from uvicorn.config import STARTUP_FAILURE
from uvicorn.supervisors import Multiprocess

from controller.api.app import build_state, create_app
from controller.db.engine import is_sqlite, parse_url
from controller.errors import first_line
from controller.http_limits import protocol_class
from controller.notify import parse_targets
from kernelctl.settings import Settings

log = logging.getLogger("kernelctl.server")


class JsonFormatter(logging.Formatter):
    def __init__(self, *, process: bool = False) -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S%z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if self.process:
            doc["pid"] = record.process
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc)


def configure_logging(level: str = "INFO", fmt: str = "text", *, process: bool = False) -> None:
    """Logging to stderr; ``process``: each line names its process (an API worker's, with several)."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(process=process))
    else:
        where = "[%(process)d]" if process else ""
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s %(name)s{where}: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        lg = logging.getLogger(name)
        lg.handlers[:] = []
        lg.propagate = True
    logging.getLogger("apscheduler").setLevel(logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)  # no "Context impl" lines on every /readyz


def bind_socket(host: str, port: int, backlog: int = 4096, *, per_worker: bool = False) -> socket.socket:
    """The controller's listening socket; with ``per_worker`` (several API workers, where the platform has
    ``SO_REUSEPORT``) a :class:`WorkerSocket`: the port held here, a listening socket of its own in each worker."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    per_worker = per_worker and hasattr(socket, "SO_REUSEPORT")
    sock = WorkerSocket(family, socket.SOCK_STREAM) if per_worker else socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if isinstance(sock, WorkerSocket):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.backlog = backlog
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    somaxconn = _somaxconn()
    if somaxconn is not None and somaxconn < backlog:
        log.warning("listen backlog %d capped at net.core.somaxconn %d: a fleet starting together may overflow "
                    "it (raise net.core.somaxconn)", backlog, somaxconn)
    if isinstance(sock, WorkerSocket):
        return sock  # bound, not listening: the workers listen (WorkerSocket)
    sock.listen(backlog)  # the kernel caps it at net.core.somaxconn
    sock.set_inheritable(True)
    return sock


class WorkerSocket(socket.socket):
    """The address of several API workers: bound in the supervisor with ``SO_REUSEPORT`` and never listening
    there (it holds the port, and tells port 0's pick); what crosses into each spawned worker is not this socket
    but the recipe for one of its own (:func:`_listen_in_worker`): the same address, ``SO_REUSEPORT``, listening
    with the same backlog, so the kernel spreads new connections over the workers by their addresses' hash.

    One listening socket shared by the workers let whichever woke first accept a whole burst (the event loop
    accepts up to the backlog per wake-up; the connections then stay with it): 256 agents connecting together
    loaded the four workers with 0.6 to 2.5 cores each, and the busiest saturated while the others idled
    (docs/benchmarks.md, "Ingest on 16 cores"). A worker that dies closes its socket (the connections it had
    not accepted are reset) and the kernel hashes over the others until its replacement listens."""

    backlog = 4096

    def __reduce__(self) -> tuple[Any, ...]:
        host, port = self.getsockname()[:2]
        return _listen_in_worker, (self.family, host, port, self.backlog)


def _listen_in_worker(family: int, host: str, port: int, backlog: int) -> socket.socket:
    """(in a spawned API worker, as its :class:`WorkerSocket` is unpickled) the worker's own listening socket."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    return sock


def _somaxconn() -> int | None:
    try:
        return int(Path("/proc/sys/net/core/somaxconn").read_text())
    except (OSError, ValueError):
        return None


def _upgrade_embedded_database(url: str) -> None:
    """The embedded SQLite default creates or upgrades its own schema; PostgreSQL is left to
    ``kernelctl db upgrade`` (``build_state`` refuses a stale schema with that hint)."""
    from controller.db import migrate
    from controller.db.engine import make_engine

    engine = make_engine(url)
    try:
        changed = migrate.upgrade_embedded(engine)
    finally:
        engine.dispose()
    if changed is not None:
        log.info("embedded database %s: schema %s -> %s", engine.url.render_as_string(hide_password=True),
                 changed[0] or "empty", changed[1])


def settle_heap() -> None:
    """Before serving: keep the cyclic garbage collector's pauses short (issue 28: at 10,000 nodes every API
    worker stood still 100-600 ms every 2-5 s, docs/benchmarks.md runs Q6-Q8).

    - What start-up built (modules, the app and its state) lives as long as the process: frozen out of the
      collector's scans (``gc.freeze``).
    - Young collections every 10,000 allocations instead of 700, a full one considered after 100 middle ones.
    - What survives a collection is frozen too (:func:`_after_collection`), so each object is scanned at most
      once: held watches (each with its coroutines, futures and request objects, ~75 tracked objects per watch)
      and snapshots live for seconds, and without this they piled up in the middle generation (150,000 objects
      at 2,000 nodes, a 100-140 ms pause each time it was collected) and then in the full ones. Frozen objects
      are still freed by reference counting the moment they are dropped; only a reference *cycle* that dies
      after being frozen waits, for :func:`refreeze` every ``GC_REFREEZE_SECONDS`` (one full collection).
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 10, 100)
    if _after_collection not in gc.callbacks:
        gc.callbacks.append(_after_collection)
    if not any(t.name == "kernelctl-refreeze" for t in threading.enumerate()):
        threading.Thread(target=_refreeze_forever, name="kernelctl-refreeze", daemon=True).start()


GC_PAUSE_WARN_SECONDS = 0.1  # a collection this long stalls the event loop past the heartbeat goal (200 ms p99)
GC_REFREEZE_SECONDS = 600.0  # how long a frozen reference cycle may wait to be collected (one full pause each)
_gc_started = [0.0, 0.0]  # wall clock and this thread's CPU time when the running collection started


def _after_collection(phase: str, info: dict[str, int]) -> None:
    """(gc callback) Freezes what survived a collection (:func:`settle_heap`) and logs a long one
    (:func:`_log_long_collection`)."""
    _log_long_collection(phase, info)
    if phase == "stop":
        gc.freeze()  # the collected generations are empty right after: only survivors of a collection are frozen


def refreeze() -> int:
    """Every frozen object back to the collector, one full collection, everything left frozen again: the reference
    cycles that died while frozen are freed. Returns how many objects the collection freed."""
    gc.unfreeze()
    try:
        return gc.collect()
    finally:
        gc.freeze()


def _refreeze_forever() -> None:
    while True:
        time.sleep(GC_REFREEZE_SECONDS)
        started = time.perf_counter()
        freed = refreeze()
        log.info("full garbage collection of the frozen heap: %d objects freed in %.0f ms", freed,
                 (time.perf_counter() - started) * 1000)


def _log_long_collection(phase: str, info: dict[str, int]) -> None:
    """A collection that held the GIL longer than ``GC_PAUSE_WARN_SECONDS`` is logged with its
    generation, the CPU time it used (the rest of its wall time the process waited for a core: a busy machine)
    and what it freed: every request of the process stood still that long. (Logging takes re-entrant locks
    only, so a collection that starts inside a log call cannot deadlock here.)"""
    if phase == "start":
        _gc_started[0], _gc_started[1] = time.perf_counter(), time.thread_time()
        return
    took = time.perf_counter() - _gc_started[0]
    if took >= GC_PAUSE_WARN_SECONDS:
        cpu = time.thread_time() - _gc_started[1]
        log.warning("garbage collection of generation %d took %.0f ms, %.0f ms of it on a CPU (the process stood "
                    "still): %d collected, %d uncollectable", info.get("generation", -1), took * 1000, cpu * 1000,
                    info.get("collected", 0), info.get("uncollectable", 0))


FD_RESERVE = 256  # descriptors kept from connections: database pool, log and data files, listener, the
# connections being answered 503 over the limit (each needs its descriptor until the answer is sent)


def _raise_fd_limit() -> int:
    """Every agent holds a connection open: take the file-descriptor hard limit (the soft one is often 1024).
    Returns the soft limit now in force."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 1 << 20, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def connection_limit(configured: int, fd_limit: int) -> int:
    """The concurrency limit uvicorn enforces: ``max_connections``, but below the file-descriptor limit by
    :data:`FD_RESERVE`, so the connection over the limit is still accepted and answered 503 (over the fd limit
    ``accept()`` fails instead and the client waits unanswered)."""
    return max(1, min(configured, fd_limit - FD_RESERVE if fd_limit > 2 * FD_RESERVE else fd_limit // 2))


class WorkersRefused(ValueError):
    """``api_workers`` > 1 asked of a database that cannot have several controller processes (SQLite)."""


def check_workers(settings: Settings) -> None:
    """Several API worker processes need PostgreSQL: each is a controller process of its own (its snapshot woken
    by LISTEN/NOTIFY, a leader elected by advisory lock); SQLite has neither and is one controller by design."""
    if settings.api_workers > 1 and is_sqlite(parse_url(settings.database_url)):
        raise WorkersRefused(f"{settings.api_workers} API workers need PostgreSQL (the database is SQLite, one "
                             "controller process by design): use --workers 1 or a postgresql+psycopg:// database")


def _uvicorn_options(settings: Settings, max_connections: int) -> dict[str, Any]:
    """uvicorn's settings of a controller process (one or each worker); the protocol class is built apart
    (:func:`controller.http_limits.protocol_class`), it cannot cross a process boundary."""
    return dict(
        log_config=None,
        access_log=True,
        lifespan="on",
        timeout_graceful_shutdown=20,
        proxy_headers=False,
        server_header=False,
        # bounded work per connection (docs/deploy.md "Request limits"): header deadline, header size,
        # idle keep-alive, concurrency; body deadline and sizes are enforced in the app
        h11_max_incomplete_event_size=settings.max_header_bytes,
        timeout_keep_alive=int(max(1, settings.keepalive_timeout_seconds)),
        backlog=settings.listen_backlog,  # the event loop listens again with it (its default would be 2048)
        limit_concurrency=max_connections,
    )


def _protocol(settings: Settings) -> type:
    return protocol_class(settings.header_timeout_seconds, impl=settings.http_impl,  # type: ignore[arg-type]
                          max_header_bytes=settings.max_header_bytes)


class WorkerConfig(uvicorn.Config):
    """uvicorn's configuration of one API worker process. It crosses into the spawned worker by pickling (only
    the settings and plain options), and the worker builds what cannot: its logging, its state (engine, hub,
    elector), the app and the protocol class, then freezes its start-up heap (:func:`settle_heap`). A worker that
    cannot build its state exits with uvicorn's start-up failure code, which stops the parent instead of a
    restart loop."""

    def __init__(self, settings: Settings, *, workers: int, max_connections: int) -> None:
        self.settings = settings  # first: uvicorn.Config's __init__ calls configure_logging
        self.supervisor_pid = os.getpid()
        super().__init__("controller.server:WorkerConfig", workers=workers, http="h11",
                         timeout_worker_healthcheck=30,  # a worker busy in a full collection still answers
                         **_uvicorn_options(settings, max_connections))

    def configure_logging(self) -> None:
        """The worker's first step (uvicorn calls it in the new process, before serving; and in the parent,
        from ``__init__``, where the logging is already configured and the signals are the supervisor's)."""
        if os.getpid() == self.supervisor_pid:
            return
        configure_logging(self.settings.log_level, self.settings.log_format, process=True)
        # uvicorn re-raises the signal it stopped on, after its graceful shutdown, through the handler in place
        # before it started: a quiet exit with status 0 (a SIGTERM before serving ends the worker the same way)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _exit_quietly)

    def load(self) -> None:
        try:
            state = build_state(self.settings)
        except Exception as exc:  # database down, schema behind, keys unreadable: the parent stops
            log.error("API worker %d cannot start: %s", os.getpid(), first_line(exc))
            sys.exit(STARTUP_FAILURE)
        self.app = create_app(self.settings, state=state)
        self.http = _protocol(self.settings)
        super().load()
        settle_heap()


def _exit_quietly(_sig: int, _frame: object) -> None:
    raise SystemExit(0)


@contextlib.contextmanager
def metrics_directory() -> Iterator[Path]:
    """The directory where the workers' metrics meet (prometheus-client multiprocess mode), exported to the
    workers as ``PROMETHEUS_MULTIPROC_DIR``: the operator's (emptied of a previous run's files) or a fresh one,
    removed at exit."""
    given = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if given:
        path = Path(given)
        path.mkdir(parents=True, exist_ok=True)
        for stale in path.glob("*.db"):
            stale.unlink()
        yield path
        return
    path = Path(tempfile.mkdtemp(prefix="kernelctl-metrics-"))
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(path)
    try:
        yield path
    finally:
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        shutil.rmtree(path, ignore_errors=True)


def _write_port(port_file: Path | None, port: int) -> None:
    if port_file is not None:
        tmp = port_file.with_suffix(port_file.suffix + ".tmp")
        tmp.write_text(f"{port}\n")
        os.replace(tmp, port_file)


def _serve_workers(settings: Settings, sock: socket.socket, max_connections: int, port_file: Path | None) -> None:
    """Serve with ``settings.api_workers`` worker processes under uvicorn's supervisor until SIGTERM/SIGINT."""
    # the parent hashed the bootstrap tokens in (build_state): the workers need not, and must not race on it
    worker_settings = settings.model_copy(update={"bootstrap_tokens_file": None})
    with metrics_directory() as metrics_dir:
        config = WorkerConfig(worker_settings, workers=settings.api_workers, max_connections=max_connections)
        supervisor = Multiprocess(config, sockets=[sock])
        log.info("kernelctl controller: %d API worker processes (metrics in %s)", settings.api_workers, metrics_dir)
        _write_port(port_file, sock.getsockname()[1])
        supervisor.run()
    failed = [p.pid for p in supervisor.processes if p.exitcode == STARTUP_FAILURE]
    if failed:
        raise RuntimeError(f"API worker process {failed[0]} failed to start (its log line above says why)")


def serve(settings: Settings, *, port_file: Path | None = None) -> None:
    """Run the controller until SIGTERM/SIGINT. Raises DatabaseError/OSError/ValueError (WorkersRefused:
    several workers on SQLite) before serving."""
    configure_logging(settings.log_level, settings.log_format)
    check_workers(settings)
    parse_targets(settings.notify_urls)  # a bad KERNELCTL_NOTIFY_URLS is refused before anything starts
    _upgrade_embedded_database(settings.database_url)
    state = build_state(settings)  # fail fast: DB reachable, schema at head, keys and tokens loaded
    fd_limit = _raise_fd_limit()
    max_connections = connection_limit(settings.max_connections, fd_limit)
    if max_connections < settings.max_connections:
        log.warning("max_connections %d lowered to %d: the file-descriptor limit (ulimit -n) is %d",
                    settings.max_connections, max_connections, fd_limit)
    sock = bind_socket(settings.listen_host, settings.listen_port, settings.listen_backlog,
                       per_worker=settings.api_workers > 1)
    host, port = sock.getsockname()[:2]
    if settings.public_url is None and host not in ("0.0.0.0", "::"):  # notifications link to the bound address
        shown = f"[{host}]" if ":" in host else host
        settings = state.settings = settings.model_copy(update={"public_url": f"http://{shown}:{port}"})
    protocol = _protocol(settings)
    log.info("kernelctl controller listening on http://%s:%d (database %s, http %s)", host, port,
             state.engine.url.render_as_string(hide_password=True), protocol.http_impl)  # type: ignore[attr-defined]
    if settings.api_workers > 1:
        state.engine.dispose()  # the workers build their own; the parent only supervises them
        try:
            _serve_workers(settings, sock, max_connections, port_file)
        finally:
            sock.close()
        log.info("kernelctl controller stopped")
        return
    app = create_app(settings, state=state)
    config = uvicorn.Config(app, http=protocol, **_uvicorn_options(settings, max_connections))
    server = uvicorn.Server(config)
    _write_port(port_file, port)
    # uvicorn re-raises the signal it stopped on (after a graceful shutdown) through the handler that was in
    # place before it started: make that handler ask for the same graceful exit, so SIGTERM exits 0.
    def _graceful(_sig: int, _frame: object) -> None:
        server.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _graceful)
    settle_heap()
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    log.info("kernelctl controller stopped")
