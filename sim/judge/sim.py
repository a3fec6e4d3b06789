"""Monte-Carlo benchmark of the family judge under named noise classes (``kernelctl sim judge --noise``).

One *run* is one canary step of ``nodes`` nodes observed for ``ticks`` ticks (the step deadline); every
tick each node delivers one report holding one sample per (op, batch-size) cell (``cells``, default 45)
and one end-to-end sample. The judged family is what ``controller.gates`` hands to
:func:`controller.judge.family.judge_family`: the 45 cell metrics (advance=False), the traffic-weighted
aggregate ``sum_c w_c x_c`` of each report (advance=True) and the end-to-end ratio (advance=True), each
a series over all reports so far in arrival order (tick-major, node ids 0..K-1). The judge is evaluated
after every tick with the **same code**: the vectorised core of :func:`judge_latency`
(:func:`controller.judge.confseq.margin_test` + :func:`controller.judge.latency.decide`) with the
family's parameters and weighted-Bonferroni levels (:func:`controller.judge.family.split_alpha`,
:func:`controller.judge.family.metric_params`); ``tests/controller/test_judge_family.py`` checks that
the decisions equal ``judge_family``'s on the accumulated samples, tick by tick.

Per-report cell samples come from raw interleaved timings reduced by the engine's estimator
(:func:`controller.judge.statistic.cell_log_ratios`), drawn from pools built per noise class (see
:mod:`sim.judge.noise`); traffic weights are Zipf (w_c ~ 1 / (c + 1)).

Scenarios: ``identical`` (A/A), ``plus1`` (+1% in every cell, inside the 2% margin), ``plus5`` (+5% in
every cell), ``cell2x`` (the cell with the least traffic 2x slower, the rest identical).

Baselines, on the same reports and the same multiplicity split, re-evaluated every tick:
``ttest`` (one-sided Student-t bound on each metric's paired log-ratios: regress when the lower bound is
above the margin, pass when the upper bound is below it) and ``mannwhitney`` (Kayenta-style: per tick the
group-mean log-latency of each arm, one-sided Mann-Whitney U of candidate vs stable, regress when
p < alpha_m and the median ratio exceeds the margin; it never passes, so its "undecided" is not reported).

Outcomes per run: the first tick at which the family regresses and the first at which it passes.
False rollbacks (identical, plus1) count a regress at *any* tick up to the deadline, even after a pass
(conservative); detection (plus5, cell2x) counts a regress before any pass; undecided = neither by the
deadline.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from controller.judge.confseq import margin_test
from controller.judge.family import MetricSeries, metric_params, split_alpha
from controller.judge.latency import METHOD
from sim.judge.noise import NOISE_CLASSES, FamilyNoise

NEVER = np.iinfo(np.int32).max
SCENARIOS = ("identical", "plus1", "plus5", "cell2x")
FALSE_KINDS = ("identical", "plus1")


@dataclass(frozen=True)
class SimConfig:
    """Simulation settings (defaults are the documented benchmark)."""

    runs: int = 10_000
    seed: int = 0
    noise: str = "iid"
    nodes: tuple[int, ...] = (1, 3, 10)
    scenarios: tuple[str, ...] = SCENARIOS
    ticks: int = 60
    cells: int = 45
    margin: float = math.log(1.02)
    alpha: float = 0.05
    min_samples: int = 5
    baselines: bool = True
    elements: int = 3_000_000  # target array size per chunk

    def __post_init__(self) -> None:
        if self.runs < 1 or self.ticks < 1 or self.cells < 1 or not self.nodes or min(self.nodes) < 1:
            raise ValueError("runs, ticks, cells and every node count must be >= 1")
        if self.noise not in NOISE_CLASSES:
            raise ValueError(f"unknown noise class {self.noise!r}; choose one of {', '.join(NOISE_CLASSES)}")
        for s in self.scenarios:
            if s not in SCENARIOS:
                raise ValueError(f"unknown scenario {s!r}; choose from {', '.join(SCENARIOS)}")


def traffic_weights(cells: int) -> np.ndarray:
    """Zipf traffic weights of the cells (sum 1; cell 0 the busiest)."""
    w = 1.0 / np.arange(1, cells + 1)
    return w / w.sum()


def cell_effects(scenario: str, cells: int) -> np.ndarray:
    """True per-cell log-effects of a scenario."""
    eff = np.zeros(cells)
    if scenario == "plus1":
        eff[:] = math.log(1.01)
    elif scenario == "plus5":
        eff[:] = math.log(1.05)
    elif scenario == "cell2x":
        eff[-1] = math.log(2.0)
    return eff


def metric_layout(cells: int, margin: float) -> dict[str, MetricSeries]:
    """The family's metric names and kinds (empty series: only advance flags and margins are used)."""
    out = {f"cell{c:02d}": MetricSeries((), (), margin, advance=False) for c in range(cells)}
    out["aggregate"] = MetricSeries((), (), margin, advance=True)
    out["e2e"] = MetricSeries((), (), margin, advance=True)
    return out


def _first(mask: np.ndarray) -> np.ndarray:
    idx = mask.argmax(axis=-1)
    return np.where(mask.any(axis=-1), idx, NEVER)


def family_series(cells_x: np.ndarray, e2e: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """(runs, metrics, ticks * nodes) tick-major series: cells, then aggregate, then e2e."""
    runs, ticks, nodes, ncell = cells_x.shape
    agg = cells_x @ weights.astype(np.float32)
    allm = np.concatenate([cells_x, agg[..., None], e2e[..., None]], axis=-1)  # (R, T, K, M)
    return np.ascontiguousarray(allm.transpose(0, 3, 1, 2).reshape(runs, ncell + 2, ticks * nodes))


def judge_codes(series: np.ndarray, nodes: int, layout: dict[str, MetricSeries], alpha: float,
                min_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """First regress tick and first pass tick of the family (judge_family's rule) per run."""
    runs, _, n = series.shape
    ticks = n // nodes
    ends = np.arange(1, ticks + 1) * nodes - 1
    enough = (ends + 1) >= min_samples
    prev = np.arange(n) - nodes
    alphas = split_alpha({k: m.advance for k, m in layout.items()}, alpha)
    regress = np.zeros((runs, ticks), dtype=bool)
    passed = np.ones((runs, ticks), dtype=bool)
    for j, (name, m) in enumerate(layout.items()):
        res, clip = metric_params(m)
        thr = math.log(1.0 / alphas[name])
        x = series[:, j, :].astype(np.float64)
        up = margin_test(x, side="regress", margin=m.margin, resolution=res, far=clip, prev=prev)
        regress |= (up[:, ends] >= thr) & enough
        if m.advance:
            down = margin_test(x, side="pass", margin=m.margin, resolution=res, far=clip, prev=prev)
            passed &= (down[:, ends] >= math.log(1.0 / alpha)) & enough  # pass tests at the full alpha
    return _first(regress), _first(passed & ~regress)


def ttest_codes(series: np.ndarray, nodes: int, layout: dict[str, MetricSeries], alpha: float,
                min_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """Repeated one-sided t-test baseline, same family rule and levels."""
    from scipy import stats

    runs, _, n = series.shape
    ticks = n // nodes
    ends = np.arange(1, ticks + 1) * nodes - 1
    cnt = (ends + 1).astype(np.float64)
    ok = cnt >= max(min_samples, 2)
    alphas = split_alpha({k: m.advance for k, m in layout.items()}, alpha)
    x = series.astype(np.float64)
    s1 = np.cumsum(x, axis=-1)[..., ends]
    s2 = np.cumsum(x * x, axis=-1)[..., ends]
    mean = s1 / cnt
    sd = np.sqrt(np.maximum(s2 / cnt - mean * mean, 0.0) * cnt / np.maximum(cnt - 1, 1))
    regress = np.zeros((runs, ticks), dtype=bool)
    passed = np.ones((runs, ticks), dtype=bool)
    for j, (name, m) in enumerate(layout.items()):
        q = stats.t.ppf(1 - alphas[name], np.maximum(cnt - 1, 1))
        half = q * sd[:, j] / np.sqrt(cnt)
        regress |= ((mean[:, j] - half) > m.margin) & ok
        if m.advance:
            half_p = stats.t.ppf(1 - alpha, np.maximum(cnt - 1, 1)) * sd[:, j] / np.sqrt(cnt)
            passed &= ((mean[:, j] + half_p) < m.margin) & ok
    return _first(regress), _first(passed & ~regress)


def mannwhitney_first(series: np.ndarray, levels: np.ndarray, nodes: int, layout: dict[str, MetricSeries],
                      alpha: float, min_samples: int) -> np.ndarray:
    """Kayenta-style repeated Mann-Whitney baseline on per-tick group-mean arm log-latencies.

    ``levels`` (runs, metrics, ticks * nodes): the stable arm's log-latency of each report; the candidate
    arm is ``levels + series``. U is updated incrementally tick by tick (normal approximation, one-sided).
    """
    from scipy.special import ndtr

    runs, nmet, n = series.shape
    ticks = n // nodes
    st = levels.reshape(runs, nmet, ticks, nodes).mean(axis=-1)
    ca = (levels + series).reshape(runs, nmet, ticks, nodes).mean(axis=-1)
    alphas = np.array(list(split_alpha({k: m.advance for k, m in layout.items()}, alpha).values()))
    margins = np.array([m.margin for m in layout.values()])
    u = np.zeros((runs, nmet))
    regress = np.zeros((runs, ticks), dtype=bool)
    for t in range(ticks):
        u += (ca[..., t:t + 1] > st[..., : t + 1]).sum(-1) + (ca[..., :t] > st[..., t:t + 1]).sum(-1)
        k = t + 1
        if k < min_samples:
            continue
        mu, sig = k * k / 2.0, math.sqrt(k * k * (2 * k + 1) / 12.0)
        p = 1.0 - ndtr((u - mu - 0.5) / sig)
        ratio = np.median(ca[..., :k], axis=-1) - np.median(st[..., :k], axis=-1)
        regress[:, t] = ((p < alphas) & (ratio > margins)).any(axis=-1)
    return _first(regress)


def _arm_levels(rng: np.random.Generator, runs: int, ticks: int, nodes: int, nmet: int) -> np.ndarray:
    """Stable-arm log-latency per report: node baseline (sd 10%), AR(1) node state (phi 0.8, sd 3%),
    per-report noise sd 1% (both arms share baseline and state; the candidate adds the report's ratio)."""
    base = rng.standard_normal((runs, 1, 1, nodes)) * 0.10
    state = np.empty((runs, 1, ticks, nodes))
    cur = rng.standard_normal((runs, nodes)) * 0.03
    for t in range(ticks):
        if t:
            cur = 0.8 * cur + 0.03 * math.sqrt(1 - 0.64) * rng.standard_normal((runs, nodes))
        state[:, 0, t] = cur
    lv = base + state + rng.standard_normal((runs, nmet, ticks, nodes)) * 0.01
    return lv.reshape(runs, nmet, ticks * nodes)


def _summary(first_reg: np.ndarray, first_pass: np.ndarray | None, scenario: str, ticks: int
             ) -> dict[str, object]:
    runs = first_reg.size
    out: dict[str, object] = {}
    if scenario in FALSE_KINDS:
        out["false_rollback_rate"] = float((first_reg != NEVER).mean())
    reg_first = first_reg if first_pass is None else np.where(first_reg <= first_pass, first_reg, NEVER)
    hit = reg_first[reg_first != NEVER] + 1
    out["rollback_rate"] = float(hit.size / runs)
    out["median_ticks_to_rollback"] = float(np.median(hit)) if hit.size else None
    out["rollback_within_10_rate"] = float((hit <= 10).sum() / runs)
    if first_pass is not None:
        pas = np.where(first_pass < first_reg, first_pass, NEVER)
        ph = pas[pas != NEVER] + 1
        out["pass_rate"] = float(ph.size / runs)
        out["median_ticks_to_pass"] = float(np.median(ph)) if ph.size else None
        out["undecided_rate"] = float(((first_reg == NEVER) & (first_pass == NEVER)).mean())
    return out


def simulate(cfg: SimConfig) -> dict[str, object]:
    """Run every (nodes, scenario) row; JSON-safe dict with ``config``, ``rows``, ``elapsed_s``, ``cpu_s``."""
    start, cpu0 = time.perf_counter(), time.process_time()
    nc = NOISE_CLASSES[cfg.noise]
    noise = FamilyNoise(nc, cfg.cells, cfg.seed)
    weights = traffic_weights(cfg.cells)
    layout = metric_layout(cfg.cells, cfg.margin)
    rows = []
    for k in cfg.nodes:
        for scen in cfg.scenarios:
            rng = np.random.default_rng([cfg.seed, k, SCENARIOS.index(scen), 17])
            eff = cell_effects(scen, cfg.cells)
            chunk = max(1, cfg.elements // ((cfg.cells + 2) * cfg.ticks * k))
            parts: dict[str, list[np.ndarray]] = {"cs_r": [], "cs_p": [], "t_r": [], "t_p": [], "mw_r": []}
            done = 0
            while done < cfg.runs:
                r = min(chunk, cfg.runs - done)
                rep = noise.draw(rng, runs=r, ticks=cfg.ticks, nodes=k, cell_effect=eff, weights=weights)
                series = family_series(rep.cells, rep.e2e, weights)
                a, b = judge_codes(series, k, layout, cfg.alpha, cfg.min_samples)
                parts["cs_r"].append(a)
                parts["cs_p"].append(b)
                if cfg.baselines:
                    a, b = ttest_codes(series, k, layout, cfg.alpha, cfg.min_samples)
                    parts["t_r"].append(a)
                    parts["t_p"].append(b)
                    lv = _arm_levels(rng, r, cfg.ticks, k, series.shape[1])
                    parts["mw_r"].append(mannwhitney_first(series, lv, k, layout, cfg.alpha, cfg.min_samples))
                done += r
            cat = {key: np.concatenate(v) for key, v in parts.items() if v}
            row: dict[str, object] = {"nodes": k, "scenario": scen,
                                      "judge": _summary(cat["cs_r"], cat["cs_p"], scen, cfg.ticks)}
            if cfg.baselines:
                row["ttest"] = _summary(cat["t_r"], cat["t_p"], scen, cfg.ticks)
                row["mannwhitney"] = _summary(cat["mw_r"], None, scen, cfg.ticks)
            rows.append(row)
    config = {"runs": cfg.runs, "seed": cfg.seed, "noise": nc.as_dict(), "nodes": list(cfg.nodes),
              "ticks": cfg.ticks, "cells": cfg.cells, "margin": cfg.margin, "alpha": cfg.alpha,
              "min_samples": cfg.min_samples, "method": METHOD}
    return {"config": config, "rows": rows, "elapsed_s": round(time.perf_counter() - start, 3),
            "cpu_s": round(time.process_time() - cpu0, 3)}


def parse_csv(text: str, kind: type = str) -> tuple:  # type: ignore[type-arg]
    """Parse ``"1,3,10"`` (``kind=int``) or ``"identical,plus5"``; ValueError names the bad item."""
    out = []
    for item in text.split(","):
        item = item.strip()
        try:
            out.append(kind(item))
        except ValueError:
            raise ValueError(f"item {item!r} is not a valid {kind.__name__}") from None
    return tuple(out)
