// Duet ops dashboard: reads /admin/stats/stream (SSE, once a second) and the admin API.
// The admin key lives only in this tab (sessionStorage) and is sent as a Bearer header; it never
// goes into a URL, so the stream is read with fetch() rather than EventSource (which cannot set headers).
"use strict";

const KEY_SLOT = "duetAdminKey";
const HISTORY = 120; // points kept per chart: two minutes at one event a second
const $ = (sel) => document.querySelector(sel);
const charts = {};
let streamAbort = null;
let lastRouting = "";

function adminKey() { return sessionStorage.getItem(KEY_SLOT) || ""; }

async function api(method, path, body) {
  const resp = await fetch(path, {
    method,
    headers: { "Authorization": "Bearer " + adminKey(), "Content-Type": "application/json" },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const data = await resp.json().catch(() => ({}));
  if (!resp.ok) {
    const msg = (data.error && data.error.message) || resp.statusText;
    throw Object.assign(new Error(msg), { status: resp.status });
  }
  return data;
}

// ---- charts (Chart.js) ----
function lineChart(id, yTitle) {
  return new Chart(document.getElementById(id), {
    type: "line",
    data: { labels: [], datasets: [] },
    options: {
      animation: false, responsive: true, maintainAspectRatio: false,
      elements: { point: { radius: 0 }, line: { borderWidth: 2 } },
      scales: { x: { ticks: { maxTicksLimit: 6 } }, y: { beginAtZero: true, title: { display: true, text: yTitle } } },
      plugins: { legend: { position: "bottom", labels: { boxWidth: 10 } } },
    },
  });
}

function barChart(id, horizontal) {
  return new Chart(document.getElementById(id), {
    type: "bar",
    data: { labels: [], datasets: [] },
    options: {
      animation: false, responsive: true, maintainAspectRatio: false, indexAxis: horizontal ? "y" : "x",
      scales: { y: { beginAtZero: true }, x: { beginAtZero: true } },
      plugins: { legend: { position: "bottom", labels: { boxWidth: 10 } } },
    },
  });
}

const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777"];

function pushSeries(chart, label, values) {
  // values: {seriesName: number}; series missing this tick get 0 so lines stay aligned.
  const d = chart.data;
  d.labels.push(label);
  for (const name of Object.keys(values)) {
    if (!d.datasets.find((s) => s.label === name)) {
      const color = PALETTE[d.datasets.length % PALETTE.length];
      d.datasets.push({ label: name, data: new Array(d.labels.length - 1).fill(0), borderColor: color, backgroundColor: color });
    }
  }
  for (const s of d.datasets) s.data.push(values[s.label] ?? 0);
  if (d.labels.length > HISTORY) { d.labels.shift(); for (const s of d.datasets) s.data.shift(); }
  chart.update("none");
}

function initCharts() {
  charts.rps = lineChart("chart-rps", "req/s");
  charts.errors = lineChart("chart-errors", "errors/s");
  charts.latency = lineChart("chart-latency", "ms");
  charts.tokens = lineChart("chart-tokens", "tokens/s");
  charts.reasons = barChart("chart-reasons", true);
  charts.workers = barChart("chart-workers", false);
  charts.promptLen = barChart("chart-prompt-len", false);
  charts.outputLen = barChart("chart-output-len", false);
  charts.turns = barChart("chart-turns", false);
  charts.reuse = barChart("chart-reuse", true);
}

// ---- the workload profile (GET /admin/profile): histograms of the last minute, per model or all ("*") ----
function setBars(chart, labels, values, label, color) {
  chart.data.labels = labels;
  chart.data.datasets = [{ label, data: values, backgroundColor: color }];
  chart.update("none");
}

function bucketLabels(h) {
  return h.le.map((b, i) => {
    if (b === null) return `> ${h.le[i - 1]}`;
    if (i === 0) return `<= ${b}`;
    return h.le[i - 1] + 1 === b ? String(b) : `${h.le[i - 1] + 1}-${b}`;
  });
}

async function refreshProfile() {
  const snap = await api("GET", "/admin/profile?window_s=60");
  const select = $("#profile-model");
  const names = Object.keys(snap.models);
  if (select.options.length !== names.length) {
    const keep = select.value || "*";
    select.innerHTML = names.map((n) => `<option value="${esc(n)}">${n === "*" ? "all models" : esc(n)}</option>`).join("");
    select.value = names.includes(keep) ? keep : "*";
  }
  const p = snap.models[select.value] || snap.models["*"];
  document.body.dataset.profiled = String(p.requests);
  document.body.dataset.concurrencyPeak = String(p.concurrency_peak);
  if (!p.requests) { $("#profile-summary").textContent = "no finished requests yet"; return; }
  const r = p.prefix_repetition;
  $("#profile-summary").textContent = `${p.requests} requests, ${p.arrival_rps.toFixed(2)} req/s, ` +
    `${fmt(p.concurrency_mean)} in flight on average, ${p.concurrency_peak} at the peak; prompt p50 ${p.prompt_tokens.p50} tokens, ` +
    `output p50 ${p.output_tokens.p50}; ${(100 * (r.any || 0)).toFixed(0)}% of prompt blocks seen before ` +
    `(${(100 * (r.cross_session || 0)).toFixed(0)}% from other sessions, ${(100 * (r.within_session || 0)).toFixed(0)}% ` +
    `from the same session); ${p.session_turns.sessions} sessions`;
  setBars(charts.promptLen, bucketLabels(p.prompt_tokens.histogram), p.prompt_tokens.histogram.counts, "requests", PALETTE[0]);
  setBars(charts.outputLen, bucketLabels(p.output_tokens.histogram), p.output_tokens.histogram.counts, "requests", PALETTE[2]);
  setBars(charts.turns, bucketLabels(p.session_turns.histogram), p.session_turns.histogram.counts, "sessions", PALETTE[3]);
  const bars = { "blocks: other sessions'": r.cross_session, "blocks: same session's": r.within_session };
  for (const [c, share] of Object.entries(p.classes)) bars[`class ${c}`] = share;
  for (const [e, v] of Object.entries(p.engines)) if (v.hit_rate !== null) bars[`${e} hit rate`] = v.hit_rate;
  setBars(charts.reuse, Object.keys(bars), Object.values(bars).map((v) => 100 * (v || 0)), "%", PALETTE[4]);
}

function groupValues(groups, field, prefix) {
  const out = {};
  for (const [name, g] of Object.entries(groups || {})) out[prefix + name] = g[field] || 0;
  return out;
}

function onEvent(ev) {
  const s = ev.stats;
  const label = new Date(ev.t * 1000).toLocaleTimeString();
  pushSeries(charts.rps, label, { ...groupValues(s.by_engine, "rps", "engine "), ...groupValues(s.by_variant, "rps", "variant ") });
  const errs = {};
  for (const [k, g] of Object.entries(s.by_engine || {})) errs["engine " + k] = g.errors / s.window_s;
  for (const [k, g] of Object.entries(s.by_variant || {})) errs["variant " + k] = g.errors / s.window_s;
  errs["all"] = s.errors / s.window_s;
  pushSeries(charts.errors, label, errs);
  pushSeries(charts.latency, label, {
    "TTFT p50": s.ttft_p50_ms || 0, "TTFT p99": s.ttft_p99_ms || 0,
    "ITL p50": s.itl_p50_ms || 0, "ITL p99": s.itl_p99_ms || 0,
  });
  pushSeries(charts.tokens, label, { "output tokens/s": s.output_tokens_per_s || 0 });

  const reasons = s.by_reason || {};
  charts.reasons.data.labels = Object.keys(reasons);
  charts.reasons.data.datasets = [{ label: "requests", data: Object.values(reasons), backgroundColor: PALETTE[0] }];
  charts.reasons.update("none");

  const ws = ev.workers || [];
  charts.workers.data.labels = ws.map((w) => w.worker_id);
  charts.workers.data.datasets = [
    { label: "KV usage %", data: ws.map((w) => 100 * (w.kv_usage || 0)), backgroundColor: PALETTE[0] },
    { label: "prefix hit rate %", data: ws.map((w) => 100 * (w.prefix_hit_rate || 0)), backgroundColor: PALETTE[2] },
  ];
  charts.workers.update("none");

  $("#summary").textContent = `${s.rps.toFixed(1)} req/s · ${s.errors} errors · TTFT p99 ${fmt(s.ttft_p99_ms)} ms · ` +
    `${(s.output_tokens_per_s || 0).toFixed(0)} tok/s (last ${s.window_s} s)`;
  document.body.dataset.requests = String(s.requests);
  renderWorkers(ws);
  renderCanary(ev.routing || {}, ev.rollback || {});
  renderPools(ev.pools);
  renderShadow(ev.shadow || {});
}

// one table per model: each traffic class's figures, primary beside shadow, then the gate verdict
function renderShadow(shadow) {
  const models = Object.entries(shadow).filter(([, r]) => r);
  if (!models.length) {
    $("#shadow").innerHTML = '<p class="muted">no shadow running (<code>duet migrate shadow</code>)</p>';
    return;
  }
  const cols = ["requests", "errors", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms"];
  const cell = (f, c) => c === "requests" || c === "errors" ? esc(f[c]) : fmt(f[c]);
  $("#shadow").innerHTML = models.map(([model, r]) => {
    const pools = r.config.pools.map((p) => esc(p.engine_kind + "@" + p.version)).join(", ");
    const rows = [["all", r.primary, r.shadow], ...Object.entries(r.by_class).map(([c, s]) => [c, s.primary, s.shadow])];
    const v = r.verdict;
    const verdict = v.passed ? '<span class="pill ok">gates passed</span>'
      : v.failures.length ? `<span class="pill bad">gates failed</span> ${v.failures.map(esc).join("; ")}`
      : `<span class="pill warn">measuring</span> ${esc(v.waiting_for)}`;
    const agree = (f) => f.greedy_agreement === null ? "–" : `${(100 * f.greedy_agreement).toFixed(0)}% of ${f.greedy_compared}`;
    const dropped = Object.entries(r.dropped).filter(([, n]) => n).map(([k, n]) => `${n} (${esc(k)})`).join(", ") || "none";
    return `<div class="model" data-model="${esc(model)}"><strong>${esc(model)}</strong> ` +
      `<span class="muted">candidate ${pools}, ${(100 * r.config.share).toFixed(0)}% mirrored, ${r.in_flight} in flight, ` +
      `dropped ${dropped}</span><table class="shadow"><thead><tr><th>class</th>` +
      ["requests", "errors", "TTFT p50 (ms)", "TTFT p99 (ms)", "TPOT p50 (ms)", "TPOT p99 (ms)"].map((h) => `<th>${h}<br>primary / shadow</th>`).join("") +
      "<th>greedy agreement</th></tr></thead><tbody>" +
      rows.map(([c, p, s]) => `<tr data-class="${esc(c)}"><td>${esc(c)}</td>` +
        cols.map((k) => `<td><span class="primary">${cell(p, k)}</span> / <span class="candidate">${cell(s, k)}</span></td>`).join("") +
        `<td>${agree(s)}</td></tr>`).join("") +
      `</tbody></table><div class="verdict">${verdict} ` +
      `<button class="start-canary" data-model="${esc(model)}">Start canary</button> ` +
      `<button class="stop-shadow danger" data-model="${esc(model)}">Stop shadow</button></div></div>`;
  }).join("");
}

// ---- the migrate path (what `duet migrate shadow|canary` does, from the page) ----
function migrateStatus(text, bad) {
  const line = $("#migrate-status");
  line.textContent = text;
  line.className = bad ? "bad" : "muted";
}

async function startShadow(e) {
  e.preventDefault();
  const model = $("#migrate-model").value;
  const [kind, version] = $("#migrate-candidate").value.trim().split("@");
  if (!model || !kind) { migrateStatus("a model and a candidate KIND@VERSION (e.g. paged@v2) are needed", true); return; }
  const pool = { engine_kind: kind, version: version || "*" };
  const body = { pools: [pool], share: Number($("#migrate-share").value) };
  const extra = $("#migrate-extra").value.trim();  // more of PUT .../shadow's body: gates, max_concurrency, ...
  if (extra) {
    try { Object.assign(body, JSON.parse(extra)); } catch (err) { migrateStatus(`not JSON: ${err.message}`, true); return; }
  }
  const path = `/admin/models/${encodeURIComponent(model)}`;
  try {
    const routing = await api("GET", `${path}/routing`);
    const workers = (await api("GET", "/admin/workers")).workers.filter((w) => w.model_id === model);
    const inPool = (p, w) => w.engine_kind === p.engine_kind && (p.version === "*" || p.version === w.version);
    const held = workers.filter((w) => inPool(pool, w));
    if (!held.length) { migrateStatus(`no worker of ${model} is in ${kind}@${pool.version}`, true); return; }
    // the candidate takes no live traffic: its pool gets a variant of weight 0 (and, when the model had no
    // variants, the other pools one at 100), as `duet migrate shadow` writes
    let variants = routing.variants.filter((v) => v.name !== "candidate" || v.weight > 0);
    if (!variants.length) {
      const rest = [...new Set(workers.filter((w) => !held.includes(w)).map((w) => `${w.engine_kind}@${w.version}`))];
      variants = [{ name: "primary", weight: 100, pools: rest.map((r) => ({ engine_kind: r.split("@")[0], version: r.split("@")[1] })) }];
    }
    variants.push({ name: "candidate", weight: 0, pools: [pool] });
    const lines = [`routing: variant candidate (${kind}@${pool.version}) at weight 0: no live traffic`,
      `mirror ${(100 * body.share).toFixed(0)}% of ${model}'s requests there, answers dropped`,
      `more: ${extra || "the defaults (gates, cap, window)"}`];
    if (!(await confirmAction(`Start a shadow of ${model}?`, lines.join("\n")))) return;
    await api("PUT", `${path}/routing`, { ...routing, variants });
    await api("PUT", `${path}/shadow`, body);
    migrateStatus(`shadow started: ${(100 * body.share).toFixed(0)}% of ${model} mirrored to ${kind}@${pool.version}; ` +
      "start the canary once its gates pass");
  } catch (err) { migrateStatus(`refused: ${err.message}`, true); }
}

async function shadowAction(e) {
  const button = e.target.closest("button");
  if (!button) return;
  const model = button.dataset.model;
  const path = `/admin/models/${encodeURIComponent(model)}`;
  try {
    if (button.classList.contains("start-canary")) {
      if (!(await confirmAction(`Start the canary of ${model}?`, "the shadow's candidate takes live traffic, " +
        "ramped by the rollback controller under the shadow's gates"))) return;
      const answer = await api("POST", `${path}/canary/start`, {});
      const ramp = answer.policy.ramp.map((s) => `${s.weight}%`).join(" -> ");
      migrateStatus(`canary started: ${answer.policy.canary} ramps ${ramp} against ${answer.policy.baseline}`);
    } else if (button.classList.contains("stop-shadow")) {
      if (!(await confirmAction(`Stop the shadow of ${model}?`, "no more copies; its figures are dropped"))) return;
      await api("DELETE", `${path}/shadow`);
      migrateStatus(`shadow of ${model} stopped`);
    }
  } catch (err) { migrateStatus(`refused: ${err.message}`, true); }
}

async function refreshModels() {
  const select = $("#migrate-model");
  const models = [...new Set((await api("GET", "/admin/workers")).workers.map((w) => w.model_id).filter(Boolean))].sort();
  if (select.options.length !== models.length) {
    const keep = select.value;
    select.innerHTML = models.map((m) => `<option value="${esc(m)}">${esc(m)}</option>`).join("");
    if (models.includes(keep)) select.value = keep;
  }
}

function renderPools(p) {
  if (!p) return;
  const kinds = ["paged", "prefix"];
  $("#pools tbody").innerHTML = kinds.map((k) => `<tr><td>${k}</td><td>${esc(p.target[k])}</td>` +
    `<td>${esc(p.current[k])}</td><td>${fmt((p.work || {})[k])}</td><td>${fmt((p.balanced_share || {})[k])}</td></tr>`).join("");
  const a = p.accuracy || {};
  $("#accuracy").textContent = a.decisions
    ? `last ${a.decisions} requests: real minus estimated cached tokens mean ${fmt(a.mean_error_tokens)}, ` +
      `mean |error| ${fmt(a.mean_abs_error_tokens)}; stale decisions ${(100 * a.stale_share).toFixed(1)}%`
    : "no finished requests yet";
}

function fmt(v) { return v === null || v === undefined ? "–" : v.toFixed(1); }
function esc(v) { const d = document.createElement("span"); d.textContent = String(v); return d.innerHTML; }

// ---- tables ----
function renderWorkers(ws) {
  const body = $("#workers tbody");
  body.innerHTML = ws.map((w) => {
    const health = w.draining ? '<span class="pill warn">draining</span>'
      : w.healthy ? '<span class="pill ok">healthy</span>' : '<span class="pill bad">down</span>';
    const btn = w.draining ? "" : `<button class="danger drain" data-worker="${esc(w.worker_id)}">drain</button>`;
    return `<tr><td>${esc(w.worker_id)}</td><td>${esc(w.model_id || "")}</td><td>${esc(w.engine_kind)}</td>` +
      `<td>${esc(w.version || "")}</td><td>${health}</td><td>${w.num_running ?? 0}</td><td>${w.num_waiting ?? 0}</td>` +
      `<td>${(100 * (w.kv_usage || 0)).toFixed(1)}%</td><td>${(100 * (w.prefix_hit_rate || 0)).toFixed(1)}%</td><td>${btn}</td></tr>`;
  }).join("");
  for (const b of body.querySelectorAll("button.drain")) {
    b.onclick = async () => {
      const id = b.dataset.worker;
      if (!(await confirmAction(`Drain worker ${id}?`, "New requests stop going to it; running ones finish."))) return;
      try { await api("POST", `/admin/workers/${encodeURIComponent(id)}/drain`); } catch (e) { alert(e.message); }
    };
  }
}

function renderCanary(routing, rollback) {
  const key = JSON.stringify(routing);
  const editing = document.activeElement && document.activeElement.closest && document.activeElement.closest("#canary");
  if (key !== lastRouting && !editing) {
    lastRouting = key;
    const box = $("#canary");
    box.innerHTML = "";
    for (const [model, cfg] of Object.entries(routing)) {
      const div = document.createElement("div");
      div.className = "model";
      div.dataset.model = model;
      const vs = cfg.variants || [];
      div.innerHTML = `<strong>${esc(model)}</strong> <span class="muted">sticky by ${esc(cfg.sticky_key)}, reuse threshold ${cfg.reuse_threshold}</span><br>` +
        (vs.length ? vs.map((v) =>
          `<label>${esc(v.name)} <span class="muted">(${v.pools.map((p) => esc(p.engine_kind + "@" + p.version)).join(", ")})</span> ` +
          `<input type="number" min="0" step="1" data-variant="${esc(v.name)}" value="${v.weight}"></label>`).join("") +
          `<button class="apply">Apply weights</button>` : '<span class="muted">no variants (all pools, one arm)</span>');
      const btn = div.querySelector("button.apply");
      if (btn) btn.onclick = () => applyWeights(model, div);
      box.appendChild(div);
    }
  }
  for (const div of document.querySelectorAll("#canary .model")) {
    let line = div.querySelector(".policy");
    if (!line) { line = document.createElement("div"); line.className = "policy muted"; div.appendChild(line); }
    line.textContent = describePolicy((rollback.policies || {})[div.dataset.model], (rollback.status || {})[div.dataset.model]);
  }
  const events = rollback.events || [];
  $("#rollbacks").innerHTML = events.length
    ? events.slice().reverse().map((e) => `<li>${e.message.startsWith("canary promoted") ? '<span class="pill ok">promoted</span>'
      : '<span class="pill bad">rollback</span>'} ${new Date(e.at * 1000).toLocaleTimeString()} ` +
      `${esc(e.model)} / ${esc(e.variant)}: ${esc(e.message)}</li>`).join("")
    : '<li class="muted">none</li>';
}

function describePolicy(p, st) {
  if (!p) return "automatic rollback: off";
  const bounds = [];
  if (p.max_ttft_p99_ratio !== null) bounds.push(`TTFT p99 <= ${p.max_ttft_p99_ratio}x`);
  if (p.max_error_rate_increase !== null) bounds.push(`errors <= +${(100 * p.max_error_rate_increase).toFixed(0)}%`);
  let text = `automatic rollback: ${p.canary} vs ${p.baseline}, ${bounds.join(", ")} over ${p.window_s} s ` +
    `(min ${p.min_requests} requests)`;
  if (p.ramp.length) text += ` · ramp step ${Math.max(0, st ? st.ramp_step : 0) + 1}/${p.ramp.length}`;
  if (p.gates) text += " · shadow gates on";
  if (st && st.promoted) text += " · PROMOTED";
  else if (st && st.rolled_back) text += " · ROLLED BACK";
  else if (st && st.breaching) text += " · out of bounds";
  return text;
}

async function applyWeights(model, div) {
  const current = await api("GET", `/admin/models/${encodeURIComponent(model)}/routing`);
  const next = JSON.parse(JSON.stringify(current));
  const lines = [];
  for (const v of next.variants) {
    const input = div.querySelector(`input[data-variant="${CSS.escape(v.name)}"]`);
    const w = Number(input.value);
    if (w !== v.weight) lines.push(`${v.name}: ${v.weight} -> ${w}`);
    v.weight = w;
  }
  if (!lines.length) return;
  if (!(await confirmAction(`Change canary weights of ${model}?`, lines.join("\n")))) return;
  try {
    await api("PUT", `/admin/models/${encodeURIComponent(model)}/routing`, next);
    lastRouting = ""; // redraw from the next event
    document.activeElement.blur();
    refreshTables();
  } catch (e) { alert(`Rejected: ${e.message}`); }
}

function confirmAction(title, body) {
  const dlg = $("#confirm");
  $("#confirm-title").textContent = title;
  $("#confirm-body").textContent = body;
  return new Promise((resolve) => {
    dlg.onclose = () => resolve(dlg.returnValue === "ok");
    dlg.showModal();
  });
}

async function refreshTables() {
  try {
    const audit = await api("GET", "/admin/audit?limit=50");
    $("#audit tbody").innerHTML = (audit.entries || []).map((a) =>
      `<tr><td>${new Date(a.time * 1000).toLocaleString()}</td><td>${esc(a.actor)}</td><td>${esc(a.model)}</td>` +
      `<td>${esc(describeChange(a.before, a.after))}</td></tr>`).join("");
    const dec = await api("GET", "/admin/decisions?limit=12");
    $("#decisions tbody").innerHTML = (dec.decisions || []).map((d) =>
      `<tr><td>${new Date(d.at * 1000).toLocaleTimeString()}</td><td>${esc(d.model)}</td><td>${esc(d.variant)}</td>` +
      `<td>${esc(d.engine_kind)}</td><td>${esc(d.worker_id)}</td><td>${esc(d.reason)}</td>` +
      `<td>${(100 * d.estimated_reuse).toFixed(0)}%</td><td>${d.cached_blocks}</td></tr>`).join("");
    await refreshProfile();
    await refreshModels();
  } catch (e) { if (e.status === 401 || e.status === 403) logout(); }
}

function describeChange(before, after) {
  const w = (cfg) => (cfg && cfg.variants ? cfg.variants.map((v) => `${v.name}=${v.weight}`).join(" ") : "none");
  return `${w(before)} → ${w(after)}`;
}

// ---- the stream ----
async function stream() {
  streamAbort = new AbortController();
  const conn = $("#conn");
  while (adminKey()) {
    try {
      const resp = await fetch("/admin/stats/stream", {
        headers: { "Authorization": "Bearer " + adminKey() }, signal: streamAbort.signal,
      });
      if (resp.status === 401 || resp.status === 403) { logout("The admin key was refused."); return; }
      conn.textContent = "live"; conn.className = "pill ok";
      const reader = resp.body.getReader();
      const decoder = new TextDecoder();
      let buf = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buf.indexOf("\n\n")) >= 0) {
          const frame = buf.slice(0, cut);
          buf = buf.slice(cut + 2);
          const data = frame.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
          if (data) onEvent(JSON.parse(data));
        }
      }
    } catch (e) {
      if (e.name === "AbortError") return;
    }
    conn.textContent = "reconnecting"; conn.className = "pill bad";
    await new Promise((r) => setTimeout(r, 1000));
  }
}

function logout(message) {
  sessionStorage.removeItem(KEY_SLOT);
  if (streamAbort) streamAbort.abort();
  $("#main").hidden = true; $("#logout").hidden = true; $("#login").hidden = false;
  $("#login-error").textContent = message || "";
  $("#conn").textContent = "disconnected"; $("#conn").className = "pill bad";
}

function start() {
  $("#login").hidden = true; $("#main").hidden = false; $("#logout").hidden = false;
  if (!charts.rps) initCharts();
  stream();
  refreshTables();
}

$("#login-form").onsubmit = async (e) => {
  e.preventDefault();
  sessionStorage.setItem(KEY_SLOT, $("#admin-key").value);
  $("#admin-key").value = "";
  try { await api("GET", "/admin/workers"); start(); }
  catch (err) { logout(err.status === 401 || err.status === 403 ? "The admin key was refused." : err.message); }
};
$("#logout").onclick = () => logout();
$("#profile-model").onchange = () => refreshProfile().catch(() => {});
$("#shadow-form").onsubmit = startShadow;
$("#shadow").onclick = shadowAction;
setInterval(() => { if (adminKey()) refreshTables(); }, 3000);
if (adminKey()) start(); else logout();
