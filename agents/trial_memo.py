"""Which deterministic numeric checks a CPU node already passed, so a repeat trial need not run them again.

A trial's golden vectors, edge values and production-shape checks use inputs that are a function of the
bundles, op, dtype and shape only (``kernelpack.harness.edge.edge_seed``, the golden files); on a CPU node
the Triton interpreter computes the same bits from the same inputs, so once a node passed them for a
(candidate, stable) pair, running them again in the next paired trial cannot give another answer. The trial
child records the pass here (a small JSON file in the node's loader cache) and later trials of the pair run
only the fuzzing (fresh seed each trial), capacity and latency phases. GPU nodes never use this: there
every trial checks again (a racy kernel may pass once). The key covers both digests, the node's arch, the
checked dtypes and production sizes, the torch and Triton versions and the checking code itself, so any
change to what would be computed starts over.
"""

from __future__ import annotations

import hashlib
import json
import time
from contextlib import suppress
from pathlib import Path
from typing import Any

from agents.trial_protocol import WorkerSpec, write_json_atomic


class NumericsMemo:
    """One (node, candidate, stable, sizes, code) key's record of passed deterministic numeric checks."""

    KINDS = ("golden", "stable_golden", "edge", "production")

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def for_trial(cls, spec: WorkerSpec, device_type: str, *, has_stable: bool) -> NumericsMemo | None:
        """The memo of this trial's checks; None on a GPU (checks always run there)."""
        if device_type != "cpu":
            return None
        import torch
        import triton

        from kernelpack.harness import edge, golden, numerics
        from kernelpack.kernels import spec as kspec

        code = hashlib.sha256()
        here = Path(__file__).resolve()
        for path in (*(Path(m.__file__ or "") for m in (edge, golden, numerics, kspec)),
                     here.with_name("trial_worker.py"), here):  # the worker runs as __main__: by path
            with suppress(OSError):
                code.update(path.read_bytes())
        key = json.dumps({"v": 1, "candidate": spec.candidate_digest,
                          "stable": spec.stable_digest if has_stable else None, "arch": spec.arch,
                          "dtypes": spec.dtypes, "batch": sorted(spec.batch_sizes),
                          "prefill": sorted(spec.prefill_tokens), "max_tokens": spec.numerics_max_tokens,
                          "torch": torch.__version__, "triton": triton.__version__, "code": code.hexdigest()},
                         sort_keys=True)
        digest = hashlib.sha256(key.encode()).hexdigest()[:32]
        return cls(Path(spec.loader_cache_dir) / "trial-memo" / f"{spec.candidate_digest[:16]}-{digest}.json")

    def passed(self) -> dict[str, Any] | None:
        """The record of the earlier pass ({"at", "checks", "seed"}), or None when there is none."""
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def record(self, checks: int, seed: int) -> None:
        """Record that every deterministic check passed (best effort: a failed write only costs a rerun)."""
        with suppress(OSError):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(self.path, {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                          "checks": checks, "seed": seed})
