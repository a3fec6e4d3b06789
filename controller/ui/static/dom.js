// DOM building, formatting and the API client of the kernelctl UI.
//
// Every string that reaches the page goes through h() as a child or through an attribute setter, so it is
// text (textContent / setAttribute), never markup: nothing here uses innerHTML, and a node that reports
// "<img onerror=...>" as its GPU name shows exactly that text.

const TOKEN_KEY = "kernelctl.token";
const SVG_NS = "http://www.w3.org/2000/svg";

/** h("a", {href: "#/x", class: "c"}, "text", child, [more]) -> an element; strings become text nodes. */
export function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  setAttrs(el, attrs);
  append(el, children);
  return el;
}

/** The SVG counterpart of h(). */
export function s(tag, attrs, ...children) {
  const el = document.createElementNS(SVG_NS, tag);
  setAttrs(el, attrs);
  append(el, children);
  return el;
}

function setAttrs(el, attrs) {
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on") && typeof v === "function") el.addEventListener(k.slice(2), v);
    else if (k === "dataset") Object.assign(el.dataset, v);
    else if (k === "value" && "value" in el) el.value = String(v);
    else if (k === "checked" && "checked" in el) el.checked = Boolean(v);
    else el.setAttribute(k, v === true ? "" : String(v));
  }
}

function append(el, children) {
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
}

/** Replace the children of ``el`` (text or nodes). */
export function replace(el, ...children) {
  el.replaceChildren();
  append(el, children);
  return el;
}

// ------------------------------------------------------------------------------------------ formatting
export function age(iso, now = Date.now()) {
  if (!iso) return "-";
  const t = Date.parse(iso);
  if (Number.isNaN(t)) return String(iso);
  let sec = Math.max(0, Math.round((now - t) / 1000));
  if (sec < 90) return `${sec}s`;
  const min = Math.round(sec / 60);
  if (min < 90) return `${min}m`;
  const hr = Math.round(min / 60);
  if (hr < 48) return `${hr}h`;
  return `${Math.round(hr / 24)}d`;
}

export function clock(iso) {
  if (!iso) return "-";
  const d = new Date(iso);
  return Number.isNaN(d.getTime()) ? String(iso) : d.toISOString().replace("T", " ").slice(0, 19) + "Z";
}

export function isNum(x) {
  return typeof x === "number" && Number.isFinite(x);
}

/** A value in its unit: log ratios as the percent change they mean (exp(x)-1), ratios as x1.02. */
export function fmtUnit(x, unit) {
  if (!isNum(x)) return x === null || x === undefined ? "-" : String(x);
  switch (unit) {
    case "log_ratio": {
      const p = Math.expm1(x) * 100;
      return `${p >= 0 ? "+" : ""}${p.toFixed(Math.abs(p) < 10 ? 2 : 1)}%`;
    }
    case "ratio":
      return `×${x.toFixed(3)}`;
    case "count":
      return Number.isInteger(x) ? String(x) : x.toFixed(2);
    case "error":
      return x === 0 ? "0" : x.toExponential(2);
    default:
      return Math.abs(x) >= 1000 || (Math.abs(x) < 0.01 && x !== 0) ? x.toExponential(2) : x.toFixed(3);
  }
}

export function stateBadge(state) {
  return h("span", {class: `badge st-${String(state).replace(/[^a-z_]/g, "")}`}, String(state));
}

// ------------------------------------------------------------------------------------------ API client
export class ApiError extends Error {
  constructor(status, detail) {
    super(detail);
    this.status = status;
  }
}

export function token() {
  return sessionStorage.getItem(TOKEN_KEY);
}

export function setToken(value) {
  if (value) sessionStorage.setItem(TOKEN_KEY, value);
  else sessionStorage.removeItem(TOKEN_KEY);
}

function detailText(body, status) {
  const d = body && body.detail;
  if (typeof d === "string") return d;
  if (Array.isArray(d)) {
    return d.map((e) => {
      const loc = Array.isArray(e.loc) ? e.loc.filter((p) => p !== "body").join(".") : "";
      return loc ? `${loc}: ${e.msg}` : String(e.msg);
    }).join("; ");
  }
  return `HTTP ${status}`;
}

/** One API call with the session's bearer token; ApiError(status, the API's one-line detail) on failure. */
export async function api(method, path, body, tok = token()) {
  const headers = {Accept: "application/json"};
  if (tok) headers.Authorization = `Bearer ${tok}`;
  const init = {method, headers, cache: "no-store", credentials: "omit"};
  if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let resp;
  try {
    resp = await fetch(path, init);
  } catch (err) {
    throw new ApiError(0, `controller unreachable: ${err.message}`);
  }
  let data = null;
  const text = await resp.text();
  if (text) {
    try {
      data = JSON.parse(text);
    } catch {
      data = null;
    }
  }
  if (!resp.ok) throw new ApiError(resp.status, detailText(data, resp.status));
  return data;
}

export function query(params) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v !== null && v !== undefined && v !== "") q.set(k, v);
  const str = q.toString();
  return str ? `?${str}` : "";
}
