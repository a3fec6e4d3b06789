"""What serving code imports: the node's active kernel ops, switched atomically by the agent.

The agent publishes ``active.json`` in the runtime directory (``$KERNELCTL_RUNTIME_DIR``)::

    {"llm-fused": {"version": "1.1.0", "path": "...", "digest": "...",
                   "stable": {"version": "1.0.0", "path": "...", "digest": "..."}}}

with :func:`publish_active` (read-modify-write under a lock file, write-to-temp + fsync + ``os.replace``), so
a reader sees either the old or the new document, never a mix. Several bundles may be active at once (an
attention bundle and a norm bundle rolled out independently): :func:`get_op` resolves each op from the one
active bundle that provides it (its active version's manifest, or the stable version's when the active one
cannot load); an op that two active bundles provide is refused (the PyTorch path serves it, and
:attr:`Runtime.reason` says why: the controller refuses such a rollout at start). Given a bundle name, get_op
serves from that bundle only. :func:`unpublish_active` removes a withdrawn bundle the same way (no version
of it serves: ``get_op`` falls back to the PyTorch reference). :func:`get_op` re-reads the file when its
inode/mtime/size change and returns the active version's op, falling back to the stable version and then to
the installed PyTorch path (each fallback logged). Call ``get_op`` per use (it is one ``stat`` when nothing
changed); loaded versions stay cached by digest so switching back is instant.

Code that captures kernel launches (CUDA graphs, compiled graphs) never calls ``get_op`` again once captured, so
the runtime also says *when* what it serves may have changed: :attr:`Runtime.generation` goes up by one each
time a new active document is seen, :meth:`Runtime.poll` checks for one (one ``stat``) and returns the
generation, :meth:`Runtime.served_key` names the versions a bundle (or, given no name, every active bundle)
is served from (equal keys: the same kernels, so a capture made under one key stays valid under it), :meth:`Runtime.subscribe` registers a callback
run after each change, and :meth:`Runtime.watch` polls from a daemon thread for processes with no step loop.
``kernelpack.integrations.graphs`` uses these to re-capture after a switch.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kernelpack.errors import BundleError

if TYPE_CHECKING:  # torch/triton are imported on first get_op, so publishing stays light for the agent
    from kernelpack.loader import BoundOp, LoadedBundle

log = logging.getLogger("kernelpack.runtime")

ACTIVE_FILE = "active.json"
RUNTIME_DIR_ENV = "KERNELCTL_RUNTIME_DIR"
TRUSTED_KEYS_ENV = "KERNELCTL_TRUSTED_KEYS_DIR"
CACHE_DIR_ENV = "KERNELCTL_CACHE_DIR"


class ActiveRef(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    version: str = Field(min_length=1)
    path: str = Field(min_length=1)
    digest: str = Field(pattern=r"^[0-9a-f]{64}$")


class ActiveEntry(ActiveRef):
    stable: ActiveRef | None = None


def _ref(obj: ActiveRef | Mapping[str, Any] | None) -> ActiveRef | None:
    if obj is None or isinstance(obj, ActiveRef):
        return obj
    return ActiveRef.model_validate(dict(obj))


def read_active(runtime_dir: Path) -> dict[str, ActiveEntry]:
    """The published document ({} when none has been published yet)."""
    try:
        data = (Path(runtime_dir) / ACTIVE_FILE).read_bytes()
    except FileNotFoundError:
        return {}
    raw = json.loads(data)
    return {name: ActiveEntry.model_validate(v) for name, v in raw.items()}


def publish_active(
    runtime_dir: Path,
    bundle_name: str,
    version: str,
    path: Path | str,
    digest: str,
    stable: ActiveRef | Mapping[str, Any] | None = None,
) -> None:
    """Atomically set the active (and stable) version of ``bundle_name`` for this node's serving processes."""
    try:
        entry = ActiveEntry(version=version, path=str(path), digest=digest, stable=_ref(stable))
    except ValidationError as exc:
        raise ValueError(f"invalid active entry for {bundle_name}: {exc.errors()[0]['msg']}") from exc

    def put(doc: dict[str, Any]) -> bool:
        doc[bundle_name] = entry.model_dump(mode="json")
        return True

    Path(runtime_dir).mkdir(parents=True, exist_ok=True)
    _rewrite(Path(runtime_dir), put)


def unpublish_active(runtime_dir: Path, bundle_name: str) -> bool:
    """Atomically remove ``bundle_name`` from the published versions (it was withdrawn: no version of it may
    serve); serving code then falls back to the PyTorch reference. False when it was not published."""

    def drop(doc: dict[str, Any]) -> bool:
        return doc.pop(bundle_name, None) is not None

    return Path(runtime_dir).is_dir() and _rewrite(Path(runtime_dir), drop)


def _rewrite(runtime_dir: Path, change: Callable[[dict[str, Any]], bool]) -> bool:
    """Read-modify-write of the active document under its lock file: ``change`` edits the document in place
    and says whether it changed; a changed document replaces the old one atomically (temp + fsync + rename)."""
    with open(runtime_dir / f"{ACTIVE_FILE}.lock", "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        doc = {k: v.model_dump(mode="json") for k, v in read_active(runtime_dir).items()}
        if not change(doc):
            return False
        fd, tmp = tempfile.mkstemp(dir=runtime_dir, prefix=f".{ACTIVE_FILE}.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(json.dumps(doc, sort_keys=True, indent=1).encode())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, runtime_dir / ACTIVE_FILE)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return True


def reference_op(name: str) -> BoundOp:
    """The installed ``kernelpack.kernels.<name>`` op bound to its PyTorch eager path only."""
    from kernelpack.loader import BoundOp, installed_op

    op = installed_op(name)
    if op is None:
        raise LookupError(f"no bundle provides {name} and kernelpack has no reference for it")
    return BoundOp(name, op, {}, None, "reference", Path(), unsupported="no usable bundle (PyTorch reference)")


@dataclass
class Runtime:
    """Tracks active.json in ``runtime_dir`` and serves ops from the published bundles."""

    runtime_dir: Path | None
    trusted_keys: Path | None
    cache_dir: Path | None = None
    arch: str | None = None
    _stamp: tuple[int, int, int] | None = None
    _active: dict[str, ActiveEntry] = field(default_factory=dict)
    _loaded: dict[str, LoadedBundle] = field(default_factory=dict)  # by digest
    _failed: dict[str, str] = field(default_factory=dict)  # digest -> reason
    _refs: dict[str, BoundOp] = field(default_factory=dict)  # op -> reference-only op
    _providers: dict[str, list[str]] = field(default_factory=dict)  # op -> active bundles providing it
    _providers_gen: int = -1  # the generation _providers was computed for
    _lock: threading.Lock = field(default_factory=threading.Lock)
    # bundle -> why it is not on the active version; op -> why no single active bundle serves it
    reason: dict[str, str] = field(default_factory=dict)
    generation: int = 0  # +1 each time a new active document is seen (see module docstring)
    _listeners: list[Callable[[int], None]] = field(default_factory=list)
    _watcher: threading.Thread | None = None
    _stop: threading.Event = field(default_factory=threading.Event)

    def _refresh(self) -> None:
        if self.runtime_dir is None:
            return
        try:
            st = os.stat(self.runtime_dir / ACTIVE_FILE)
            stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            stamp = None
        if stamp == self._stamp:
            return
        try:
            active = read_active(self.runtime_dir)
        except (OSError, ValueError) as exc:  # unreadable document: keep serving what we had
            log.error("cannot read %s: %s; keeping the previous versions", ACTIVE_FILE, exc)
            return
        changed = active != self._active
        self._active, self._stamp = active, stamp
        if changed:
            self.generation += 1

    def poll(self) -> int:
        """Re-read the active document if it changed (one ``stat`` otherwise); the current generation.

        Subscribers are called (outside the lock, in this thread) when the generation went up."""
        with self._lock:
            before = self.generation
            self._refresh()
            after = self.generation
        if after != before:
            self._notify(after)
        return after

    def served_key(self, bundle: str | None = None) -> tuple[Any, ...]:
        """(active digest, stable digest) of ``bundle`` as last read ("" where none): what get_op serves from;
        without a bundle, (name, active digest, stable digest) of every active bundle."""
        if bundle is None:
            return tuple((name, *self.served_key(name)) for name in sorted(self._active))
        entry = self._active.get(bundle)
        if entry is None:
            return ("", "")
        return (entry.digest, entry.stable.digest if entry.stable is not None else "")

    def providers(self, name: str) -> list[str]:
        """The active bundles whose manifest provides op ``name`` (one, for an op that is served from a bundle)."""
        self.poll()
        with self._lock:
            return list(self._provided().get(name, []))

    def _provided(self) -> dict[str, list[str]]:
        """op -> the active bundles providing it, recomputed once per generation (under the lock)."""
        if self._providers_gen != self.generation:
            provided: dict[str, list[str]] = {}
            for bundle, entry in sorted(self._active.items()):
                lb = self._load(entry) or (self._load(entry.stable) if entry.stable is not None else None)
                for op in sorted(lb.ops if lb is not None else ()):
                    provided.setdefault(op, []).append(bundle)
            self._providers, self._providers_gen = provided, self.generation
        return self._providers

    def active_version(self, bundle: str = "llm-fused") -> str | None:
        entry = self._active.get(bundle)
        return entry.version if entry is not None else None

    def subscribe(self, callback: Callable[[int], None]) -> Callable[[], None]:
        """Call ``callback(generation)`` after every change seen by :meth:`poll`, ``get_op`` or the watcher;
        returns a function that unsubscribes it."""
        with self._lock:
            self._listeners.append(callback)

        def unsubscribe() -> None:
            with self._lock:
                if callback in self._listeners:
                    self._listeners.remove(callback)

        return unsubscribe

    def _notify(self, generation: int) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for cb in listeners:
            try:
                cb(generation)
            except Exception:  # a listener's failure must not stop serving
                log.exception("kernel switch listener %r failed", cb)

    def watch(self, interval_s: float = 0.05) -> threading.Thread:
        """Poll every ``interval_s`` from a daemon thread (idempotent): subscribers then hear of a switch
        within ``interval_s`` plus one ``stat`` even when no step calls :meth:`poll`."""
        if interval_s <= 0:
            raise ValueError("watch interval must be positive")
        with self._lock:
            if self._watcher is not None and self._watcher.is_alive():
                return self._watcher
            self._stop.clear()

            def loop() -> None:
                while not self._stop.wait(interval_s):
                    self.poll()

            self._watcher = threading.Thread(target=loop, name="kernelctl-runtime-watch", daemon=True)
            self._watcher.start()
            return self._watcher

    def stop_watching(self) -> None:
        self._stop.set()
        w = self._watcher
        if w is not None and w is not threading.current_thread():
            w.join(timeout=5)
        self._watcher = None

    def _load(self, ref: ActiveRef) -> LoadedBundle | None:
        hit = self._loaded.get(ref.digest)
        if hit is not None:
            return hit
        if ref.digest in self._failed:
            return None
        if self.trusted_keys is None:
            self._failed[ref.digest] = f"{TRUSTED_KEYS_ENV} is not set: bundles cannot be verified"
            log.error("cannot load %s: %s", ref.path, self._failed[ref.digest])
            return None
        from kernelpack.loader import load_bundle

        try:
            lb = load_bundle(Path(ref.path), self.trusted_keys, arch=self.arch, cache_dir=self.cache_dir,
                             digest=ref.digest)
        except (BundleError, OSError) as exc:
            self._failed[ref.digest] = str(exc)
            log.error("cannot load bundle %s (%s): %s", ref.version, ref.path, exc)
            return None
        self._loaded[ref.digest] = lb
        return lb

    def get_op(self, name: str, bundle: str | None = None) -> BoundOp:
        """Op ``name`` from the active bundle that provides it (or from ``bundle``), with its fallbacks."""
        before = self.generation
        try:
            return self._get_op(name, bundle)
        finally:
            if self.generation != before:
                self._notify(self.generation)

    def _get_op(self, name: str, bundle: str | None) -> BoundOp:
        with self._lock:
            self._refresh()
            if bundle is None:
                providers = self._provided().get(name, [])
                if len(providers) != 1:
                    why = (f"{name} is provided by {len(providers)} active bundles ({', '.join(providers)}): "
                           "refusing to choose" if providers else f"no active bundle provides {name}")
                    self._note(name, f"{why}; serving the PyTorch reference for {name}")
                    return self._ref(name)
                self.reason.pop(name, None)
                bundle = providers[0]
            entry = self._active.get(bundle)
            if entry is None:
                why = f"no active version of {bundle} published"
            else:
                lb = self._load(entry)
                if lb is not None and name in lb.ops:
                    self.reason.pop(bundle, None)
                    return lb.ops[name]
                why = f"active {bundle}@{entry.version} unusable: " + (
                    self._failed.get(entry.digest) or f"it has no op {name}")
                if entry.stable is not None:
                    sb = self._load(entry.stable)
                    if sb is not None and name in sb.ops:
                        self._note(bundle, f"{why}; serving stable {entry.stable.version}")
                        return sb.ops[name]
            self._note(bundle, f"{why}; serving the PyTorch reference for {name}")
            return self._ref(name)

    def _ref(self, name: str) -> BoundOp:
        if name not in self._refs:
            self._refs[name] = reference_op(name)
        return self._refs[name]

    def _note(self, bundle: str, why: str) -> None:
        if self.reason.get(bundle) != why:
            log.warning("%s", why)
        self.reason[bundle] = why


_default: Runtime | None = None
_default_lock = threading.Lock()


def default_runtime() -> Runtime:
    """The process-wide runtime configured from ``KERNELCTL_RUNTIME_DIR`` / ``KERNELCTL_TRUSTED_KEYS_DIR``."""
    global _default
    with _default_lock:
        if _default is None:
            rd, tk, cd = (os.environ.get(k) for k in (RUNTIME_DIR_ENV, TRUSTED_KEYS_ENV, CACHE_DIR_ENV))
            _default = Runtime(Path(rd) if rd else None, Path(tk) if tk else None, Path(cd) if cd else None)
        return _default


def get_op(name: str, bundle: str | None = None) -> BoundOp:
    """The op ``name`` of the node's active bundle that provides it, or of ``bundle`` (see module docstring)."""
    return default_runtime().get_op(name, bundle)
