"""``serve(settings)``: run the controller under uvicorn, programmatically, with graceful SIGTERM.

The socket is bound before uvicorn starts (port 0 picks a free port); the bound address is logged and,
with ``port_file``, written to a file so that tests and supervisors learn it without racing. On SIGTERM
or SIGINT uvicorn stops accepting, finishes in-flight requests, and the lifespan stops the scheduler and
releases leadership. Access logs carry method, path and status only: never headers, so never tokens.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import signal
import socket
import sys
from pathlib import Path

import uvicorn

from controller.api.app import build_state, create_app
from controller.http_limits import protocol_class
from controller.notify import parse_targets
from kernelctl.settings import Settings

log = logging.getLogger("kernelctl.server")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S%z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc)


def configure_logging(level: str = "INFO", fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        lg = logging.getLogger(name)
        lg.handlers[:] = []
        lg.propagate = True
    logging.getLogger("apscheduler").setLevel(logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)  # no "Context impl" lines on every /readyz


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


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
    """Before serving: what start-up built (modules, the app and its state) lives as long as the process, so it
    is frozen out of the cyclic garbage collector's scans (``gc.freeze``), young collections come every 10,000
    allocations instead of 700, and a full collection is considered after 100 middle ones instead of 10 (each
    full one scans every live object: at 10,000 nodes the watches, connections and snapshot, 0.5-2 s). Measured (docs/benchmarks.md, issue 28): at 1,000 nodes the collector's
    full collections scanned that start-up heap every 1-3 s, 0.2-0.5 s each, with the GIL held: the event loop
    (heartbeats, watches, every reply) stood still for as long."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 10, 100)


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


def serve(settings: Settings, *, port_file: Path | None = None) -> None:
    """Run the controller until SIGTERM/SIGINT. Raises DatabaseError/OSError/ValueError before serving."""
    configure_logging(settings.log_level, settings.log_format)
    parse_targets(settings.notify_urls)  # a bad KERNELCTL_NOTIFY_URLS is refused before anything starts
    _upgrade_embedded_database(settings.database_url)
    state = build_state(settings)  # fail fast: DB reachable, schema at head, keys and tokens loaded
    fd_limit = _raise_fd_limit()
    max_connections = connection_limit(settings.max_connections, fd_limit)
    if max_connections < settings.max_connections:
        log.warning("max_connections %d lowered to %d: the file-descriptor limit (ulimit -n) is %d",
                    settings.max_connections, max_connections, fd_limit)
    sock = bind_socket(settings.listen_host, settings.listen_port)
    host, port = sock.getsockname()[:2]
    if settings.public_url is None and host not in ("0.0.0.0", "::"):  # notifications link to the bound address
        shown = f"[{host}]" if ":" in host else host
        settings = state.settings = settings.model_copy(update={"public_url": f"http://{shown}:{port}"})
    app = create_app(settings, state=state)
    protocol = protocol_class(settings.header_timeout_seconds, impl=settings.http_impl,  # type: ignore[arg-type]
                              max_header_bytes=settings.max_header_bytes)
    config = uvicorn.Config(
        app,
        log_config=None,
        access_log=True,
        lifespan="on",
        timeout_graceful_shutdown=20,
        proxy_headers=False,
        server_header=False,
        # bounded work per connection (docs/deploy.md "Request limits"): header deadline, header size,
        # idle keep-alive, concurrency; body deadline and sizes are enforced in the app
        http=protocol,
        h11_max_incomplete_event_size=settings.max_header_bytes,
        timeout_keep_alive=int(max(1, settings.keepalive_timeout_seconds)),
        limit_concurrency=max_connections,
    )
    server = uvicorn.Server(config)
    log.info("kernelctl controller listening on http://%s:%d (database %s, http %s)", host, port,
             state.engine.url.render_as_string(hide_password=True), protocol.http_impl)
    if port_file is not None:
        tmp = port_file.with_suffix(port_file.suffix + ".tmp")
        tmp.write_text(f"{port}\n")
        os.replace(tmp, port_file)
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
