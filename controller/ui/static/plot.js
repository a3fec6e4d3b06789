// The bounds plot: one judged metric over time. The line is the estimate, the dashed red line the margin,
// vertical lines the decision points (advance, rollback, pause, promote) and step changes. A latency metric
// (issue 25) shows the one-sided bound that decides against the margin (thin line; the upper bound must fall
// below the margin to pass, the lower bound must rise above it to roll back); a resource metric its range as a
// shaded band [lower, upper]. Y ticks of a log-ratio are round percentages. Inline SVG, no library.
//
// points: [{t: ms since epoch, value, lower, upper, bound, boundSide, margin, n, decision, gate, step}] (oldest
// first; any value may be null). Everything is drawn with createElementNS and text nodes.

import {fmtUnit, isNum, s} from "./dom.js";

const W = 660, H = 230, L = 70, R = 96, T = 18, B = 30;

function niceStep(span, count) {
  const raw = span / Math.max(1, count);
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const norm = raw / mag;
  return (norm < 1.5 ? 1 : norm < 3 ? 2 : norm < 7 ? 5 : 10) * mag;
}

function linearTicks(lo, hi, count) {
  if (!(hi > lo)) return [lo];
  const step = niceStep(hi - lo, count);
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(Math.abs(v) < step * 1e-9 ? 0 : v);
  return out;
}

/** Ticks at round values of what the label shows: percentages for a log-ratio (+5%, not +5.13%). */
function ticks(lo, hi, count, unit) {
  if (unit !== "log_ratio") return linearTicks(lo, hi, count).map((v) => [v, null]);
  return linearTicks(Math.expm1(lo) * 100, Math.expm1(hi) * 100, count)
    .filter((p) => p > -100)
    .map((p) => [Math.log1p(p / 100), `${p > 0 ? "+" : ""}${Number(p.toPrecision(3))}%`]);
}

/** The y window: estimates, margin and zero always; bounds only as far as they stay readable. */
const OFF_SCALE = 1e29; // the judge writes 1e30 for an unbounded ratio (a stable peak of zero)

function yDomain(points, unit) {
  const core = [unit === "ratio" ? 1 : 0];
  const bounds = [];
  for (const p of points) {
    for (const v of [p.value, p.margin]) if (isNum(v) && Math.abs(v) < OFF_SCALE) core.push(v);
    for (const v of [p.lower, p.upper, p.bound]) if (isNum(v) && Math.abs(v) < OFF_SCALE) bounds.push(v);
  }
  let lo = Math.min(...core), hi = Math.max(...core);
  const scale = Math.max(hi - lo, ...points.map((p) => (isNum(p.margin) ? Math.abs(p.margin) : 0)), 1e-6);
  const reach = 3 * scale; // very wide early bounds are clipped at the edge (the band runs off the plot)
  for (const v of bounds) {
    if (v < lo) lo = Math.max(v, lo - reach);
    if (v > hi) hi = Math.min(v, hi + reach);
  }
  const pad = (hi - lo) * 0.08 || scale * 0.1;
  return [lo - pad, hi + pad];
}

function polyline(points, key, xs, ys, attrs) {
  const out = [];
  let run = [];
  const flush = () => {
    if (run.length) out.push(s("polyline", {points: run.join(" "), fill: "none", ...attrs}));
    run = [];
  };
  for (const p of points) {
    if (isNum(p[key])) run.push(`${xs(p.t).toFixed(1)},${ys(p[key]).toFixed(1)}`);
    else flush();
  }
  flush();
  return out;
}

function bands(points, xs, ys) {
  const out = [];
  let run = [];
  const flush = () => {
    if (run.length) {
      const top = run.map((p) => `${xs(p.t).toFixed(1)},${ys(p.upper).toFixed(1)}`);
      const bottom = run.slice().reverse().map((p) => `${xs(p.t).toFixed(1)},${ys(p.lower).toFixed(1)}`);
      if (run.length === 1) { // one verdict: a short bar instead of a zero-width polygon
        const x = xs(run[0].t);
        top.splice(0, 1, `${(x - 3).toFixed(1)},${ys(run[0].upper).toFixed(1)}`, `${(x + 3).toFixed(1)},${ys(run[0].upper).toFixed(1)}`);
        bottom.splice(0, 1, `${(x + 3).toFixed(1)},${ys(run[0].lower).toFixed(1)}`, `${(x - 3).toFixed(1)},${ys(run[0].lower).toFixed(1)}`);
      }
      out.push(s("polygon", {class: "kc-band", points: [...top, ...bottom].join(" ")}));
    }
    run = [];
  };
  for (const p of points) {
    if (isNum(p.lower) && isNum(p.upper)) run.push(p);
    else flush();
  }
  flush();
  return out;
}

function timeLabel(ms) {
  return new Date(ms).toISOString().slice(11, 19);
}

/** An SVG bounds plot of one metric (see the header comment for ``points``). */
export function boundsPlot({metric, kind = "", unit, points, deciding = false}) {
  const pts = points.filter((p) => isNum(p.t)).sort((a, b) => a.t - b.t);
  let t0 = pts.length ? pts[0].t : Date.now(), t1 = pts.length ? pts[pts.length - 1].t : t0;
  if (t1 - t0 < 10_000) { t0 -= 5_000; t1 += 5_000; }
  const [y0, y1] = yDomain(pts, unit);
  const xs = (t) => L + ((t - t0) / (t1 - t0)) * (W - L - R);
  const ys = (v) => T + (1 - (v - y0) / (y1 - y0)) * (H - T - B);
  const clipId = `clip-${String(metric).replace(/[^A-Za-z0-9_-]/g, "_")}-${Math.random().toString(36).slice(2, 8)}`;

  const svg = s("svg", {
    class: `kc-plot${deciding ? " deciding" : ""}`, viewBox: `0 0 ${W} ${H}`, role: "img",
    "aria-label": `${metric}: estimate and confidence bounds over time against the margin`,
    "data-metric": metric, "data-kind": kind, "data-points": pts.length,
    "data-bounds": pts.filter((p) => (isNum(p.lower) && isNum(p.upper)) || isNum(p.bound)).length,
  });
  svg.append(s("title", {}, `${metric}: estimate and confidence bounds over time against the margin`));
  svg.append(s("defs", {}, s("clipPath", {id: clipId},
    s("rect", {x: L, y: T, width: W - L - R, height: H - T - B}))));

  // axes and grid
  const grid = s("g", {class: "kc-grid"});
  for (const [v, label] of ticks(y0, y1, 5, unit)) {
    grid.append(s("line", {x1: L, x2: W - R, y1: ys(v), y2: ys(v)}));
    grid.append(s("text", {x: L - 6, y: ys(v) + 4, "text-anchor": "end"}, label ?? fmtUnit(v, unit)));
  }
  const xt = [t0, t0 + (t1 - t0) / 3, t0 + (2 * (t1 - t0)) / 3, t1];
  for (const t of xt) grid.append(s("text", {x: xs(t), y: H - 10, "text-anchor": "middle"}, timeLabel(t)));
  grid.append(s("rect", {class: "kc-frame", x: L, y: T, width: W - L - R, height: H - T - B}));
  svg.append(grid);

  const area = s("g", {"clip-path": `url(#${clipId})`});
  const ref = unit === "ratio" ? 1 : 0; // "no change": a log ratio of 0, a ratio of 1
  if (y0 < ref && y1 > ref) area.append(s("line", {class: "kc-zero", x1: L, x2: W - R, y1: ys(ref), y2: ys(ref)}));
  area.append(...bands(pts, xs, ys));
  area.append(...polyline(pts, "upper", xs, ys, {class: "kc-bound"}));
  area.append(...polyline(pts, "lower", xs, ys, {class: "kc-bound"}));
  area.append(...polyline(pts, "bound", xs, ys, {class: "kc-bound kc-deciding-bound"}));
  area.append(...polyline(pts, "margin", xs, ys, {class: "kc-margin"}));
  area.append(...polyline(pts, "value", xs, ys, {class: "kc-estimate"}));
  for (const p of pts) {
    if (!isNum(p.value)) continue;
    const c = s("circle", {class: "kc-point", cx: xs(p.t), cy: ys(p.value), r: 2.5});
    const b = p.boundSide ? `${p.boundSide} bound ${isNum(p.bound) ? fmtUnit(p.bound, unit) : "none yet"}`
      : `[${fmtUnit(p.lower, unit)}, ${fmtUnit(p.upper, unit)}]`;
    c.append(s("title", {}, `${timeLabel(p.t)}  ${p.decision || ""}  estimate ${fmtUnit(p.value, unit)}  ` +
      `${b}  margin ${fmtUnit(p.margin, unit)}  n=${p.n ?? "-"}`));
    area.append(c);
  }
  svg.append(area);

  // decision points and step changes
  const marks = s("g", {class: "kc-marks"});
  let step = pts.length ? pts[0].step : null;
  let lastLabelX = -Infinity, row = 0; // decision labels closer than 110 px drop one line so they never overlap
  for (const p of pts) {
    const x = xs(p.t);
    if (p.step !== null && p.step !== undefined && step !== null && p.step !== step) {
      marks.append(s("line", {class: "kc-step", x1: x, x2: x, y1: T, y2: H - B}));
      marks.append(s("text", {class: "kc-step-label", x: x > W - R - 50 ? x - 3 : x + 3, y: H - B - 4,
        "text-anchor": x > W - R - 50 ? "end" : "start"}, `step ${p.step + 1}`));
    }
    step = p.step ?? step;
    if (p.decision && p.decision !== "hold") {
      const g = s("g", {class: `kc-decision d-${String(p.decision).replace(/[^a-z_]/g, "")}`, "data-decision": p.decision});
      g.append(s("line", {x1: x, x2: x, y1: T, y2: H - B}));
      const nearRight = x > W - R - 110; // keep the label inside the plot: left of the line near the right edge
      row = Math.abs(x - lastLabelX) < 110 ? (row + 1) % 4 : 0;
      lastLabelX = x;
      g.append(s("text", {x: nearRight ? x - 3 : x + 3, y: T + 11 + 12 * row, "text-anchor": nearRight ? "end" : "start"},
        p.gate ? `${p.decision} (${p.gate})` : p.decision));
      marks.append(g);
    }
  }
  svg.append(marks);

  // right-hand labels: last margin and last estimate
  const last = [...pts].reverse();
  const lm = last.find((p) => isNum(p.margin));
  if (lm && lm.margin >= y0 && lm.margin <= y1) {
    svg.append(s("text", {class: "kc-margin-label", x: W - R + 6, y: ys(lm.margin) + 4}, `margin ${fmtUnit(lm.margin, unit)}`));
  }
  const lv = last.find((p) => isNum(p.value));
  if (lv) svg.append(s("text", {class: "kc-estimate-label", x: W - R + 6, y: Math.min(H - B, Math.max(T + 8, ys(lv.value) + 4)) + (lm && Math.abs(ys(lv.value) - ys(lm.margin)) < 12 ? 12 : 0)}, `est ${fmtUnit(lv.value, unit)}`));
  if (!pts.length) svg.append(s("text", {class: "kc-empty", x: W / 2, y: H / 2, "text-anchor": "middle"}, "no verdicts with evidence yet"));
  return svg;
}
