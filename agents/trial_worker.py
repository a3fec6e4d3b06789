"""The trial child: ``agents.trial_worker.main([SPEC.json, RESULT.json])``, forked by :mod:`agents.trial_spawn`
(``python -m agents.trial_worker SPEC.json RESULT.json`` runs the same by hand).

Runs one trial of a candidate bundle against the stable one on this node and writes a ``WorkerResult``
atomically: golden vectors, shape fuzzing inside each op's domain with fresh random inputs (error against the
float64 reference and difference against the stable version on the same inputs), interleaved stable/candidate
latency at the traffic profile's sizes, launches per call, peak memory, and the end-to-end decoder-block
latency. The first failure of candidate code ends the trial with its outcome (``oom``, ``crash``,
``compile_error``, ``load_error``, ``numeric_error``, ``mismatch``). A signal (e.g. SIGSEGV) or a hang leaves
no result: the parent (``agents.trial``) classifies those from the exit status and the progress file.

The child lowers its priority (nice +10), dies with the agent (PR_SET_PDEATHSIG), and on CPU caps its
address space (RLIMIT_AS) so a runaway allocation fails as a real allocation failure.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agents.trial_child import TrialFailure, classify, die_with_parent, limit_memory
from agents.trial_latency import token_dim
from agents.trial_protocol import WorkerResult, WorkerSpec, write_json_atomic

if TYPE_CHECKING:  # agents.timing_lock imports torch, which the trial child times as its "import" phase
    from agents.timing_lock import LockWait

MAX_ERR = 1e30  # the wire's ceiling for an error value; inf/NaN errors are reported as this


class Worker:
    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.result = WorkerResult(outcome="ok")
        self.notes: list[str] = [f"seed={spec.seed}"]
        self.timing = ExitStack()  # the timed phases' exclusive hold, taken by the first one
        self.timing_held = False

    # ------------------------------------------------------------------------------------ plumbing
    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.result.phase = name
        if self.spec.progress_path:
            write_json_atomic(Path(self.spec.progress_path), {"phase": name, "at": time.time()})
        t0 = time.perf_counter()
        try:
            yield
        except TrialFailure:
            raise
        except Exception as exc:
            outcome, text = classify(exc)
            raise TrialFailure(outcome, f"{name}: {text}") from exc
        finally:
            self.result.seconds[name] = self.result.seconds.get(name, 0.0) + time.perf_counter() - t0

    @contextmanager
    def timed_phase(self, name: str) -> Iterator[None]:
        """A timing phase with the device to itself (:func:`agents.timing_lock.timing_lock`: no other trial's
        checks or timings on the GPU meanwhile), held from the first timed phase to the end of the trial (the
        latency and end-to-end phases back to back); the wait is phase ``<name>_lock``."""
        from agents.timing_lock import device_key, timing_lock

        if not self.timing_held:  # the first timed phase: the checks are over
            self._checks_held()
            if self.spec.timing_lock_s > 0:
                with self.phase(f"{name}_lock"):
                    wait = self.timing.enter_context(timing_lock(device_key(self.device), self.spec.timing_lock_s))
                self._lock_note(name, "timed", wait)
            self.timing_held = True
        with self.phase(name):
            yield

    def _checks_held(self) -> None:
        """The checks' shared holds (:class:`agents.timing_lock.CheckHolds`) in the phase timings
        (``share_lock``: their waits in all, also counted in the phase that waited) and notes."""
        self.result.seconds["share_lock"] = self.holds.waited_s
        self._lock_note("checks", "ran", self.holds.summary())

    def _lock_note(self, name: str, verb: str, wait: LockWait) -> None:
        if wait.error is not None:
            self.notes.append(f"{name}: {verb} without the device lock on {wait.key}: {wait.error}")
        elif not wait.held:
            self.notes.append(f"{name}: {verb} without the device lock on {wait.key}: not free after "
                              f"{wait.waited_s:.1f}s (another process on this device held it)")
        elif wait.waited_s >= 0.1:
            self.notes.append(f"{name}: waited {wait.waited_s:.1f}s for the device lock on {wait.key}")

    # ---------------------------------------------------------------------------------------- run
    def run(self) -> WorkerResult:
        try:
            self._run()
        except TrialFailure as f:
            self.result.outcome = f.outcome  # type: ignore[assignment]
            self.notes.append(f.detail)
        phases = ", ".join(f"{k} {v:.1f}s" for k, v in self.result.seconds.items())
        self.notes.insert(1, f"phases: {phases}")
        self.result.detail = "\n".join(self.notes)[-8000:]
        return self.result

    def _run(self) -> None:
        spec = self.spec
        with self.phase("import"):
            import torch
            from triton import knobs

            from kernelpack.errors import BundleError
            from kernelpack.loader import load_bundle, unsupported_reason
        limit_memory(spec.memory_limit_bytes if spec.device == "cpu" else None)
        knobs.cache.dir = str(Path(spec.loader_cache_dir) / "triton" / "trials")
        self.device = torch.device(spec.device)
        with self.phase("load"):
            try:
                cand = load_bundle(Path(spec.candidate_path), Path(spec.trusted_keys_dir), arch=spec.arch,
                                   cache_dir=Path(spec.loader_cache_dir), digest=spec.candidate_digest)
            except BundleError as exc:
                raise TrialFailure("load_error", f"candidate failed to load: {exc}") from exc
            whole = unsupported_reason(cand.manifest, cand.arch)
            if whole is not None:  # the node is eligible, yet the bundle says it cannot run here
                raise TrialFailure("load_error", f"candidate cannot run its kernels on this node: {whole}")
            for name, bound in sorted(cand.ops.items()):
                if bound.unsupported:  # declared per op (e.g. FP8 needs sm_89+): serving uses the PyTorch path
                    self.notes.append(f"{name} not trialled: {bound.unsupported}")
            stable = None
            if spec.stable_path:
                try:
                    stable = load_bundle(Path(spec.stable_path), Path(spec.trusted_keys_dir), arch=spec.arch,
                                         cache_dir=Path(spec.loader_cache_dir), digest=spec.stable_digest)
                except BundleError as exc:
                    self.notes.append(f"stable failed to load ({exc}); no comparison against stable")
        self.cand = {n: (b.op, b.config) for n, b in cand.ops.items() if b.supported}
        self.stable = {n: (b.op, b.config) for n, b in stable.ops.items() if b.supported} if stable else {}
        self.cand_bundle = cand
        self.stable_bundle = stable
        from agents.timing_lock import CheckHolds, device_key

        on = spec.timing_lock_s > 0
        self.holds = CheckHolds(device_key(self.device) if on else "", spec.timing_lock_s)
        self.result.seconds["share_lock"] = 0.0
        with self.timing:
            self._numerics()
            if self.result.outcome != "ok":
                self._checks_held()
                return
            self._latency()
            self._e2e()

    # ---------------------------------------------------------------------------------- numerics
    def _dtypes(self, op: Any) -> list[str]:
        allowed = [d for d in op.domain.dtypes if d in op.tolerances]
        return [d for d in allowed if self.spec.dtypes is None or d in self.spec.dtypes]

    def _record(self, results: list[Any], kind: str, case: str | None = None) -> None:
        for r in results:
            self.result.numerics.append({
                "op": r.op, "dtype": r.dtype, "shape": {k: int(v) for k, v in r.shape.items()},
                "max_abs_err": _clamp(r.max_abs_err), "max_rel_err": _clamp(r.max_rel_err),
                "within_tolerance": bool(r.within_tolerance and r.unwritten == 0 and r.nonfinite == 0
                                         and not r.inputs_modified),
                "unwritten": int(r.unwritten),
                "vs_stable_max_abs": None if r.against_max_abs_diff is None else _clamp(r.against_max_abs_diff),
                "vs_stable_within": r.against_within_tolerance,
                "kind": kind, "case": case, "nonfinite": int(r.nonfinite),
            })

    def _contract(self, name: str) -> Any:
        """The candidate op judged under the stricter of its own and the stable version's tolerances."""
        from kernelpack.harness.edge import stricter

        op = self.cand[name][0]
        st = self.stable.get(name)
        if st is None:
            return op
        tols = {d: stricter(t, st[0].tolerances.get(d)) for d, t in op.tolerances.items()}
        return dataclasses.replace(op, tolerances=tols)

    def _numerics(self) -> None:
        """Golden vectors, fuzzing, edge values and production shapes, in that order; the first phase with a
        check over tolerance ends the numerics (a ``numeric_error`` needs no further evidence). Checks a node
        already passed for this (candidate, stable) pair are not repeated as :mod:`agents.trial_memo` says
        (``skip`` on the interpreter: golden, edge and production; ``fingerprint`` on a GPU: a production
        shape whose candidate output bits equal the checked run's); fuzzing, with this trial's fresh seed,
        always runs."""
        from agents.trial_memo import NumericsMemo

        memo = NumericsMemo.for_trial(self.spec, self.device.type, has_stable=bool(self.stable))
        passed = memo.passed() if memo is not None else None
        self.memo = memo
        self.checked_prints: dict[str, list[str]] = {}  # production shape -> fingerprints both runs agreed on
        phases = [self._golden, self._fuzz, self._edge, self._production]
        if passed is not None and memo is not None and memo.skips_all:
            self.notes.append(f"golden, edge and production checks not repeated: the same {passed.get('checks')} "
                              f"checks on the same inputs passed in this node's trial at {passed.get('at')} "
                              "(the interpreter is deterministic); fuzzing runs with this trial's seed")
            phases = [self._fuzz]
        for run_phase in phases:
            run_phase()
            if any(not c["within_tolerance"] for c in self.result.numerics):
                break  # the outcome is decided; the remaining phases would only add evidence
        bad = [c for c in self.result.numerics if not c["within_tolerance"]]
        mism = [c for c in self.result.numerics if c["vs_stable_within"] is False]
        if bad:
            c = bad[0]
            self.result.outcome = "numeric_error"
            self.notes.append(f"{len(bad)} numeric check(s) over tolerance; first: {c['kind']}"
                              f"{'/' + c['case'] if c['case'] else ''} {c['op']} {c['dtype']} {c['shape']} "
                              f"max_abs_err={c['max_abs_err']:.3g} nonfinite={c['nonfinite']} unwritten={c['unwritten']}")
        elif mism:
            c = mism[0]
            self.result.outcome = "mismatch"
            self.notes.append(f"{len(mism)} check(s) differ from stable beyond tolerance; first: {c['kind']} {c['op']} "
                              f"{c['dtype']} {c['shape']} max |candidate-stable|={c['vs_stable_max_abs']:.3g}")
        elif memo is not None and (passed is None or not memo.skips_all):
            checks = sum(1 for c in self.result.numerics if c["kind"] in NumericsMemo.KINDS)
            if passed is None or self.checked_prints:
                memo.record(checks, self.spec.seed, {**memo.fingerprints(), **self.checked_prints})

    def _golden(self) -> None:
        from kernelpack.harness.golden import check_golden

        with self.phase("golden"):  # the stable version's vectors bind the candidate too
            for bundle, kind in ((self.cand_bundle, "golden"), (self.stable_bundle, "stable_golden")):
                for g in bundle.manifest.golden if bundle is not None else []:
                    if g.op not in self.cand or g.dtype not in self._dtypes(self.cand[g.op][0]):
                        continue
                    blob = (bundle.root / g.path).read_bytes()
                    with self.holds.hold():
                        res = check_golden(self._contract(g.op), self.cand[g.op][1], blob, device=self.device)
                    self._record(res, kind)

    def _fuzz(self) -> None:
        from kernelpack.harness.numerics import check_numerics, fuzz_shapes

        spec = self.spec
        rng = random.Random(spec.seed)
        with self.phase("fuzz"):
            for k, name in enumerate(sorted(self.cand)):
                op, cfg = self.cand[name]
                if op.fuzz is None or spec.fuzz_shapes == 0:
                    continue
                against = self.stable.get(name)
                for j, dtype in enumerate(self._dtypes(op)):
                    shapes = fuzz_shapes(op, spec.fuzz_shapes, rng)
                    with self.holds.hold():
                        res = check_numerics(self._contract(name), cfg, dtype, shapes, device=self.device,
                                             seed=spec.seed + 1000 * k + 100 * j, against=against)
                    self._record(res, "fuzz")

    def _edge(self) -> None:
        from kernelpack.harness.edge import check_edge
        from kernelpack.kernels.spec import DomainError

        with self.phase("edge"):  # edge values, every op and dtype of its domain, small shape
            for name in sorted(self.cand):
                op, cfg = self.cand[name]
                if not op.test_shapes:
                    continue
                shape = dict(min(op.test_shapes, key=lambda s: math.prod(s.values())))
                for dtype in self._dtypes(op):
                    try:
                        with self.holds.hold():
                            outs = check_edge((op, cfg), self.stable.get(name), dtype, shape, device=self.device)
                    except DomainError as exc:
                        self.notes.append(f"{name} {dtype}: edge values skipped: {exc}")
                        continue
                    for o in outs:
                        self._record([o.result], "edge", o.case)

    def _production(self) -> None:
        from agents.trial_memo import shape_key
        from kernelpack.harness.edge import candidate_fingerprints, check_production
        from kernelpack.kernels.spec import DomainError

        memo = self.memo
        fingerprint = memo is not None and not memo.skips_all
        known = memo.fingerprints() if fingerprint and memo is not None else {}
        reused = 0
        with self.phase("production"):  # the shapes the latency phase times, candidate vs stable
            for name in sorted(self.cand):
                op, cfg = self.cand[name]
                dtype = self._latency_dtype(op)
                tol = self._contract(name).tolerances.get(dtype)
                for shape in self._production_shapes(op, dtype):
                    key = shape_key(name, dtype, shape)
                    try:
                        with self.holds.hold():
                            if key in known:  # checked before: only the bits of a fresh run are compared
                                now = candidate_fingerprints((op, cfg), dtype, shape, device=self.device)
                                if now == known[key]:
                                    reused += 1
                                    continue
                                self.notes.append(f"{name} {dtype} {shape}: output bits differ from the checked "
                                                  "run's (nondeterministic): production check run again")
                            prints: list[list[str]] = []
                            res, notes = check_production((op, cfg), self.stable.get(name), dtype, shape,
                                                          device=self.device, token_dim=token_dim(shape),
                                                          tolerance=tol, runs=2 if fingerprint else 1,
                                                          fingerprints_out=prints if fingerprint else None)
                            if self.device.type == "cuda":
                                sys.modules["torch"].cuda.empty_cache()  # imported in the import phase
                    except DomainError as exc:
                        self.notes.append(f"{name}: production numerics at {shape} skipped: {exc}")
                        continue
                    self.notes.extend(notes)
                    self._record(res, "production")
                    if prints and all(p == prints[0] for p in prints) and key not in known:
                        self.checked_prints[key] = prints[0]
        if reused:
            self.notes.append(f"production checks not repeated at {reused} shape(s): the candidate's output bits "
                              "equal those of the run that passed them on this node (fingerprint memo)")

    def _production_shapes(self, op: Any, dtype: str) -> list[dict[str, int]]:
        """GPU: every shape the latency phase times. CPU (interpreter): the small test shape at the profile's
        largest token count, capped at ``numerics_max_tokens`` (rows past the first thousand by default)."""
        from kernelpack.kernels.spec import DTYPES, DomainError

        if self.device.type == "cuda":
            return self._shapes(op, dtype)
        sizes = list(self.spec.batch_sizes) + list(self.spec.prefill_tokens)
        if not sizes or not op.test_shapes:
            return []
        base = dict(min(op.test_shapes, key=lambda s: math.prod(s.values())))
        dim = token_dim(base)
        tokens = min(max(sizes), self.spec.numerics_max_tokens)
        try:
            op.domain.check(DTYPES[dtype], {**base, dim: tokens})
        except DomainError:
            return []
        return [{**base, dim: tokens}]

    # ----------------------------------------------------------------------------------- latency
    def _latency_dtype(self, op: Any) -> str:
        dts = self._dtypes(op) or list(op.domain.dtypes)
        if self.spec.latency_dtype and self.spec.latency_dtype in dts:
            return self.spec.latency_dtype
        prefer = ("bf16", "fp16", "fp32") if self.device.type == "cuda" else ("fp32", "fp16", "bf16")
        return next(d for d in prefer if d in dts) if any(d in dts for d in prefer) else dts[0]

    def _shapes(self, op: Any, dtype: str) -> list[dict[str, int]]:
        from kernelpack.kernels.spec import DTYPES, DomainError

        spec = self.spec
        decode, prefill = sorted(set(spec.batch_sizes)), sorted(set(spec.prefill_tokens))
        shapes: list[dict[str, int]] = []
        if self.device.type == "cuda":
            shapes = [self._at(op.decode_shapes or op.test_shapes, b) for b in decode]
            shapes += [self._at(op.prefill_shapes or op.decode_shapes or op.test_shapes, p) for p in prefill]
            if not shapes:
                shapes = [dict(s) for s in op.decode_shapes] or [dict(s) for s in op.test_shapes]
        else:
            # the interpreter runs the small test shape, tokens scaled from the profile into 1..4
            base = dict(min(op.test_shapes, key=lambda s: math.prod(s.values())))
            dim = token_dim(base)
            sizes = decode + prefill
            top = max(sizes) if sizes else 1
            tokens = sorted({max(1, math.ceil(4 * x / top)) for x in sizes}) or [base[dim]]
            tokens = sorted({tokens[0], tokens[-1]})
            shapes = [{**base, dim: t} for t in tokens]
        ok = []
        for s in shapes:
            try:
                op.domain.check(DTYPES[dtype], s)
            except DomainError:
                continue
            ok.append(s)
        return ok

    @staticmethod
    def _at(shapes: Any, tokens: int) -> dict[str, int]:
        """The op's shape with ``tokens`` in its token dimension (an exact entry when the op lists one)."""
        for sh in shapes:
            if sh.get(token_dim(sh)) == tokens:
                return dict(sh)
        base = dict(shapes[0])
        return {**base, token_dim(base): tokens}

    def _capacity_shape(self, op: Any, dtype: str, shapes: list[dict[str, int]]) -> dict[str, int] | None:
        """Where launches and peak memory are measured: the largest latency shape on a GPU; on the CPU
        interpreter the test shape at the profile's largest decode batch (memory scales with tokens, so a
        kernel that allocates too much at production batch sizes fails here as a real allocation)."""
        from kernelpack.kernels.spec import DTYPES, DomainError

        if self.device.type == "cuda" or not self.spec.batch_sizes:
            return max(shapes, key=lambda s: math.prod(s.values())) if shapes else None
        base = dict(min(op.test_shapes, key=lambda s: math.prod(s.values())))
        shape = {**base, token_dim(base): max(self.spec.batch_sizes)}
        try:
            op.domain.check(DTYPES[dtype], shape)
        except DomainError:
            return max(shapes, key=lambda s: math.prod(s.values())) if shapes else None
        return shape

    def _latency(self) -> None:
        from kernelpack.harness.bench import count_launches, peak_memory_bytes
        from kernelpack.harness.bench import launches_per_call as measure_launches
        from kernelpack.harness.numerics import make_generator, resolve_dtype

        plan = []
        for name in sorted(self.cand):
            op, _cfg = self.cand[name]
            dtype = self._latency_dtype(op)
            shapes = self._shapes(op, dtype)
            plan.append((name, dtype, shapes, self._capacity_shape(op, dtype, shapes)))
        from kernelpack.kernels.spec import DomainError

        with self.phase("capacity"):  # launches per call and peak memory of both versions, per cell
            self.result.free_memory_bytes = self._free_memory()
            peak = 0
            for name, dtype, shapes, cap in plan:
                cells = {}
                for shape in ([cap] if cap is not None else []) + list(shapes):
                    cells.setdefault(int(shape[token_dim(shape)]), shape)
                for tokens, shape in sorted(cells.items()):
                    row: dict[str, Any] = {"op": name, "tokens": tokens}
                    try:
                        with self.holds.hold():
                            for role, versions in (("candidate", self.cand), ("stable", self.stable)):
                                if name not in versions:
                                    continue
                                launches, mem = self._capacity(versions[name], dtype, shape, measure_launches,
                                                               peak_memory_bytes, count_launches, make_generator,
                                                               resolve_dtype)
                                row[f"{role}_launches"], row[f"{role}_peak_bytes"] = launches, mem
                    except DomainError as exc:  # the shape, not the kernel: an op-specific constraint
                        self.notes.append(f"{name}: capacity shape {shape} skipped: {exc}")
                        continue
                    self.result.resources.append(row)
                    peak = max(peak, row["candidate_peak_bytes"])
                    self.result.launches_per_call[name] = max(self.result.launches_per_call.get(name, 0),
                                                              row["candidate_launches"])
            self.result.peak_memory_bytes = peak
        with self.timed_phase("latency"):
            from agents.trial_latency import time_cells

            cells, notes = time_cells(plan, self.stable, self.cand, device=self.device, seed=self.spec.seed)
            self.result.cells.extend(cells)
            self.notes.extend(notes)

    def _capacity(self, version: Any, dtype: str, shape: dict[str, int], measure_launches: Any, peak_fn: Any,
                  count_launches: Any, make_generator: Any, resolve_dtype: Any) -> tuple[int, int]:
        """(launches per call, peak bytes) of one version at one shape, on identical seeded inputs."""
        op, cfg = version
        op.domain.check(resolve_dtype(dtype), shape)
        inputs = op.make_inputs(dict(shape), resolve_dtype(dtype), self.device,
                                make_generator(self.device, self.spec.seed))

        def call() -> None:
            op.run(inputs, op.alloc_outputs(inputs), {**op.default_config, **cfg})

        if self.device.type == "cuda":
            launches = measure_launches(op, cfg, inputs)  # warmed up: compiles not counted
            mem = int(peak_fn(call, device=self.device))
        else:  # the interpreter is slow: launches and memory from one single call
            with count_launches() as counter:
                mem = int(peak_fn(call, device=self.device))
            launches = counter[0]
        return int(launches), mem

    def _free_memory(self) -> int | None:
        """The node's free memory for kernels: free device memory on a GPU, the child's budget on CPU."""
        if self.device.type == "cuda":
            import torch

            return int(torch.cuda.mem_get_info(self.device)[0])
        if self.spec.memory_limit_bytes:
            return int(self.spec.memory_limit_bytes)
        with suppress(OSError), open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        return None

    def _e2e(self) -> None:
        if not self.spec.e2e or not self.stable:
            return
        if self.spec.model is not None:  # serving (issue 17): a real model architecture from the profile
            self._model_e2e()
            return
        from kernelpack.harness.decoder_block import STAGE_OPS, decoder_block_latency

        if not any(n in STAGE_OPS for n in self.cand):
            return
        spec = self.spec
        with self.timed_phase("e2e"):
            if self.device.type == "cuda":
                tokens = min(spec.prefill_tokens) if spec.prefill_tokens else 512
                # CUDA-graph replays timed one by one in ABBA quads (windows of 8 calls per arm) after 0.5 s
                # of warm-up
                kw: dict[str, Any] = {"tokens": tokens, "hidden": 4096, "heads": 32, "head_dim": 128,
                                      "intermediate": 14336, "dtype": "bf16", "graphs": True,
                                      "rounds": spec.e2e_rounds or max(spec.rounds, 9), "min_reps": 8,
                                      "rep_ms": 500.0}
            else:
                kw = {"tokens": 2, "hidden": 32, "heads": 2, "head_dim": 16, "intermediate": 64,
                      "dtype": "fp32", "rounds": spec.e2e_rounds or 3}
            from kernelpack.kernels.spec import DomainError

            def usable(ops: dict[str, Any]) -> dict[str, Any]:  # ops that accept the block's dtype
                return {n: v for n, v in ops.items() if kw["dtype"] in v[0].domain.dtypes}

            stable, cand = usable(self.stable), usable(self.cand)
            while True:
                try:
                    res = decoder_block_latency(stable, cand, device=self.device, seed=spec.seed, **kw)
                    break
                except DomainError as exc:  # this block's shapes/dtype lie outside one op's domain
                    bad = exc.op or ""
                    if bad not in cand and bad not in stable:
                        self.notes.append(f"decoder block skipped: {exc}")
                        return
                    self.notes.append(f"decoder block runs {bad} eager: {exc}")
                    stable.pop(bad, None)
                    cand.pop(bad, None)
            self.result.e2e_pairs = [{"stable_s": max(a, 1e-9), "candidate_s": max(b, 1e-9)}
                                     for a, b in zip(res.a_s, res.b_s, strict=True)]
            from kernelpack.harness.bench import ArmTimes, arm_summary, drop_contended

            st, ca, dropped = drop_contended(ArmTimes(res.a_calls, res.a_s), ArmTimes(res.b_calls, res.b_s))
            self.result.e2e = {"stable": arm_summary(st), "candidate": arm_summary(ca), "contended_windows": dropped}
            if self.device.type == "cuda" and not res.graphed:
                self.notes.append("decoder block timed eagerly (CUDA graph capture failed)")
            self.result.e2e_stable_s = max(sorted(res.a_s)[len(res.a_s) // 2], 1e-9)
            self.result.e2e_candidate_s = max(sorted(res.b_s)[len(res.b_s) // 2], 1e-9)
            if res.within_tolerance_a and not res.within_tolerance_b:
                self.result.outcome = "numeric_error"
                self.notes.append(
                    f"decoder block with candidate kernels: max abs error {res.max_abs_err_b:.3g} over the "
                    f"bound (stable {res.max_abs_err_a:.3g}, eager {res.eager_max_abs_err:.3g})"
                )

    def _model_e2e(self) -> None:
        """Stable vs candidate on the profile's model (kernelpack.harness.model_e2e): TTFT at the prefill
        sizes, time per output token at the decode batch sizes, top-k log-prob agreement. Every point is judged:
        each round becomes one ``e2e_pairs`` entry, the geometric mean of that round's TTFT and TPOT timings per
        arm (the rounds are interleaved, so the pair is matched); e2e_*_s carry the median pair. The whole
        summary goes into the notes as ``model_e2e {json}``."""
        from kernelpack.harness.model_e2e import LOGPROB_BOUND, trial_model_e2e

        spec, model = self.spec, self.spec.model
        assert model is not None
        with self.timed_phase("e2e"):
            cpu = self.device.type == "cpu"
            res = trial_model_e2e(model.model_dump(), self.stable, self.cand, device=self.device,
                                  prefill_tokens=sorted(spec.prefill_tokens)[:1 if cpu else None] or [8],
                                  decode_batches=sorted(spec.batch_sizes)[:1 if cpu else None] or [1],
                                  rounds=spec.rounds, seed=spec.seed)
            points, gm = [*res.prefill, *res.decode], statistics.geometric_mean
            n = min(len(p["a_s"]) for p in points)
            pairs = [(gm(max(p["a_s"][i], 1e-9) for p in points), gm(max(p["b_s"][i], 1e-9) for p in points))
                     for i in range(n)]
            self.result.e2e_pairs = [{"stable_s": a, "candidate_s": b} for a, b in pairs]
            self.result.e2e_stable_s = sorted(a for a, _ in pairs)[n // 2]
            self.result.e2e_candidate_s = sorted(b for _, b in pairs)[n // 2]
            self.notes.append("model_e2e " + json.dumps(res.summary(), separators=(",", ":")))
            if res.logprob_max_abs_diff > LOGPROB_BOUND[res.dtype]:
                self.result.outcome = "numeric_error"
                self.notes.append(f"model end to end: candidate log-probs differ from stable's by up to "
                                  f"{res.logprob_max_abs_diff:.3g} nats (bound {LOGPROB_BOUND[res.dtype]})")



def _clamp(v: float) -> float:
    return MAX_ERR if not math.isfinite(v) else min(float(v), MAX_ERR)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m agents.trial_worker SPEC.json RESULT.json", file=sys.stderr)
        return 2
    spec = WorkerSpec.model_validate_json(Path(args[0]).read_bytes())
    die_with_parent(spec.agent_pid)
    with suppress(OSError):
        os.nice(10)
    result = Worker(spec).run()
    write_json_atomic(Path(args[1]), result.model_dump(mode="json"))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter/CUDA teardown: a poisoned CUDA context can hang it


if __name__ == "__main__":
    sys.exit(main())
