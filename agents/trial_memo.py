"""Which deterministic numeric checks a node already passed for a (candidate, stable) pair, so a repeat trial
need not run them again, and how a GPU node keeps catching racy kernels while it skips them.

A trial's golden vectors, edge values and production-shape checks use inputs that are a function of the
bundles, op, dtype and shape only (``kernelpack.harness.edge.edge_seed``, the golden files). The trial child
records a pass here (a small JSON file in the node's loader cache); what a later trial of the pair skips
depends on the mode (:class:`kernelctl.vocab.NumericsMemoMode`, the node profile's ``numerics_memo``):

* ``skip`` (default on CPU nodes): the Triton interpreter computes the same bits from the same inputs, so
  running the golden, edge and production checks again cannot give another answer; later trials run only the
  fuzzing (fresh seed), capacity and latency phases.
* ``fingerprint`` (default on GPU nodes). On a GPU "the same inputs give the same bits" is exactly what a
  racy kernel breaks (a missing barrier, a block that reads another's unfinished store), and such a kernel
  may pass once. Why this split, measured by what each check costs on the GPU (docs/gpu.md, run H: production
  54-56 s of an 81-97 s trial, golden 3-4 s, edge 1 s): golden, fuzz and edge checks (small shapes, a few
  seconds) run every trial as before; the production checks (float64 reference, stable over the whole
  tensor) are the expensive part, and a race shows up as *different output bits* on identical inputs. So the
  checking trial runs the candidate twice at each production shape, checks both outputs, and records the
  output fingerprint (:func:`kernelpack.harness.fingerprint.fingerprint`, computed on the device) only when
  both runs gave the same bits; every later trial runs the candidate once more at each production shape
  (one kernel call and a fingerprint: milliseconds) and skips that shape's check only while the bits equal
  the checked run's. Different bits (a race that shows now) run the full check on them again, and a shape
  whose bits differed between the two checking runs is never memoised. What is not re-checked is therefore
  always an output bit-identical to one that passed, on the same inputs, on this node.
* ``off``: everything every trial.

The key covers both digests, the node's arch (and GPU model), the checked dtypes and production sizes, the
mode, the torch and Triton versions and the checking code itself, so any change to what would be computed
starts over.
"""

from __future__ import annotations

import hashlib
import json
import time
from contextlib import suppress
from pathlib import Path
from typing import Any

from agents.trial_protocol import WorkerSpec, write_json_atomic
from kernelctl.vocab import NumericsMemoMode


def memo_mode(spec: WorkerSpec, device_type: str) -> NumericsMemoMode:
    """The node's mode: the profile's ``numerics_memo``, else skip on CPU and fingerprint on a GPU."""
    if spec.numerics_memo is not None:
        return NumericsMemoMode(spec.numerics_memo)
    return NumericsMemoMode.SKIP if device_type == "cpu" else NumericsMemoMode.FINGERPRINT


def shape_key(op: str, dtype: str, shape: dict[str, int]) -> str:
    """The memo's key of one production check: ``op|dtype|{"dim": n, ...}``."""
    return f"{op}|{dtype}|{json.dumps({k: int(v) for k, v in sorted(shape.items())})}"


class NumericsMemo:
    """One (node, candidate, stable, sizes, mode, code) key's record of passed deterministic numeric checks."""

    KINDS = ("golden", "stable_golden", "edge", "production")

    def __init__(self, path: Path, mode: NumericsMemoMode = NumericsMemoMode.SKIP) -> None:
        self.path = path
        self.mode = mode

    @classmethod
    def for_trial(cls, spec: WorkerSpec, device_type: str, *, has_stable: bool) -> NumericsMemo | None:
        """The memo of this trial's checks; None when the mode is ``off``."""
        mode = memo_mode(spec, device_type)
        if mode is NumericsMemoMode.OFF:
            return None
        import torch
        import triton

        from kernelpack.harness import edge, fingerprint, golden, numerics
        from kernelpack.kernels import spec as kspec

        code = hashlib.sha256()
        here = Path(__file__).resolve()
        for path in (*(Path(m.__file__ or "") for m in (edge, fingerprint, golden, numerics, kspec)),
                     here.with_name("trial_worker.py"), here):  # the worker runs as __main__: by path
            with suppress(OSError):
                code.update(path.read_bytes())
        gpu = torch.cuda.get_device_name() if device_type == "cuda" and torch.cuda.is_available() else None
        key = json.dumps({"v": 2, "mode": mode.value, "candidate": spec.candidate_digest,
                          "stable": spec.stable_digest if has_stable else None, "arch": spec.arch, "gpu": gpu,
                          "dtypes": spec.dtypes, "batch": sorted(spec.batch_sizes),
                          "prefill": sorted(spec.prefill_tokens), "max_tokens": spec.numerics_max_tokens,
                          "torch": torch.__version__, "triton": triton.__version__, "code": code.hexdigest()},
                         sort_keys=True)
        digest = hashlib.sha256(key.encode()).hexdigest()[:32]
        return cls(Path(spec.loader_cache_dir) / "trial-memo" / f"{spec.candidate_digest[:16]}-{digest}.json", mode)

    @property
    def skips_all(self) -> bool:
        """Golden, edge and production checks are all skipped once passed (``skip`` mode)."""
        return self.mode is NumericsMemoMode.SKIP

    def passed(self) -> dict[str, Any] | None:
        """The record of the earlier pass ({"at", "checks", "seed", "production"}), or None when there is none."""
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def fingerprints(self) -> dict[str, list[str]]:
        """``shape_key -> output fingerprints`` of the production checks recorded as passed (fingerprint mode)."""
        rec = self.passed() or {}
        prod = rec.get("production")
        if not isinstance(prod, dict):
            return {}
        return {str(k): [str(x) for x in v] for k, v in prod.items() if isinstance(v, list)}

    def record(self, checks: int, seed: int, production: dict[str, list[str]] | None = None) -> None:
        """Record that every deterministic check passed (best effort: a failed write only costs a rerun);
        ``production``: the fingerprints of the production shapes whose checking runs agreed bit for bit."""
        with suppress(OSError):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(self.path, {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                          "checks": checks, "seed": seed, "production": production or {}})
