"""What the test suite needs on the machine, provisioned by the suite itself, so that the README's test command
(``scripts/venv && .venv/bin/python -m pytest``) passes on a fresh machine with nothing started by hand:

- :func:`chromium`: Debian's chromium and chromedriver for the browser tests, installed with apt-get when
  missing (``KERNELCTL_TEST_CHROMIUM`` / ``KERNELCTL_TEST_CHROMEDRIVER`` name others);
- :class:`PgCluster`: a PostgreSQL cluster of the tests' own (initdb + pg_ctl of the installed server, on a free
  loopback port and a temporary data directory, as the ``postgres`` user when the tests run as root). The session
  starts one when nothing answers at the configured URL (tests/conftest.py), and the PostgreSQL restart test
  restarts only its own: the suite never starts, stops or restarts a server it did not start.

``.ci/run`` installs nothing itself: it runs the README's test command.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pwd
import re
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path


class ProvisionError(RuntimeError):
    """Something the tests need is missing and could not be installed or started (the message says what to do)."""


@contextlib.contextmanager
def _machine_lock(name: str) -> Iterator[None]:
    """One installer at a time on the machine (xdist workers, other checkouts' test runs)."""
    with open(Path(tempfile.gettempdir()) / f"kernelctl-tests-{name}.lock", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def apt_install(packages: list[str], why: str) -> None:
    """``apt-get install`` Debian packages (no recommends), through ``sudo -n`` when not root."""
    if not shutil.which("apt-get"):
        raise ProvisionError(f"{why}: install {' '.join(packages)} (no apt-get on this machine)")
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    if sudo and not shutil.which("sudo"):
        raise ProvisionError(f"{why}: install {' '.join(packages)} as root (not root here, and no sudo)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in ([*sudo, "apt-get", "update", "-qq"],
                [*sudo, "apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages]):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=False)
        if done.returncode != 0:
            raise ProvisionError(f"{why}: `{' '.join(cmd)}` failed ({done.returncode}): "
                                 f"{(done.stderr or done.stdout).strip()[-600:]}")


# ------------------------------------------------------------------------------------------------ chromium
def _chromium_paths() -> tuple[str | None, str | None]:
    browser = os.environ.get("KERNELCTL_TEST_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    driver = os.environ.get("KERNELCTL_TEST_CHROMEDRIVER") or shutil.which("chromedriver")
    return browser, driver


def chromium() -> tuple[str, str]:
    """Paths of chromium and its chromedriver; installs Debian's ``chromium`` and ``chromium-driver`` (and a font,
    for readable screenshots) when either is missing."""
    browser, driver = _chromium_paths()
    if browser and driver:
        return browser, driver
    with _machine_lock("apt"):
        browser, driver = _chromium_paths()  # another process may have installed them meanwhile
        if not (browser and driver):
            apt_install(["chromium", "chromium-driver", "fonts-liberation"],
                        "the browser tests need Debian's chromium and chromium-driver")
            browser, driver = _chromium_paths()
    if not (browser and driver):
        raise ProvisionError("chromium/chromedriver still missing after apt-get install chromium chromium-driver")
    return browser, driver


# ---------------------------------------------------------------------------------------------- PostgreSQL
def _version(path: Path) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", path.parent.name)) or (0,)


def postgres_bindir() -> Path:
    """The installed PostgreSQL server's bin directory (``KERNELCTL_TEST_PG_BINDIR``, else the newest
    /usr/lib/postgresql/*/bin, else initdb on PATH); installs Debian's ``postgresql`` when there is none."""
    def find() -> Path | None:
        if os.environ.get("KERNELCTL_TEST_PG_BINDIR"):
            return Path(os.environ["KERNELCTL_TEST_PG_BINDIR"])
        found = sorted((p.parent for p in Path("/usr/lib/postgresql").glob("*/bin/initdb")), key=_version)
        if found:
            return found[-1]
        on_path = shutil.which("initdb")
        return Path(on_path).resolve().parent if on_path else None

    bindir = find()
    if bindir is None:
        with _machine_lock("apt"):
            bindir = find()
            if bindir is None:
                apt_install(["postgresql"], "the database tests need a PostgreSQL server")
                bindir = find()
    if bindir is None or not (bindir / "pg_ctl").exists():
        raise ProvisionError("no PostgreSQL server binaries (initdb, pg_ctl) found: install postgresql or set "
                             "KERNELCTL_TEST_PG_BINDIR")
    return bindir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PgCluster:
    """A throw-away PostgreSQL cluster: ``start()`` runs initdb in a new temporary directory and starts the server
    on a free loopback port (trust auth, superuser ``postgres``); ``restart()`` restarts it; ``stop()`` stops it
    and removes the directory. PostgreSQL refuses to run as root: when the tests do, the directory belongs to the
    ``postgres`` user and its commands run through ``runuser``."""

    def __init__(self, name: str = "cluster") -> None:
        self.name = name
        self.root: Path | None = None
        self.port: int | None = None
        self.bindir = postgres_bindir()
        self._as: list[str] = []
        if os.geteuid() == 0:
            try:
                pwd.getpwnam("postgres")
            except KeyError:
                raise ProvisionError("tests run as root and there is no `postgres` user to run PostgreSQL as") from None
            self._as = ["runuser", "-u", "postgres", "--"]

    @property
    def data(self) -> Path:
        assert self.root is not None, "cluster not started"
        return self.root / "data"

    @property
    def url(self) -> str:
        """SQLAlchemy URL of the cluster's ``postgres`` database."""
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, tool: str, *args: str, timeout: float = 120) -> None:
        """Run a server tool; its output goes to a file (a pipe would stay open in the server it starts)."""
        cmd = [*self._as, str(self.bindir / tool), *args]
        with tempfile.TemporaryFile() as out:
            code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  timeout=timeout, check=False).returncode
            out.seek(0)
            said = out.read().decode(errors="replace").strip()
        if code != 0:
            log = self.log_tail()
            raise ProvisionError(f"{tool} failed ({code}): {said[-800:]}" + (f"\nserver log:\n{log}" if log else ""))

    def log_tail(self, lines: int = 20) -> str:
        log = self.root / "server.log" if self.root else None
        if log is None or not log.exists():
            return ""
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])

    def start(self, *, tries: int = 3) -> PgCluster:
        self.root = Path(tempfile.mkdtemp(prefix=f"kernelctl-pg-{self.name}-"))
        if self._as:
            shutil.chown(self.root, "postgres", "postgres")
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync",
                  "--no-instructions")
        for attempt in range(tries):  # another process may take the free port before the server binds it
            self.port = free_port()
            opts = (f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={self.root} "
                    "-c fsync=off -c max_connections=200")
            try:
                self._run("pg_ctl", "-D", str(self.data), "-l", str(self.root / "server.log"), "-o", opts,
                          "-w", "-t", "120", "start", timeout=180)
                return self
            except ProvisionError:
                if attempt == tries - 1:
                    self.stop()
                    raise
        return self

    def restart(self, mode: str = "fast") -> None:
        """Restart the server (same port and options); returns when it accepts connections again."""
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.root / "server.log"), "-m", mode, "-w", "-t", "120",
                  "restart", timeout=180)

    @property
    def running(self) -> bool:
        return self.root is not None and (self.data / "postmaster.pid").exists()

    def stop(self) -> None:
        """Stop the server (immediate: nothing to keep) and remove its directory."""
        if self.root is None:
            return
        if self.running:
            with contextlib.suppress(ProvisionError, subprocess.TimeoutExpired):
                self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "-t", "60", "stop", timeout=90)
        shutil.rmtree(self.root, ignore_errors=True)
        self.root = None

    def __enter__(self) -> PgCluster:
        return self if self.root is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

