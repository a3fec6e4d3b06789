"""Monte-Carlo comparison of the confidence-sequence judge and the Kayenta-style Mann-Whitney judge.

One *run* is a canary of ``nodes`` nodes; every tick each node delivers one report, both judges look at
all the evidence so far after every tick. The confidence-sequence judge sees the reports' paired
log-ratios in arrival order (tick-major) and uses the same code as :func:`judge_latency`
(:func:`eb_confseq` + :func:`decide`); the Mann-Whitney judge sees, per tick, the group-mean latency of
each arm (Kayenta compares aggregated canary and baseline time series). Two Mann-Whitney variants are
reported: ``mannwhitney`` (significant *and* candidate median higher by more than the margin, the margin
used as Kayenta's allowed-increase effect size) and ``mannwhitney_no_effect_size`` (significant and
candidate median higher at all).

Per regression size it reports the rollback rate (``kind``: below the margin false rollbacks, exactly at
the margin either decision is acceptable, above it detections), counting a rollback at *any* tick up to
``max_samples`` even after a ``pass`` would have been declared (the conservative count), samples per
node (= ticks) to rollback, and for the CS judge the rate and speed of ``pass`` (declared before any
rollback). Runs are processed in vectorised chunks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from controller.judge.confseq import DEFAULT_LAMBDA_CAP, clip_log_ratios, eb_confseq
from controller.judge.latency import METHOD, PASS, REGRESS, decide, default_clip
from controller.judge.mannwhitney import mw_regress
from controller.judge.noise import NoiseModel, simulate_reports

NEVER = np.iinfo(np.int32).max


@dataclass(frozen=True)
class SimConfig:
    """Simulation settings (defaults are the documented benchmark)."""

    runs: int = 10_000
    seed: int = 0
    regressions: tuple[float, ...] = (0.0, 0.02, 0.05, 0.10)
    nodes: int = 10
    max_samples: int = 60
    margin: float = math.log(1.02)
    alpha: float = 0.05
    min_samples: int = 5
    clip: float | None = None  # None: default_clip(margin), as judge_latency does
    lambda_cap: float = DEFAULT_LAMBDA_CAP
    mw_alpha: float = 0.05
    mw_min_samples: int = 3
    chunk: int = 500
    model: NoiseModel = field(default_factory=NoiseModel)

    def __post_init__(self) -> None:
        if self.runs < 1 or self.nodes < 1 or self.max_samples < 1 or self.chunk < 1:
            raise ValueError("runs, nodes, max_samples and chunk must all be >= 1")
        for r in self.regressions:
            if not (math.isfinite(r) and r > -1):
                raise ValueError(f"regression {r!r} must be a finite fraction > -1 (0.05 = 5% slower)")


def _first(mask: np.ndarray) -> np.ndarray:
    """Index of the first True along the last axis, NEVER where none."""
    idx = mask.argmax(axis=-1)
    return np.where(mask.any(axis=-1), idx, NEVER)


def _stats(first_tick: np.ndarray) -> tuple[float, float | None, float | None]:
    hit = first_tick[first_tick != NEVER] + 1  # ticks = samples per node
    if hit.size == 0:
        return 0.0, None, None
    return float(hit.size / first_tick.size), float(np.median(hit)), float(np.percentile(hit, 90))


def _run_chunk(cfg: SimConfig, rng: np.random.Generator, runs: int, log_effect: float
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    reps = simulate_reports(rng, runs=runs, ticks=cfg.max_samples, nodes=cfg.nodes, log_effect=log_effect,
                            model=cfg.model)
    k, ticks = cfg.nodes, cfg.max_samples
    clip = default_clip(cfg.margin) if cfg.clip is None else cfg.clip
    x, clipped = clip_log_ratios(reps.ratio.reshape(runs, ticks * k), clip)
    lower, upper, _ = eb_confseq(x, alpha=cfg.alpha, bound=clip, lambda_cap=cfg.lambda_cap)
    ends = np.arange(1, ticks + 1) * k - 1  # index of the last sample of each tick
    codes = decide(lower[:, ends], upper[:, ends], ends + 1, margin=cfg.margin, min_samples=cfg.min_samples)
    cs_regress, cs_pass = _first(codes == REGRESS), _first(codes == PASS)

    s_agg, c_agg = reps.stable.mean(axis=2), reps.candidate.mean(axis=2)  # (runs, ticks) group means
    mw_flag = np.zeros((runs, ticks), dtype=bool)
    mw_plain = np.zeros((runs, ticks), dtype=bool)
    for t in range(cfg.mw_min_samples - 1, ticks):
        flag, p, ratio = mw_regress(s_agg[:, : t + 1], c_agg[:, : t + 1], alpha=cfg.mw_alpha, margin=cfg.margin)
        mw_flag[:, t] = flag
        mw_plain[:, t] = (p < cfg.mw_alpha) & (ratio > 1.0)
    return cs_regress, cs_pass, _first(mw_flag), _first(mw_plain), int(clipped.sum())


def simulate(cfg: SimConfig) -> dict[str, object]:
    """Run the simulation; returns a JSON-safe dict: ``config``, ``results``, ``elapsed_s`` (wall), ``cpu_s``."""
    start, cpu_start = time.perf_counter(), time.process_time()
    results = []
    for reg in cfg.regressions:
        # the stream depends on (seed, regression) only, not on which other sizes are in the list
        rng = np.random.default_rng([cfg.seed, round((reg + 1.0) * 1e6)])
        log_effect = math.log1p(reg)
        parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]] = []
        done = 0
        while done < cfg.runs:
            n = min(cfg.chunk, cfg.runs - done)
            parts.append(_run_chunk(cfg, rng, n, log_effect))
            done += n
        cs_reg = np.concatenate([p[0] for p in parts])
        cs_pass = np.concatenate([p[1] for p in parts])
        mw_reg = np.concatenate([p[2] for p in parts])
        mw_plain = np.concatenate([p[3] for p in parts])
        clipped = sum(p[4] for p in parts)
        gap = log_effect - cfg.margin
        kind = "false_rollback" if gap < -1e-9 else ("at_margin" if gap <= 1e-9 else "detection")
        rate, med, p90 = _stats(cs_reg)
        pass_first = np.where(cs_pass < cs_reg, cs_pass, NEVER)
        p_rate, p_med, p_p90 = _stats(pass_first)
        decided = (cs_reg != NEVER) | (cs_pass != NEVER)
        m_rate, m_med, m_p90 = _stats(mw_reg)
        q_rate, q_med, q_p90 = _stats(mw_plain)
        results.append({
            "regression": reg,
            "kind": kind,
            "confseq": {
                "rollback_rate": rate, "median_samples_to_rollback": med, "p90_samples_to_rollback": p90,
                "pass_rate": p_rate, "median_samples_to_pass": p_med, "p90_samples_to_pass": p_p90,
                "inconclusive_rate": float(1.0 - decided.mean()),
                "clipped_share": clipped / (cfg.runs * cfg.nodes * cfg.max_samples),
            },
            "mannwhitney": {
                "rollback_rate": m_rate, "median_samples_to_rollback": m_med, "p90_samples_to_rollback": m_p90,
            },
            "mannwhitney_no_effect_size": {
                "rollback_rate": q_rate, "median_samples_to_rollback": q_med, "p90_samples_to_rollback": q_p90,
            },
        })
    config = {
        "runs": cfg.runs, "seed": cfg.seed, "nodes": cfg.nodes, "max_samples": cfg.max_samples,
        "margin": cfg.margin, "alpha": cfg.alpha, "min_samples": cfg.min_samples,
        "clip": default_clip(cfg.margin) if cfg.clip is None else cfg.clip,
        "lambda_cap": cfg.lambda_cap, "mw_alpha": cfg.mw_alpha, "method": METHOD,
        "noise": cfg.model.as_dict(),
    }
    return {"config": config, "results": results, "elapsed_s": round(time.perf_counter() - start, 3),
            "cpu_s": round(time.process_time() - cpu_start, 3)}


def parse_regressions(text: str) -> tuple[float, ...]:
    """Parse ``"0.0,0.02,0.05"`` into fractions; ValueError names the bad item."""
    out = []
    for item in text.split(","):
        item = item.strip()
        try:
            out.append(float(item))
        except ValueError:
            raise ValueError(f"--regression item {item!r} is not a number (use e.g. 0.0,0.02,0.05)") from None
    return tuple(out)


def results_rows(report: dict[str, object]) -> Sequence[dict[str, object]]:
    """The per-regression result rows of a :func:`simulate` report."""
    rows = report["results"]
    assert isinstance(rows, list)
    return rows
