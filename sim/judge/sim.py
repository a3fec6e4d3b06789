"""Monte-Carlo benchmark of the judge on the candidate classes of issue 25 (``kernelctl sim judge``).

One *run* is one canary step of ``nodes`` nodes observed for ``ticks`` ticks (the step deadline); every tick
each node delivers one report: per cell (default 8; the busiest carries 60% of the traffic, the rest share
40%) and for e2e, both arms' mean and p99 over ``calls`` timed calls (:mod:`sim.judge.noise`). The judged
family is what ``controller.judge.gates.latency`` hands to :func:`controller.judge.family.judge_family`:
mean and p99 of every cell, of the traffic-weighted aggregate (:func:`controller.judge.statistic.
aggregate_log_ratio`) and of e2e, each a series over all reports so far (tick-major), each against its own
margin. The judge is evaluated after every tick with the same code (the vectorised core of
:func:`judge_latency`: :func:`controller.judge.confseq.margin_test` and the family's parameters and levels);
``tests/controller/test_judge_family.py`` checks the decisions equal ``judge_family``'s tick by tick.

Outcomes per run: the first tick the family regresses, the first tick it passes (every metric passes at
that tick, nothing regressed). *Promoted* = passed before any regress; *rolled back* = regressed before any
pass; *undecided* = neither by the deadline. The deadline is the controller's: a run still holding at ``ticks``
with every metric sampled and none regressed is extended (``StepSpec.deadline_extension``, default 1: up to
``ticks * (1 + extension)``) and only then counted undecided; ``undecided_at_deadline`` is the share still
open at ``ticks``, i.e. extended (the extension's condition holds for every such run: every metric has its
samples by then, and a regression would have ended the run). For the classes that deserve a promotion the false-rollback rate
counts a regress at *any* tick, even after a pass (conservative).

Baselines on the same reports, same multiplicity split, re-evaluated every tick, mean statistics only:
``ttest`` (one-sided Student-t bounds: regress when the lower bound is above the margin, pass when every
upper bound is below it) and ``mannwhitney`` (Kayenta: per tick the group-mean log-latency of each arm,
one-sided Mann-Whitney U, regress when p < alpha_m and the median ratio exceeds the margin; pass = never
regressed by the deadline); both baselines are judged at ``ticks`` without the extension.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from controller.judge.confseq import margin_test
from controller.judge.family import MetricSeries, metric_params, split_alpha
from controller.judge.latency import METHOD
from controller.judge.statistic import aggregate_log_ratio
from sim.judge.noise import CLASSES, PASS, SIGMAS, CandidateClass, ar1, pool

NEVER = np.iinfo(np.int32).max
P99_MARGIN = math.log(1.10)


@dataclass(frozen=True)
class SimConfig:
    """Simulation settings (defaults are the documented benchmark)."""

    runs: int = 2000
    seed: int = 0
    classes: tuple[str, ...] = tuple(CLASSES)
    nodes: tuple[int, ...] = (1, 3, 10)
    ticks: int = 60
    extension: float = 1.0  # StepSpec.deadline_extension: a clean hold goes on to ticks * (1 + extension)
    cells: int = 8
    calls: int = 512
    e2e_calls: int = 72
    margin: float = math.log(1.02)
    p99_margin: float = P99_MARGIN
    e2e_margin: float = math.log(1.03)
    alpha: float = 0.05
    min_samples: int = 5
    baselines: bool = True
    pool: int = 1 << 13
    elements: int = 2_000_000  # target array size per chunk

    def __post_init__(self) -> None:
        if not 0 <= self.extension <= 10:
            raise ValueError(f"extension must be in [0, 10], got {self.extension!r}")
        if self.runs < 1 or self.ticks < 1 or self.cells < 2 or not self.nodes or min(self.nodes) < 1:
            raise ValueError("runs, ticks and every node count must be >= 1, cells >= 2")
        for c in self.classes:
            if c not in CLASSES:
                raise ValueError(f"unknown class {c!r}; choose from {', '.join(CLASSES)}")


def horizon(cfg: SimConfig) -> int:
    """Ticks a run may last: the deadline and its extension for a clean hold."""
    return round(cfg.ticks * (1.0 + cfg.extension))


def traffic_weights(cells: int) -> np.ndarray:
    """Cell 0 carries 60% of the traffic, the others share 40% (Zipf)."""
    rest = 1.0 / np.arange(1, cells)
    return np.concatenate([[0.6], 0.4 * rest / rest.sum()])


def metric_layout(cells: int, cfg: SimConfig) -> dict[str, MetricSeries]:
    """Metric names in the gate's order (cells, aggregate, e2e; mean then p99), margins and kinds."""
    out = {}
    for base, summary, mean_margin in ([(f"cell{c}", False, cfg.margin) for c in range(cells)]
                                       + [("aggregate", True, cfg.margin), ("e2e", True, cfg.e2e_margin)]):
        out[f"{base}:mean"] = MetricSeries((), (), mean_margin, summary=summary)
        out[f"{base}:p99"] = MetricSeries((), (), max(cfg.p99_margin, mean_margin), summary=summary)
    return out


def _first(mask: np.ndarray) -> np.ndarray:
    idx = mask.argmax(axis=-1)
    return np.where(mask.any(axis=-1), idx, NEVER)


@dataclass(frozen=True)
class Reports:
    """(runs, metrics, ticks * nodes) tick-major log-ratio series and the stable arm's log mean level."""

    series: np.ndarray
    levels: np.ndarray


class Generator:
    """Draws reports of one class; pools of per-report arm statistics built once."""

    def __init__(self, cls: CandidateClass, cfg: SimConfig) -> None:
        rng = np.random.default_rng([cfg.seed, 7919, list(CLASSES).index(cls.name)])
        self.cls, self.cfg = cls, cfg
        self.sigma = [SIGMAS[c % len(SIGMAS)] for c in range(cfg.cells)]
        self.pools = {(s, heavy): pool(rng, cls, cfg.pool, cfg.calls, s, True, heavy).stats
                      for s in SIGMAS for heavy in (False, True)}
        self.e2e = pool(rng, cls, cfg.pool, cfg.e2e_calls, 0.015, True, False).stats
        self.weights = traffic_weights(cfg.cells)

    def draw(self, rng: np.random.Generator, runs: int, nodes: int, ticks: int | None = None) -> Reports:
        cfg, cls = self.cfg, self.cls
        ticks = cfg.ticks if ticks is None else ticks
        shape = (runs, ticks, nodes)
        cell = np.empty((*shape, cfg.cells, 4))
        for c in range(cfg.cells):
            cell[..., c, :] = self.pools[(self.sigma[c], c == 0)][rng.integers(0, cfg.pool, shape)]
        e2e = self.e2e[rng.integers(0, cfg.pool, shape)]
        level = np.exp(rng.standard_normal((runs, 1, nodes)) * 0.1)  # node speed, both arms
        cell *= level[..., None, None]
        e2e = e2e * level[..., None]
        common = np.zeros(shape)
        if cls.ratio_sd > 0:
            common = ar1(rng, (runs, nodes), ticks, cls.ratio_phi, cls.ratio_sd)
        cell[..., 2:] *= np.exp(common)[..., None, None]
        e2e[..., 2:] *= np.exp(common)[..., None]
        lr_cell = np.log(cell[..., 2:] / cell[..., :2])  # (R, T, K, C, [mean, p99])
        agg = np.stack([aggregate_log_ratio(cell[..., 0], cell[..., 2], self.weights),
                        aggregate_log_ratio(cell[..., 1], cell[..., 3], self.weights)], axis=-1)
        lr_e2e = np.log(e2e[..., 2:] / e2e[..., :2])
        allm = np.concatenate([lr_cell.reshape(*shape, -1), agg, lr_e2e], axis=-1)  # (R, T, K, M)
        lv_cell = np.log(cell[..., 0])
        lv = np.concatenate([np.repeat(lv_cell, 2, axis=-1), np.log(cell[..., 0] @ self.weights)[..., None]
                             .repeat(2, -1), np.log(e2e[..., :1]).repeat(2, -1)], axis=-1)
        m = allm.shape[-1]
        series = np.ascontiguousarray(allm.transpose(0, 3, 1, 2).reshape(runs, m, ticks * nodes))
        levels = np.ascontiguousarray(lv.transpose(0, 3, 1, 2).reshape(runs, m, ticks * nodes))
        return Reports(series, levels)


def judge_codes(series: np.ndarray, nodes: int, layout: dict[str, MetricSeries], alpha: float,
                min_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """First regress tick and first pass tick of the family (judge_family's rule) per run."""
    runs, _, n = series.shape
    ticks = n // nodes
    ends = np.arange(1, ticks + 1) * nodes - 1
    enough = (ends + 1) >= min_samples
    prev = np.arange(n) - nodes
    alphas = split_alpha({k: m.summary for k, m in layout.items()}, alpha)
    regress = np.zeros((runs, ticks), dtype=bool)
    passed = np.ones((runs, ticks), dtype=bool)
    for j, (name, m) in enumerate(layout.items()):
        res, clip = metric_params(m)
        x = series[:, j, :].astype(np.float64)
        up = margin_test(x, side="regress", margin=m.margin, resolution=res, far=clip, prev=prev)
        regress |= (up[:, ends] >= math.log(1.0 / alphas[name])) & enough
        if m.must_pass:
            down = margin_test(x, side="pass", margin=m.margin, resolution=res, far=clip, prev=prev)
            passed &= (down[:, ends] >= math.log(1.0 / alpha)) & enough  # pass tests at the full alpha
    regress = np.logical_or.accumulate(regress, axis=-1)
    return _first(regress), _first(passed & ~regress)


def _mean_metrics(layout: dict[str, MetricSeries]) -> list[int]:
    return [j for j, k in enumerate(layout) if k.endswith(":mean")]


def ttest_codes(series: np.ndarray, nodes: int, layout: dict[str, MetricSeries], alpha: float,
                min_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """Repeated one-sided t-test on the mean metrics, same family rule and levels."""
    from scipy import stats

    runs, _, n = series.shape
    ticks = n // nodes
    ends = np.arange(1, ticks + 1) * nodes - 1
    cnt = (ends + 1).astype(np.float64)
    ok = cnt >= max(min_samples, 2)
    names = list(layout)
    idx = _mean_metrics(layout)
    alphas = split_alpha({names[j]: layout[names[j]].summary for j in idx}, alpha)
    regress = np.zeros((runs, ticks), dtype=bool)
    passed = np.ones((runs, ticks), dtype=bool)
    for j in idx:
        x = series[:, j, :].astype(np.float64)
        mean = np.cumsum(x, axis=-1)[..., ends] / cnt
        s2 = np.cumsum(x * x, axis=-1)[..., ends] / cnt
        sd = np.sqrt(np.maximum(s2 - mean * mean, 0.0) * cnt / np.maximum(cnt - 1, 1))
        m = layout[names[j]]
        q = stats.t.ppf(1 - alphas[names[j]], np.maximum(cnt - 1, 1))
        regress |= ((mean - q * sd / np.sqrt(cnt)) > m.margin) & ok
        half_p = stats.t.ppf(1 - alpha, np.maximum(cnt - 1, 1)) * sd / np.sqrt(cnt)
        passed &= ((mean + half_p) < m.margin) & ok
    regress = np.logical_or.accumulate(regress, axis=-1)
    return _first(regress), _first(passed & ~regress)


def mannwhitney_first(rep: Reports, nodes: int, layout: dict[str, MetricSeries], alpha: float,
                      min_samples: int) -> np.ndarray:
    """Kayenta-style repeated Mann-Whitney on per-tick group-mean arm log-latencies (mean metrics)."""
    from scipy.special import ndtr

    idx = _mean_metrics(layout)
    names = list(layout)
    series, levels = rep.series[:, idx], rep.levels[:, idx]
    runs, nmet, n = series.shape
    ticks = n // nodes
    st = levels.reshape(runs, nmet, ticks, nodes).mean(axis=-1)
    ca = (levels + series).reshape(runs, nmet, ticks, nodes).mean(axis=-1)
    alphas = np.array(list(split_alpha({names[j]: layout[names[j]].summary for j in idx}, alpha).values()))
    margins = np.array([layout[names[j]].margin for j in idx])
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


def _summary(first_reg: np.ndarray, first_pass: np.ndarray | None, expected: str,
             deadline: int | None = None) -> dict[str, object]:
    runs = first_reg.size
    reg_first = first_reg if first_pass is None else np.where(first_reg <= first_pass, first_reg, NEVER)
    hit = reg_first[reg_first != NEVER] + 1
    out: dict[str, object] = {"rolled_back": float(hit.size / runs),
                              "median_reports_to_rollback": float(np.median(hit)) if hit.size else None}
    if expected == PASS:
        out["false_rollback"] = float((first_reg != NEVER).mean())
    if first_pass is None:  # a judge that never passes: promoted = never regressed by the deadline
        out["promoted"] = float((first_reg == NEVER).mean())
        return out
    pas = np.where(first_pass < first_reg, first_pass, NEVER)
    ph = pas[pas != NEVER] + 1
    out["promoted"] = float(ph.size / runs)
    out["median_ticks_to_pass"] = float(np.median(ph)) if ph.size else None
    out["undecided"] = float(((first_reg == NEVER) & (first_pass == NEVER)).mean())
    if deadline is not None:  # open at the nominal deadline: extended (or, with no extension, undecided)
        out["undecided_at_deadline"] = float(((first_reg >= deadline) & (first_pass >= deadline)).mean())
    return out


def simulate(cfg: SimConfig) -> dict[str, object]:
    """Every (class, nodes) row; JSON-safe dict with ``config``, ``rows``, ``elapsed_s``, ``cpu_s``."""
    start, cpu0 = time.perf_counter(), time.process_time()
    layout = metric_layout(cfg.cells, cfg)
    rows = []
    for name in cfg.classes:
        cls = CLASSES[name]
        gen = Generator(cls, cfg)
        for k in cfg.nodes:
            rng = np.random.default_rng([cfg.seed, k, list(CLASSES).index(name), 17])
            total = horizon(cfg)
            chunk = max(1, cfg.elements // (len(layout) * total * k))
            parts: dict[str, list[np.ndarray]] = {"j_r": [], "j_p": [], "t_r": [], "t_p": [], "mw": []}
            done = 0
            while done < cfg.runs:
                r = min(chunk, cfg.runs - done)
                rep = gen.draw(rng, r, k, total)
                a, b = judge_codes(rep.series, k, layout, cfg.alpha, cfg.min_samples)
                parts["j_r"].append(a)
                parts["j_p"].append(b)
                if cfg.baselines:  # at the nominal deadline
                    n = cfg.ticks * k
                    rep = Reports(rep.series[..., :n], rep.levels[..., :n])
                    a, b = ttest_codes(rep.series, k, layout, cfg.alpha, cfg.min_samples)
                    parts["t_r"].append(a)
                    parts["t_p"].append(b)
                    parts["mw"].append(mannwhitney_first(rep, k, layout, cfg.alpha, cfg.min_samples))
                done += r
            cat = {key: np.concatenate(v) for key, v in parts.items() if v}
            row: dict[str, object] = {"class": name, "expected": cls.expected, "nodes": k,
                                      "judge": _summary(cat["j_r"], cat["j_p"], cls.expected, cfg.ticks)}
            if cfg.baselines:
                row["ttest"] = _summary(cat["t_r"], cat["t_p"], cls.expected)
                row["mannwhitney"] = _summary(cat["mw"], None, cls.expected)
            rows.append(row)
    config = {"runs": cfg.runs, "seed": cfg.seed, "nodes": list(cfg.nodes), "ticks": cfg.ticks, "extension": cfg.extension,
              "cells": cfg.cells,
              "calls": cfg.calls, "margin": cfg.margin, "p99_margin": cfg.p99_margin, "e2e_margin": cfg.e2e_margin,
              "alpha": cfg.alpha, "min_samples": cfg.min_samples, "method": METHOD,
              "classes": {n: CLASSES[n].as_dict() for n in cfg.classes}}
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
