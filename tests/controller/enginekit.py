"""Test kit for the rollout-engine tests: real signed bundles, nodes, reports and a session per step.

Bundles are real ``.kpack`` archives signed with a fresh ed25519 key and verified by ``register_bundle``
(no kernels are compiled: the archive carries one kernel module, no artifacts).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import itertools
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from controller import registry
from controller.compat import node_stratum
from controller.db.engine import make_engine, session_factory
from controller.db.models import Bundle, Event, Node
from kernelctl import wire
from kernelpack.archive import write_archive
from kernelpack.manifest import (
    BuiltKernel,
    FileEntry,
    Manifest,
    Targets,
    ToleranceEntry,
    Traffic,
)
from kernelpack.signing import generate_keypair, load_private_key, sign

T0 = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.timezone.utc)
KERNEL_SRC = b"OP = None  # test bundle: never imported by the engine\n"


def make_kpack(key_path: Path, out: Path, *, name: str = "llm-fused", version: str = "1.0.0",
               archs: tuple[str, ...] = ("sm_90",), min_driver: str = "535", triton: str = "3.6.0",
               torch: str = ">=2.9,<2.15", cuda: tuple[str, ...] = ("12.x",),
               batches: tuple[int, ...] = (1, 4, 16, 64), prefill: tuple[int, ...] = (64, 512, 2048),
               tolerances: dict[str, tuple[float, float]] | None = None,
               limitations: dict[str, Any] | None = None, ops: tuple[str, ...] = ("bias_gelu",)) -> bytes:
    """A real signed bundle archive (bytes) with the given targets, traffic profile and ops (one module each,
    never imported)."""
    modules = {op: f"kernels/{op}.py" for op in ops}
    manifest = Manifest(
        schema_version=1, name=name, version=version, note="engine test bundle",
        targets=Targets(archs=list(archs), min_driver=min_driver, cuda=list(cuda), triton=triton, torch=torch),
        traffic=Traffic(decode_batch_sizes=list(batches), prefill_tokens=list(prefill)),
        kernels=[BuiltKernel(op=op, source=f"kernelpack.kernels.{op}", module=module,
                             limitations=limitations or {}, tolerances={
                                 d: ToleranceEntry(atol=a, rtol=r)
                                 for d, (a, r) in (tolerances or {"fp16": (1e-3, 1e-3)}).items()})
                 for op, module in modules.items()],
        files={m: FileEntry(sha256=hashlib.sha256(KERNEL_SRC).hexdigest(), size=len(KERNEL_SRC))
               for m in modules.values()},
        artifacts=[], golden=[],
    )
    mb = manifest.to_bytes()
    sig = sign(mb, load_private_key(key_path)).to_bytes()
    return write_archive(out / f"{name}-{version}.kpack", {"manifest.json": mb, "signature.json": sig,
                                                          **dict.fromkeys(modules.values(), KERNEL_SRC)})


def inventory(arch: str = "sm_90", driver: str = "550.54.15", triton: str = "3.6.0", torch: str = "2.11.0",
              cuda: str = "12.4", labels: dict[str, str] | None = None, gpu: str = "NVIDIA H100") -> wire.Inventory:
    cc = "cpu" if arch == "cpu" else f"{arch[3:-1]}.{arch[-1]}"
    return wire.Inventory(gpu_name=gpu, compute_capability=cc, arch=arch, driver_version=driver, cuda_version=cuda,
                          triton_version=triton, torch_version=torch, memory_total_mb=81920, labels=labels or {})


class Kit:
    """A fresh database plus helpers; every helper is one committed transaction unless given a session."""

    def __init__(self, url: str, tmp: Path) -> None:
        self.engine = make_engine(url)
        self.factory = session_factory(self.engine)
        self.tmp = tmp
        keys = tmp / "keys"
        self.keypair = generate_keypair(keys)
        self.trusted = tmp / "trusted"
        self.trusted.mkdir()
        (self.trusted / self.keypair.public_path.name).write_bytes(self.keypair.public_path.read_bytes())
        self._keys = itertools.count()

    def close(self) -> None:
        self.engine.dispose()

    @contextmanager
    def tx(self) -> Iterator[Session]:
        with self.factory() as s, s.begin():
            yield s

    def kpack(self, version: str = "1.0.0", **kw: Any) -> bytes:
        return make_kpack(self.keypair.private_path, self.tmp, version=version, **kw)

    def push(self, version: str = "1.0.0", **kw: Any) -> int:
        data = self.kpack(version, **kw)
        with self.tx() as s:
            return registry.register_bundle(s, data, actor="op", trusted_keys=self.trusted).id

    def nodes(self, n: int, *, prefix: str = "gpu", now: dt.datetime = T0, **inv: Any) -> list[str]:
        names = [f"{prefix}-{i:03d}" for i in range(n)]
        with self.tx() as s:
            for name in names:
                registry.register_node(s, name, inventory(**inv), actor="enroll", now=now)
        return names

    def node(self, s: Session, name: str) -> Node:
        return s.scalar(select(Node).where(Node.name == name))

    def ref(self, bundle_id: int) -> wire.BundleRef:
        with self.tx() as s:
            b = s.get(Bundle, bundle_id)
            return wire.BundleRef(name=b.name, version=b.version, digest=b.digest)

    def events(self, action: str | None = None, **where: Any) -> list[Event]:
        with self.tx() as s:
            stmt = select(Event).order_by(Event.id)
            if action:
                stmt = stmt.where(Event.action == action)
            for k, v in where.items():
                stmt = stmt.where(getattr(Event, k) == v)
            return list(s.scalars(stmt))

    def report(self, node: Node, rollout_id: int, candidate: wire.BundleRef, stable: wire.BundleRef | None, *,
               outcome: str = "ok", ratio: float | None = 0.0, pairs: int = 3, at: dt.datetime = T0,
               key: str | None = None, **kw: Any) -> wire.TrialReport:
        """A trial report whose pairs all have ln(candidate/stable) == ``ratio``."""
        lat = []
        if ratio is not None:
            lat = [wire.LatencyPair(op="bias_gelu", tokens=16, stable_s=1e-3, candidate_s=1e-3 * math.exp(ratio))
                   for _ in range(pairs)]
        kw.setdefault("numerics", [wire.NumericCheck(op="bias_gelu", dtype="fp32", shape={"tokens": 16}, max_abs_err=0.0,
                                                     max_rel_err=0.0, within_tolerance=True, kind="production")])
        return wire.TrialReport(
            idempotency_key=key or f"{node.name}:{rollout_id}:{next(self._keys):06d}", rollout_id=rollout_id,
            stratum=node_stratum(node), candidate=candidate, stable=stable, outcome=outcome, measured_at=at,
            latency=lat, **kw)


def generation(kit: Kit) -> int:
    """The desired-state generation the database holds now."""
    from controller.desired.generation import read_generation

    with kit.tx() as s:
        return read_generation(s)


def generation_kit(url: str, tmp: Path) -> Iterator[Kit]:
    """A :class:`Kit` whose sessions bump the desired-state generation (``controller.desired``), closed after."""
    from controller.desired.generation import install_generation_hooks

    k = Kit(url, tmp)
    install_generation_hooks(k.factory)
    yield k
    k.close()
