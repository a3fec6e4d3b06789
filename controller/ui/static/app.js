// The kernelctl UI: sign-in, a hash router and five views (rollouts, one rollout, nodes, compatibility,
// audit). Everything shown is fetched from the controller's /v1 API (the one the CLI uses) with the bearer
// token typed at sign-in; roles are the API's: a viewer sees, an operator also gets the rollout actions.
// Values go into the page only as text (dom.js h()/replace()); nothing here assigns innerHTML.

import {ApiError, age, api, clock, fmtUnit, h, isNum, query, replace, setToken, stateBadge, token} from "./dom.js";
import {boundsPlot} from "./plot.js";

const main = document.getElementById("main");
// partly_promoted: the strata ended differently (some promoted, some rolled back); terminal
const TERMINAL = new Set(["promoted", "partly_promoted", "rolled_back"]);
const POLL_ROLLOUT_MS = 2000;
const POLL_LIST_MS = 5000;
const NODES_EVERY_MS = 5000;
const POLL_NODES_MS = 10000; // the nodes page re-renders the whole fleet: less often // the rollout page refreshes the (possibly large) node list less often
// metrics with an estimate and bounds judged against a margin get a plot; the others (launch counts, numeric
// error, hard gates) are rows of the metrics table
const PLOTTED_KINDS = new Set(["latency_cell", "latency_aggregate", "e2e", "memory"]);
const ROLLOUT_STATES = ["pending", "progressing", "paused", "promoted", "partly_promoted", "rolled_back"];

let me = null; // GET /v1/whoami: {name, role, actor}
let stopView = null; // stops the current view's polling
let updates = 0;

// ------------------------------------------------------------------------------------------ chrome
function isOperator() {
  return me && me.role === "operator";
}

function liveOn() {
  return document.getElementById("live").checked;
}

function markUpdated() {
  updates += 1;
  const el = document.getElementById("updated");
  el.dataset.updates = String(updates);
  replace(el, `updated ${new Date().toISOString().slice(11, 19)}Z`);
}

function showChrome(signedIn) {
  document.getElementById("nav").hidden = !signedIn;
  document.getElementById("who").hidden = !signedIn;
  if (signedIn) {
    replace(document.getElementById("whoami"), h("span", {class: "user"}, me.name), " ",
      h("span", {class: `role role-${me.role}`, id: "role"}, me.role));
    const view = (location.hash.replace(/^#\/?/, "").split(/[/?]/)[0]) || "rollouts";
    for (const a of document.querySelectorAll("#nav a")) a.classList.toggle("current", a.dataset.view === view);
  }
}

function banner(container, err) {
  const text = err instanceof ApiError ? `${err.status ? err.status + ": " : ""}${err.message}` : String(err && err.message || err);
  const el = h("p", {class: "error", role: "alert"}, text);
  container.prepend(el);
  return el;
}

/** Run ``fn`` now and then every ``ms`` (a number, or a function giving the next wait) while the view is shown
 * and "live" is on; errors show as a banner. */
function poll(container, ms, fn) {
  let stopped = false, timer = null, errEl = null;
  const run = async (force) => {
    if (stopped) return;
    if (force || liveOn()) {
      try {
        await fn();
        if (errEl) { errEl.remove(); errEl = null; }
        markUpdated();
      } catch (err) {
        if (stopped) return;
        if (handleAuth(err)) return;
        if (errEl) errEl.remove();
        errEl = banner(container, err);
      }
    }
    if (!stopped) timer = setTimeout(() => run(false), typeof ms === "function" ? ms() : ms);
  };
  run(true);
  return {
    stop() { stopped = true; clearTimeout(timer); },
    async now() { clearTimeout(timer); await run(true); },
  };
}

/** A 401 ends the session: back to sign-in with the API's reason. */
function handleAuth(err) {
  if (err instanceof ApiError && err.status === 401) {
    setToken(null);
    me = null;
    showLogin(`signed out: ${err.message}`);
    return true;
  }
  return false;
}

// ------------------------------------------------------------------------------------------ sign-in
function showLogin(message) {
  if (stopView) { stopView(); stopView = null; }
  showChrome(false);
  const input = h("input", {type: "password", id: "token", name: "token", autocomplete: "off", required: true,
    placeholder: "kctl_...", spellcheck: "false"});
  const status = h("p", {id: "login-status", class: message ? "error" : "muted", role: "status"}, message || "");
  const form = h("form", {id: "login", class: "login", onsubmit: async (ev) => {
    ev.preventDefault();
    const tok = input.value.trim();
    if (!tok) return;
    try {
      me = await api("GET", "/v1/whoami", undefined, tok);
    } catch (err) {
      replace(status, err instanceof ApiError && err.status === 403
        ? `this token may not use the UI: ${err.message}` : `sign-in failed: ${err.message}`);
      status.className = "error";
      return;
    }
    setToken(tok);
    input.value = "";
    route();
  }},
  h("h1", {}, "Sign in to kernelctl"),
  h("p", {class: "muted"}, "Paste a viewer or operator API token (`kernelctl token create`). It stays in this ",
    "browser tab only (sessionStorage) and is sent as an Authorization header to the controller's API."),
  h("label", {for: "token"}, "API token"), input,
  h("button", {type: "submit", id: "login-submit"}, "Sign in"), status);
  replace(main, form);
  input.focus();
}

// ------------------------------------------------------------------------------------------ router
let routeGen = 0;

async function route() {
  if (stopView) { stopView(); stopView = null; }
  const gen = ++routeGen;
  if (!token()) return showLogin();
  if (!me) {
    try {
      const who = await api("GET", "/v1/whoami");
      if (gen !== routeGen) return; // a newer navigation took over
      me = who;
    } catch (err) {
      if (gen !== routeGen) return;
      if (err instanceof ApiError && (err.status === 401 || err.status === 403)) {
        setToken(null);
        return showLogin(err.message);
      }
      replace(main);
      banner(main, err);
      return;
    }
  }
  showChrome(true);
  const [path, qs] = location.hash.replace(/^#/, "").split("?");
  const parts = path.split("/").filter(Boolean);
  const params = new URLSearchParams(qs || "");
  const view = parts[0] || "rollouts";
  const section = h("section", {class: `view view-${view}`, id: "view"});
  replace(main, section);
  if (view === "rollouts" && parts[1]) stopView = rolloutView(section, Number(parts[1]));
  else if (view === "rollouts") stopView = rolloutsView(section, params);
  else if (view === "nodes") stopView = nodesView(section, params);
  else if (view === "compat") stopView = compatView(section, params);
  else if (view === "audit") stopView = auditView(section, params);
  else replace(section, h("p", {class: "error"}, `no page ${path}`));
}

// ------------------------------------------------------------------------------------------ rollouts
function stepLabel(step) {
  if (!step) return "-";
  return step.nodes !== null && step.nodes !== undefined ? `${step.nodes} node${step.nodes === 1 ? "" : "s"}` : `${step.percent}%`;
}

function verdictText(v) {
  if (!v) return "-";
  const metric = v.evidence && v.evidence.deciding_metric;
  return `${v.decision} (${v.gate})${metric ? ` · ${metric}` : ""}`;
}

function filterSelect(id, label, options, current, onchange) {
  return h("label", {class: "filter"}, `${label} `, h("select", {id, onchange: (ev) => onchange(ev.target.value)},
    h("option", {value: ""}, "all"),
    options.map((o) => h("option", {value: o, selected: o === current}, o))));
}

function rolloutsView(section, params) {
  const stateFilter = params.get("state") || "";
  const table = h("div", {id: "rollouts"});
  replace(section, h("div", {class: "head"}, h("h1", {}, "Rollouts"),
    filterSelect("state-filter", "state", ROLLOUT_STATES, stateFilter,
      (v) => { location.hash = `#/rollouts${query({state: v})}`; })), table);
  const cache = new Map(); // terminal rollouts do not change: their detail is fetched once
  const p = poll(section, POLL_LIST_MS, async () => {
    const list = await api("GET", `/v1/rollouts${query({state_filter: stateFilter, limit: 50})}`);
    const details = await Promise.all(list.map(async (r) => {
      if (cache.has(r.id)) return cache.get(r.id);
      const d = await api("GET", `/v1/rollouts/${r.id}`).catch(() => null);
      if (d && TERMINAL.has(d.state)) cache.set(r.id, d);
      return d;
    }));
    const rows = list.map((listed, i) => {
      const d = details[i];
      const r = d || listed; // the detail was read after the list: show one consistent state
      const steps = d ? d.steps.length : 0;
      const strata = d ? d.strata : [];
      return h("tr", {"data-rollout": r.id},
        h("td", {}, h("a", {href: `#/rollouts/${r.id}`}, `#${r.id}`)),
        h("td", {}, r.bundle),
        h("td", {}, stateBadge(r.state)),
        h("td", {class: "strata"}, strata.length ? h("ul", {class: "plain"}, strata.map((s) =>
          h("li", {}, h("span", {class: "stratum"}, s.stratum), " ", stateBadge(s.state),
            ` step ${Math.min(s.step_index + 1, steps)}/${steps}`))) : "-"),
        h("td", {}, steps ? `${Math.min(r.step_index + 1, steps)}/${steps}` : `${r.step_index + 1}`),
        h("td", {title: clock(r.created_at)}, age(r.created_at)),
        h("td", {class: "gates"}, strata.length ? h("ul", {class: "plain"}, strata.map((s) => h("li",
          {title: (s.latest_verdict && s.latest_verdict.evidence && s.latest_verdict.evidence.reason) || s.reason || ""},
          verdictText(s.latest_verdict)))) : "-"));
    });
    replace(table, rows.length ? h("table", {class: "grid"},
      h("thead", {}, h("tr", {}, ["ID", "Bundle", "State", "Strata", "Step", "Age", "Latest verdict (gate · deciding metric)"].map((c) => h("th", {}, c)))),
      h("tbody", {}, rows)) : h("p", {class: "muted"}, "No rollouts."));
  });
  return () => p.stop();
}

function stepProgress(detail, st) {
  const steps = detail.steps;
  const done = st.state === "promoted";
  return h("ol", {class: "steps", "aria-label": "step progress"}, steps.map((step, i) => {
    const cls = done || i < st.step_index ? "done" : i === st.step_index ? (TERMINAL.has(st.state) ? "stopped" : "current") : "todo";
    return h("li", {class: cls, title: `bake ${step.bake_seconds}s, ${step.min_samples} samples, deadline ${step.deadline_seconds}s`},
      `${i + 1}. ${stepLabel(step)}`);
  }));
}

/** The candidate's phase on a node (staged / verified / serving), when the nodes API reports phases. */
function phaseOf(node, bundleName) {
  return (node.phases && node.phases[bundleName]) || null;
}

function nodesByPhase(st, nodes, detail) {
  const parts = [];
  for (const [k, v] of Object.entries(st.nodes || {})) parts.push(h("span", {class: "count", "data-count": k}, `${k} ${v}`));
  if (nodes) {
    const [name, version] = detail.bundle.split("@");
    const here = nodes.filter((n) => n.stratum === st.stratum);
    const phases = {};
    let withPhase = false;
    for (const n of here) {
      const ph = phaseOf(n, name);
      if (ph) withPhase = true;
      const running = (n.active || {})[name];
      const key = ph || (running ? `running ${running}${running === version ? " (candidate)" : ""}` : `no ${name}`);
      phases[key] = (phases[key] || 0) + 1;
    }
    const label = withPhase ? "phase" : "by active version";
    parts.push(h("span", {class: "phases"}, `${label}: `, Object.entries(phases).map(([k, v], i) =>
      h("span", {class: "count", "data-phase": k}, `${i ? ", " : ""}${k} ${v}`))));
  }
  return h("div", {class: "nodes-line"}, "nodes: ", parts.map((p, i) => [i ? " · " : "", p]));
}

/** The margin as a line in the metric's own unit: a ratio metric (memory: candidate/stable peak) carries its
 * margin as the allowed excess (0.1 = +10%), so its line is at 1 + margin; log ratios compare directly. */
function threshold(margin, unit) {
  if (!isNum(margin)) return null;
  return unit === "ratio" ? 1 + margin : margin;
}

function fmtMargin(margin, unit) {
  if (!isNum(margin)) return "-";
  return unit === "ratio" ? `+${(margin * 100).toFixed(1)}% (${fmtUnit(1 + margin, unit)})` : fmtUnit(margin, unit);
}

/** What happened to each stratum of an ended rollout: "promoted on A · rolled back on B" ("" while live). */
function outcomeText(detail) {
  if (!TERMINAL.has(detail.state)) return "";
  const by = {};
  for (const s of detail.strata) (by[s.state] = by[s.state] || []).push(s.stratum);
  return Object.keys(by).sort().map((st) => `${st.replace("_", " ")} on ${by[st].sort().join(", ")}`).join(" · ");
}

/** A numeric or mismatch rollback's failing check (controller/numeric_detail.py): op, dtype, shape, check,
 * error against its tolerance, and the nodes. */
function failureBlock(f) {
  if (!f) return "";
  const c = f.check || {};
  const shape = Object.entries(c.shape || {}).map(([k, v]) => `${k}=${v}`).join(" ");
  const num = (x) => (isNum(x) && x !== 0 && Math.abs(x) < 1e-3 ? x.toExponential() : String(x));
  const tol = f.tolerance ? `atol ${num(f.tolerance.atol)} + rtol ${num(f.tolerance.rtol)}·|ref|` : "its tolerance";
  const err = c.failed === "vs_stable"
    ? `max |candidate−stable| ${c.vs_stable_max_abs}` : `max_abs_err ${c.max_abs_err}`;
  const reports = Object.entries(f.reports || {}).map(([o, n]) => `${n} ${o}`).join(", ");
  return h("div", {class: "failure", "data-failure": c.op || ""},
    h("strong", {}, "failed check: "), h("code", {}, [c.op, c.dtype, shape].filter(Boolean).join(" ")),
    c.check ? ` (${c.check}${c.case ? "/" + c.case : ""})` : "", `: ${err} > ${tol}`, h("br"),
    `${reports} report(s) from ${f.node_count} node(s): ${(f.nodes || []).join(", ")}`);
}

function metricPoints(ex, metric, unit) {
  return (ex.history || []).map((e) => {
    const m = (e.metrics || {})[metric] || {};
    // latency metrics (issue 25) carry the one bound that decides against the margin ("bound", "bound_side");
    // their lower/upper are not plotted as a band (a side that refuted nothing has no bound)
    const oneSided = m.bound_side !== undefined && m.bound_side !== null;
    return {t: Date.parse(e.at), value: m.value ?? null, lower: oneSided ? null : m.lower ?? null,
      upper: oneSided ? null : m.upper ?? null, bound: m.bound ?? null, boundSide: m.bound_side ?? null,
      margin: threshold(m.margin ?? null, unit), n: m.n ?? null, decision: e.decision, gate: e.gate,
      step: e.step_index};
  });
}

function stratumCard(detail, st, ex, nodes) {
  const metrics = ex ? ex.metrics || [] : [];
  const plotted = new Set(metrics.map((m) => m.metric));
  for (const e of (ex && ex.history) || []) for (const k of Object.keys(e.metrics || {})) plotted.add(k);
  const byName = Object.fromEntries(metrics.map((m) => [m.metric, m]));
  const plots = [...plotted].filter((name) => {
    const kind = byName[name] ? byName[name].kind : "latency_cell";
    return PLOTTED_KINDS.has(kind) && metricPoints(ex, name, (byName[name] || {}).unit).some((p) => isNum(p.value) || isNum(p.lower) || isNum(p.upper) || isNum(p.bound));
  });
  const steps = detail.steps.length;
  return h("article", {class: "stratum-card", "data-stratum": st.stratum},
    h("header", {}, h("h2", {}, st.stratum), stateBadge(st.state),
      h("span", {class: "muted step-of", "data-step": st.step_index}, ` step ${Math.min(st.step_index + 1, steps)} of ${steps}`),
      h("span", {class: "muted"}, ` · step started ${age(st.step_started_at)} ago · baseline ${st.baseline || "none"}`)),
    stepProgress(detail, st),
    nodesByPhase(st, nodes, detail),
    ex ? h("p", {class: "decision"}, h("strong", {}, `${ex.decision} (${ex.gate})`),
      ex.deciding_metric ? h("span", {}, " deciding metric ", h("code", {}, ex.deciding_metric)) : "",
      ex.at ? h("span", {class: "muted"}, ` at ${clock(ex.at)}`) : "",
      h("br"), h("span", {class: "reason"}, ex.reason || st.reason || "")) : h("p", {class: "muted"}, st.reason || ""),
    ex && ex.failure ? failureBlock(ex.failure) : "",
    // a stratum stopped by an operator (or paused) says why: that is not a verdict of the judge
    st.reason && ex && st.reason !== ex.reason && st.reason !== `judge: ${ex.reason}` && st.state !== "progressing"
      ? h("p", {class: "stratum-reason"}, h("strong", {}, `${st.state}: `), st.reason) : "",
    metricsSection(st.stratum, metrics),
    plotGroups(st.stratum, plots, byName, ex));
}

// Which folded sections (<details>) are open, by "stratum kind": kept across the live re-renders.
const openFolds = new Set();

function fold(key, summary, content) {
  return h("details", {class: "fold", "data-fold": key, open: openFolds.has(key),
    ontoggle: (ev) => (ev.target.open ? openFolds.add(key) : openFolds.delete(key))},
  h("summary", {}, summary), content);
}

function plotFigure(name, m, ex) {
  return h("figure", {class: "plot"}, boundsPlot({metric: name, kind: m.kind || "", unit: m.unit || "log_ratio",
    points: metricPoints(ex, name, m.unit), deciding: Boolean(m.deciding)}),
  h("figcaption", {}, `${name}${m.kind ? ` (${m.kind})` : ""}: estimate and ` +
    (m.bound_side ? "the deciding one-sided bound (upper: must fall below the margin to pass; lower: above it to " +
      "roll back)" : "confidence bounds") + " at each verdict; dashed red: the margin; vertical lines: decisions and " +
    "step changes"));
}

const SEVERITY = {regress: 0, fail: 0, warn: 1, hold: 2, pass: 3};
const ALWAYS_SHOWN = new Set(["latency_aggregate", "e2e", "numeric", "hard"]);

/** A metric shown up front: it decided, it is the aggregate/e2e/numeric/hard row, or it is not passing. */
function upFront(m) {
  return m.deciding || ALWAYS_SHOWN.has(m.kind) || (SEVERITY[m.decision] ?? 2) < 2;
}

/** The plots of a stratum: the up-front metrics open; the others (per-cell latency, memory: many) folded by kind. */
function plotGroups(stratum, plots, byName, ex) {
  const meta = (n) => byName[n] || {kind: "latency_cell"};
  const main = plots.filter((n) => upFront(meta(n)));
  const out = [h("div", {class: "plots"}, main.map((n) => plotFigure(n, meta(n), ex)))];
  const rest = {};
  for (const n of plots) if (!upFront(meta(n))) (rest[meta(n).kind] ||= []).push(n);
  for (const [kind, names] of Object.entries(rest)) {
    out.push(fold(`${stratum} plots ${kind}`, `${kind === "latency_cell" ? "per-cell latency" : kind}: ` +
      `${names.length} more plot${names.length === 1 ? "" : "s"}`,
    h("div", {class: "plots"}, names.map((n) => plotFigure(n, meta(n), ex)))));
  }
  return out;
}

function fmtSeconds(x) {
  if (!isNum(x)) return "-";
  for (const [u, k] of [["s", 1], ["ms", 1e-3], ["µs", 1e-6]]) if (x >= k) return `${(x / k).toPrecision(3)} ${u}`;
  return `${(x * 1e9).toPrecision(3)} ns`;
}

/** One arm of a latency metric in the latest report: mean and p99 (n calls). */
function fmtArm(m, arm) {
  const a = (m.arms || {})[arm];
  const dropped = (m.arms || {}).contended_windows || 0;
  return a ? `mean ${fmtSeconds(a.mean_s)} · p99 ${fmtSeconds(a.p99_s)} (n ${a.n}` +
    `${dropped ? `; ${dropped} contended window${dropped === 1 ? "" : "s"} dropped` : ""})` : "-";
}

/** The bound that decides against the margin (latency), or what a resource metric compares against. */
function fmtBound(m) {
  if (m.kind === "launches") return isNum(m.upper) ? `${m.upper} (stable)` : "-";
  if (m.kind === "memory") return isNum(m.upper) ? `max ${fmtUnit(m.upper, m.unit)}` : "-";
  if (!m.bound_side) return "-";
  return isNum(m.bound) ? `${m.bound_side} ${fmtUnit(m.bound, m.unit)}` : `${m.bound_side}: none yet`;
}

function metricsTable(rows) {
  return h("table", {class: "grid metrics"},
    h("thead", {}, h("tr", {}, ["metric", "kind", "estimate", "stable", "candidate", "deciding bound", "margin", "n",
      "decision"].map((c) => h("th", {}, c)))),
    h("tbody", {}, rows.map((m) => h("tr", {class: m.deciding ? "deciding" : "", "data-metric": m.metric},
      h("td", {}, m.deciding ? "★ " : "", m.metric), h("td", {}, m.kind),
      h("td", {}, fmtUnit(m.value, m.unit)), h("td", {}, fmtArm(m, "stable")), h("td", {}, fmtArm(m, "candidate")),
      h("td", {}, fmtBound(m)), h("td", {}, fmtMargin(m.margin, m.unit)), h("td", {}, String(m.n ?? "-")),
      h("td", {}, h("span", {class: `badge d-${String(m.decision).replace(/[^a-z]/g, "")}`}, m.decision))))));
}

/** Every judged metric: the deciding one first, then by decision (regress, warn, hold, pass); passing per-cell
 * rows (memory, launches, latency cells) folded under the table. */
function metricsSection(stratum, metrics) {
  if (!metrics.length) return h("p", {class: "muted"}, "No judged metrics yet (the judge has not recorded evidence for this step).");
  const order = metrics.map((m, i) => [m, i]).sort(([a, i], [b, j]) =>
    (b.deciding - a.deciding) || ((SEVERITY[a.decision] ?? 2) - (SEVERITY[b.decision] ?? 2)) || (i - j)).map(([m]) => m);
  const shown = order.filter(upFront);
  const folded = order.filter((m) => !upFront(m));
  return [metricsTable(shown), folded.length ? fold(`${stratum} table`,
    `${folded.length} more metric${folded.length === 1 ? "" : "s"} (passing or holding per cell)`, metricsTable(folded)) : ""];
}

function operatorPanel(id, getShown, refresh) {
  const reason = h("textarea", {id: "reason", maxlength: 4000, rows: 2,
    placeholder: "Why (recorded in the changelog; required for a rollback)"});
  const full = h("input", {type: "checkbox", id: "promote-full"});
  const result = h("p", {id: "op-result", role: "status", class: "muted"});
  const strataBox = h("span", {id: "rollback-strata"});
  const buttons = {
    promote: h("button", {type: "button", id: "btn-promote"}, "Promote"),
    pause: h("button", {type: "button", id: "btn-pause"}, "Pause"),
    resume: h("button", {type: "button", id: "btn-resume"}, "Resume"),
    rollback: h("button", {type: "button", id: "btn-rollback", class: "danger"}, "Roll back"),
  };
  let busy = false;

  async function act(action, body, confirmText) {
    if (confirmText && !window.confirm(confirmText)) return;
    busy = true;
    sync(getShown());
    try {
      const out = await api("POST", `/v1/rollouts/${id}/${action}`, body);
      replace(result, `${action}: rollout #${out.id} is ${out.state} at step ${out.step_index + 1}`);
      result.className = "ok";
      reason.value = "";
    } catch (err) {
      if (handleAuth(err)) return;
      replace(result, `${action} refused: ${err.status ? err.status + " " : ""}${err.message}`);
      result.className = "error";
    } finally {
      busy = false;
      await refresh();
    }
  }

  buttons.promote.addEventListener("click", async () => {
    const shown = getShown();
    const body = {full: full.checked, reason: reason.value.trim() || null};
    const ask = full.checked
      ? `Promote rollout #${id} fully (the candidate becomes stable in every live stratum now)?`
      : `Promote rollout #${id} from step ${shown.step_index + 1} to the next step?`;
    if (shown.promote_from_step !== undefined && shown.promote_from_step !== null) {
      // the API's guard (as `kernelctl promote`): the promote names the step it moves from, the one this page
      // shows; a rollout no longer there answers 409 and nothing changes, so a stale page or a double click
      // counts at most once
      body.from_step = shown.promote_from_step;
      await act("promote", body, ask);
      return;
    }
    // a controller without that guard: re-read the rollout and refuse here if it moved since it was shown
    let now;
    try {
      now = await api("GET", `/v1/rollouts/${id}`);
    } catch (err) {
      replace(result, `promote: ${err.message}`);
      result.className = "error";
      return;
    }
    const moved = now.state !== shown.state || now.step_index !== shown.step_index ||
      now.strata.some((s) => shown.strata[s.stratum] !== `${s.state}:${s.step_index}`);
    if (moved) {
      replace(result, `promote refused: the rollout moved since this page showed it (step ${shown.step_index + 1}, ` +
        `${shown.state} -> step ${now.step_index + 1}, ${now.state}); nothing was changed. Look again, then retry.`);
      result.className = "error";
      await refresh();
      return;
    }
    await act("promote", body, ask);
  });
  buttons.pause.addEventListener("click", () => act("pause", {reason: reason.value.trim() || null}));
  buttons.resume.addEventListener("click", () => act("resume", {reason: reason.value.trim() || null}));
  buttons.rollback.addEventListener("click", () => {
    const why = reason.value.trim();
    if (!why) {
      replace(result, "a rollback needs a reason (it is recorded in the changelog)");
      result.className = "error";
      reason.focus();
      return;
    }
    const picked = [...strataBox.querySelectorAll("input:checked")].map((i) => i.value);
    act("rollback", {reason: why, strata: picked.length ? picked : null},
      `Roll back rollout #${id} ${picked.length ? `in ${picked.join(", ")}` : "in every live stratum"}?`);
  });

  function sync(shown) {
    const st = shown.state;
    buttons.promote.disabled = busy || TERMINAL.has(st);
    buttons.pause.disabled = busy || st !== "progressing";
    buttons.resume.disabled = busy || st !== "paused";
    buttons.rollback.disabled = busy || TERMINAL.has(st);
    replace(buttons.promote, full.checked ? "Promote fully" : `Promote from step ${shown.step_index + 1}`);
    const live = Object.entries(shown.strata).filter(([, v]) => !/^(promoted|rolled_back):/.test(v)).map(([k]) => k);
    const have = [...strataBox.querySelectorAll("input")].map((i) => i.value).join("\n");
    if (have !== live.join("\n")) {
      replace(strataBox, live.length > 1 ? ["only: ", live.map((k) => h("label", {class: "chk"},
        h("input", {type: "checkbox", value: k, name: "rollback-stratum"}), k))] : "");
    }
  }
  full.addEventListener("change", () => sync(getShown()));

  const panel = h("section", {class: "ops", id: "ops"}, h("h3", {}, "Operator actions"),
    h("label", {for: "reason", class: "block"}, "Reason"), reason,
    h("div", {class: "row"}, buttons.promote, h("label", {class: "chk"}, full, "full (every stratum to 100% now)"),
      buttons.pause, buttons.resume),
    h("div", {class: "row"}, buttons.rollback, strataBox),
    result);
  return {panel, sync};
}

function rolloutView(section, id) {
  const head = h("div", {class: "head"});
  const meta = h("p", {class: "meta"});
  const strata = h("div", {id: "strata"});
  const verdicts = h("div", {id: "verdicts"});
  let shown = {state: null, step_index: 0, strata: {}};
  let nodes = null, nodesAt = 0, ops = null;
  const parts = [head, meta];
  if (isOperator()) {
    ops = operatorPanel(id, () => shown, () => p.now());
    parts.push(ops.panel);
  } else {
    parts.push(h("p", {class: "muted", id: "read-only"}, `Read-only: signed in as ${me.role}; `,
      "promote, pause, resume and roll back need an operator token."));
  }
  const auditLink = h("a", {href: `#/audit${query({action: "rollout.*", limit: 200})}`, id: "audit-link"}, "audit trail");
  const trail = h("p", {class: "muted"}, "Operator actions and every event of this rollout's bundle: ", auditLink);
  parts.push(strata, h("h3", {}, "Recent verdicts"), verdicts, trail);
  replace(section, ...parts);

  // a finished rollout changes no more (only its nodes go back to stable): look less often
  const p = poll(section, () => (TERMINAL.has(shown.state) ? POLL_LIST_MS : POLL_ROLLOUT_MS), async () => {
    const [detail, explain] = await Promise.all([api("GET", `/v1/rollouts/${id}`),
      api("GET", `/v1/rollouts/${id}/explain`)]);
    if (!nodes || Date.now() - nodesAt > NODES_EVERY_MS || TERMINAL.has(detail.state)) {
      nodes = await api("GET", "/v1/nodes").catch(() => nodes);
      nodesAt = Date.now();
    }
    shown = {state: detail.state, step_index: detail.step_index, promote_from_step: detail.promote_from_step,
      strata: Object.fromEntries(detail.strata.map((s) => [s.stratum, `${s.state}:${s.step_index}`]))};
    replace(head, h("h1", {}, `Rollout #${detail.id} `, h("span", {class: "bundle"}, detail.bundle)),
      h("span", {id: "rollout-state", "data-state": detail.state}, stateBadge(detail.state)),
      h("span", {class: "muted", id: "rollout-step", "data-step": detail.step_index},
        ` step ${Math.min(detail.step_index + 1, detail.steps.length)} of ${detail.steps.length}`),
      outcomeText(detail) ? h("p", {class: "outcome", id: "rollout-outcome"}, outcomeText(detail)) : "");
    replace(meta, `started by ${detail.created_by} ${age(detail.created_at)} ago (${clock(detail.created_at)})`,
      detail.forced ? " · forced" : "", detail.reason ? ` · ${detail.reason}` : "",
      ` · plan: ${detail.steps.map(stepLabel).join(" → ")}`);
    const exBy = Object.fromEntries((explain.strata || []).map((s) => [s.stratum, s]));
    replace(strata, detail.strata.map((st) => stratumCard(detail, st, exBy[st.stratum], nodes)));
    const vs = detail.verdicts.slice(0, 15);
    replace(verdicts, vs.length ? h("table", {class: "grid"},
      h("thead", {}, h("tr", {}, ["at", "stratum", "step", "decision", "gate", "samples", "reason"].map((c) => h("th", {}, c)))),
      h("tbody", {}, vs.map((v) => h("tr", {}, h("td", {}, clock(v.at)), h("td", {}, v.stratum), h("td", {}, String(v.step_index + 1)),
        h("td", {}, v.decision), h("td", {}, v.gate), h("td", {}, String(v.samples)),
        h("td", {class: "reason"}, (v.evidence && v.evidence.reason) || ""))))) : h("p", {class: "muted"}, "No verdicts yet."));
    auditLink.setAttribute("href", `#/audit${query({bundle: detail.bundle, action: "rollout.*", limit: 200})}`);
    if (ops) ops.sync(shown);
  });
  return () => p.stop();
}

// ------------------------------------------------------------------------------------------ nodes
function versions(map) {
  const entries = Object.entries(map || {});
  return entries.length ? entries.map(([b, v]) => `${b}@${v}`).join(", ") : "-";
}

function nodesView(section, params) {
  const stateFilter = params.get("state") || "";
  const table = h("div", {id: "nodes"});
  replace(section, h("div", {class: "head"}, h("h1", {}, "Nodes"),
    filterSelect("node-state-filter", "state", ["active", "stale"], stateFilter,
      (v) => { location.hash = `#/nodes${query({state: v})}`; })), table);
  const p = poll(section, POLL_NODES_MS, async () => {
    const nodes = await api("GET", `/v1/nodes${query({state: stateFilter})}`);
    const hasPhase = nodes.some((n) => n.phases !== undefined); // trial before serve: the canary's phase
    const cols = ["Node", "State", "Stratum", "GPU", "Arch", "Driver", "Triton / torch", "Last heartbeat",
      "Active", "Desired", ...(hasPhase ? ["Canary phase"] : [])];
    replace(table, nodes.length ? h("table", {class: "grid"},
      h("thead", {}, h("tr", {}, cols.map((c) => h("th", {}, c)))),
      h("tbody", {}, nodes.map((n) => h("tr", {"data-node": n.name, class: n.state === "stale" ? "stale" : ""},
        h("td", {}, n.name), h("td", {}, stateBadge(n.state)), h("td", {}, n.stratum), h("td", {class: "gpu"}, n.gpu_name),
        h("td", {}, n.arch), h("td", {}, n.driver_version), h("td", {}, `${n.triton_version} / ${n.torch_version}`),
        h("td", {title: clock(n.last_heartbeat_at)}, `${age(n.last_heartbeat_at)} ago`),
        h("td", {class: "versions"}, versions(n.active)), h("td", {class: "versions"}, versions(n.desired)),
        hasPhase ? h("td", {class: "phase"}, Object.entries(n.phases || {}).map(([b, ph]) => `${b}: ${ph}`).join(", ") || "-") : null)))) :
      h("p", {class: "muted"}, "No nodes."));
  });
  return () => p.stop();
}

// ------------------------------------------------------------------------------------------ compat
function compatView(section, params) {
  const bundle = params.get("bundle") || "";
  const input = h("input", {type: "text", id: "compat-bundle", value: bundle, placeholder: "bundle name"});
  const table = h("div", {id: "compat"});
  replace(section, h("div", {class: "head"}, h("h1", {}, "Compatibility matrix"),
    h("form", {class: "filter", onsubmit: (ev) => { ev.preventDefault(); location.hash = `#/compat${query({bundle: input.value.trim()})}`; }},
      input, h("button", {type: "submit"}, "Filter"))), table);
  const p = poll(section, POLL_LIST_MS, async () => {
    const rows = await api("GET", `/v1/compat${query({bundle})}`);
    const strata = [...new Set(rows.map((r) => r.stratum))].sort();
    const refs = [...new Set(rows.map((r) => r.bundle))];
    const cell = Object.fromEntries(rows.map((r) => [`${r.bundle}\n${r.stratum}`, r]));
    replace(table, rows.length ? h("table", {class: "grid matrix"},
      h("thead", {}, h("tr", {}, h("th", {}, "bundle \\ stratum"), strata.map((s) => h("th", {}, s)))),
      h("tbody", {}, refs.map((ref) => h("tr", {}, h("th", {}, ref), strata.map((s) => {
        const c = cell[`${ref}\n${s}`];
        if (!c) return h("td", {}, "-");
        return h("td", {"data-cell": `${ref} ${s}`, title: c.reason || ""}, stateBadge(c.state),
          c.step !== null && c.step !== undefined ? ` step ${c.step}` : "",
          c.rollout_id ? [" ", h("a", {href: `#/rollouts/${c.rollout_id}`}, `#${c.rollout_id}`)] : "",
          c.phases ? h("div", {class: "small"}, Object.entries(c.phases).map(([ph, k]) => `${ph} ${k}`).join(" · ")) : "",
          h("div", {class: "muted small"}, `${c.eligible_nodes}/${c.nodes} nodes eligible`));
      }))))) : h("p", {class: "muted"}, "No bundles or no nodes yet."));
  });
  return () => p.stop();
}

// ------------------------------------------------------------------------------------------ audit
const AUDIT_FILTERS = [
  ["bundle", "NAME or NAME@VERSION"], ["node", "node name"], ["actor", "operator:alice, judge, ..."],
  ["action", "rollout.* or rollout.rolled_back"], ["since", "ISO time or age (15m, 2h, 3d)"],
  ["until", "ISO time or age"], ["limit", "100"],
];

function auditView(section, params) {
  const inputs = Object.fromEntries(AUDIT_FILTERS.map(([k, ph]) =>
    [k, h("input", {type: "text", id: `audit-${k}`, name: k, placeholder: ph, value: params.get(k) || ""})]));
  const table = h("div", {id: "audit"});
  const form = h("form", {class: "audit-filters", id: "audit-form", onsubmit: (ev) => {
    ev.preventDefault();
    const q = Object.fromEntries(Object.entries(inputs).map(([k, el]) => [k, el.value.trim()]));
    const next = `#/audit${query(q)}`;
    if (location.hash === next) route(); else location.hash = next;
  }}, AUDIT_FILTERS.map(([k]) => h("label", {}, k, inputs[k])), h("button", {type: "submit", id: "audit-submit"}, "Query"));
  replace(section, h("h1", {}, "Audit trail"),
    h("p", {class: "muted"}, "The changelog through GET /v1/audit, with the filters of `kernelctl audit` (newest first)."),
    form, table);
  const filters = Object.fromEntries(AUDIT_FILTERS.map(([k]) => [k, params.get(k) || ""]));
  const p = poll(section, POLL_LIST_MS, async () => {
    const events = await api("GET", `/v1/audit${query(filters)}`);
    replace(table, events.length ? h("table", {class: "grid audit"},
      h("thead", {}, h("tr", {}, ["at", "actor", "action", "subject", "bundle", "node", "rollout", "reason", "payload"].map((c) => h("th", {}, c)))),
      h("tbody", {}, events.map((e) => h("tr", {"data-event": e.id, "data-action": e.action},
        h("td", {}, clock(e.at)), h("td", {}, e.actor), h("td", {}, e.action), h("td", {}, e.subject || ""),
        h("td", {}, e.bundle || ""), h("td", {}, e.node || ""),
        h("td", {}, e.rollout_id ? h("a", {href: `#/rollouts/${e.rollout_id}`}, `#${e.rollout_id}`) : ""),
        h("td", {class: "reason"}, e.reason || ""),
        h("td", {}, e.payload && Object.keys(e.payload).length ? h("details", {}, h("summary", {}, "payload"),
          h("pre", {}, JSON.stringify(e.payload, null, 2))) : ""))))) :
      h("p", {class: "muted"}, "No events match."));
  });
  return () => p.stop();
}

// ------------------------------------------------------------------------------------------ start
document.getElementById("logout").addEventListener("click", () => {
  setToken(null);
  me = null;
  showLogin("signed out");
});
window.addEventListener("hashchange", route);
route();
