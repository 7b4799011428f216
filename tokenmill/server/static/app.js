// tokenmill web page: chat playground (streamed /v1/chat/completions) and status view (/debug/status).
// Plain JavaScript, no dependencies. The API key, the conversation and the settings live in localStorage.
"use strict";

const STORE = { key: "tokenmill.apiKey", chat: "tokenmill.chat", settings: "tokenmill.settings" };
const POLL_MS = 2000;           // status poll interval
const WINDOW_S = 300;           // charts show the last five minutes
const $ = (id) => document.getElementById(id);

// ---- HTTP -------------------------------------------------------------------------------------------
function headers(json) {
  const h = {};
  const key = localStorage.getItem(STORE.key);
  if (key) h["Authorization"] = "Bearer " + key;
  if (json) h["Content-Type"] = "application/json";
  return h;
}

async function errorText(response) {
  // OpenAI error bodies: {"error": {"message", "type", "param", "code"}}
  try {
    const body = await response.json();
    if (body && body.error) return `${response.status}: ${body.error.message}`;
  } catch (_) { /* not JSON */ }
  return `HTTP ${response.status}`;
}

async function getJSON(path) {
  const response = await fetch(path, { headers: headers(false) });
  if (!response.ok) throw new Error(await errorText(response));
  return response.json();
}

// Parse an SSE byte stream into the JSON payloads of its "data:" lines; calls onEvent(obj) for each and
// returns when the stream ends or "[DONE]" arrives.
async function readSSE(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        onEvent(JSON.parse(data));
      }
    }
  }
}

// ---- tabs and API key -------------------------------------------------------------------------------
function showView(name) {
  for (const tab of document.querySelectorAll(".tab")) tab.classList.toggle("active", tab.dataset.view === name);
  $("view-chat").hidden = name !== "chat";
  $("view-status").hidden = name !== "status";
  if (name === "status") redrawCharts();
}

function setServerState(text, cls) {
  const pill = $("server-state");
  pill.textContent = text;
  pill.className = "pill " + (cls || "");
}

// ---- chat -------------------------------------------------------------------------------------------
let conversation = [];          // [{role, content, stats?}]
let controller = null;          // AbortController of the request in flight

function loadSettings() {
  let s = {};
  try { s = JSON.parse(localStorage.getItem(STORE.settings) || "{}"); } catch (_) { s = {}; }
  if (s.system !== undefined) $("system-prompt").value = s.system;
  if (s.temperature !== undefined) $("temperature").value = s.temperature;
  if (s.top_p !== undefined) $("top-p").value = s.top_p;
  if (s.max_tokens !== undefined) $("max-tokens").value = s.max_tokens;
  return s;
}

function saveSettings() {
  const s = { system: $("system-prompt").value, temperature: $("temperature").value, top_p: $("top-p").value,
              max_tokens: $("max-tokens").value, model: $("model").value };
  localStorage.setItem(STORE.settings, JSON.stringify(s));
  $("temperature-value").textContent = Number(s.temperature).toFixed(2);
  $("top-p-value").textContent = Number(s.top_p).toFixed(2);
}

function saveConversation() {
  localStorage.setItem(STORE.chat, JSON.stringify(conversation));
}

function statsText(stats) {
  if (!stats) return "";
  const parts = [];
  if (stats.ttft_ms !== undefined) parts.push(`TTFT ${Math.round(stats.ttft_ms)} ms`);
  if (stats.tokens_per_s !== undefined) parts.push(`${stats.tokens_per_s.toFixed(1)} tok/s`);
  if (stats.completion_tokens !== undefined) parts.push(`${stats.completion_tokens} tokens`);
  if (stats.prompt_tokens !== undefined) parts.push(`prompt ${stats.prompt_tokens}`);
  if (stats.cached_tokens !== undefined) parts.push(`cached ${stats.cached_tokens}`);
  if (stats.finish_reason) parts.push(`finish: ${stats.finish_reason}`);
  if (stats.model) parts.push(stats.model);
  return parts.join(" · ");
}

function renderMessage(message) {
  const div = document.createElement("div");
  div.className = "msg " + message.role;
  const role = document.createElement("div");
  role.className = "role";
  role.textContent = message.role;
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = message.content;
  const stats = document.createElement("div");
  stats.className = "stats";
  stats.textContent = statsText(message.stats);
  div.append(role, content, stats);
  $("messages").append(div);
  return div;
}

function renderConversation() {
  $("messages").replaceChildren();
  for (const message of conversation) renderMessage(message);
  $("messages").scrollTop = $("messages").scrollHeight;
}

async function loadModels() {
  const select = $("model");
  const wanted = select.value || (JSON.parse(localStorage.getItem(STORE.settings) || "{}")).model;
  const models = await getJSON("/v1/models");
  select.replaceChildren();
  for (const card of models.data) {
    const option = document.createElement("option");
    option.value = card.id;
    option.textContent = card.parent ? `${card.id} (adapter of ${card.parent})` : card.id;
    select.append(option);
  }
  if (wanted && models.data.some((c) => c.id === wanted)) select.value = wanted;
}

function setStreaming(on) {
  $("send").disabled = on;
  $("stop").hidden = !on;
}

async function sendMessage(text) {
  conversation.push({ role: "user", content: text });
  saveConversation();
  renderMessage(conversation[conversation.length - 1]);
  const messages = [];
  const system = $("system-prompt").value.trim();
  if (system) messages.push({ role: "system", content: system });
  for (const m of conversation) {
    if (m.role === "user" || (m.role === "assistant" && m.content)) messages.push({ role: m.role, content: m.content });
  }

  const reply = { role: "assistant", content: "", stats: { model: $("model").value } };
  const div = renderMessage(reply);
  div.classList.add("streaming");
  const contentEl = div.querySelector(".content");
  const statsEl = div.querySelector(".stats");
  controller = new AbortController();
  setStreaming(true);
  const body = {
    model: $("model").value, messages, stream: true, stream_options: { include_usage: true },
    temperature: Number($("temperature").value), top_p: Number($("top-p").value),
    max_tokens: Number($("max-tokens").value),
  };
  const start = performance.now();
  let first = null, last = null, chunks = 0;
  const update = () => {
    contentEl.textContent = reply.content;
    if (first !== null) reply.stats.ttft_ms = first - start;
    const n = reply.stats.completion_tokens !== undefined ? reply.stats.completion_tokens : chunks;
    // decode speed: tokens after the first over the time since the first arrived
    if (n > 1 && last > first) reply.stats.tokens_per_s = (n - 1) / ((last - first) / 1000);
    statsEl.textContent = statsText(reply.stats);
    $("messages").scrollTop = $("messages").scrollHeight;
  };
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(true), body: JSON.stringify(body), signal: controller.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    await readSSE(response, (event) => {
      if (event.error) throw new Error(event.error.message);
      for (const choice of event.choices || []) {
        const piece = (choice.delta && choice.delta.content) || "";
        if (piece) {
          const now = performance.now();
          if (first === null) first = now;
          last = now;
          chunks += 1;
          reply.content += piece;
        }
        if (choice.finish_reason) reply.stats.finish_reason = choice.finish_reason;
      }
      if (event.usage) {
        reply.stats.prompt_tokens = event.usage.prompt_tokens;
        reply.stats.completion_tokens = event.usage.completion_tokens;
        const details = event.usage.prompt_tokens_details;
        reply.stats.cached_tokens = details && details.cached_tokens !== null ? details.cached_tokens : 0;
      }
      update();
    });
  } catch (err) {
    if (err.name === "AbortError") {
      reply.stats.finish_reason = "stopped";
    } else {
      div.classList.add("error");
      reply.stats.finish_reason = "error";
      reply.error = String(err.message || err);
      if (!reply.content) reply.content = reply.error;
    }
  } finally {
    controller = null;
    setStreaming(false);
    div.classList.remove("streaming");
    update();
    if (!reply.error || reply.content !== reply.error) {
      conversation.push(reply);
    } else {  // a failed request leaves no turn behind; its text goes back to the input to be sent again
      conversation.pop();
      if (!$("chat-input").value) $("chat-input").value = text;
    }
    saveConversation();
  }
}

// ---- status -----------------------------------------------------------------------------------------
const history = [];             // [{t, gen, prompt, ttft, itl, e2e, running, waiting, kv}]
let previous = null;            // last metrics snapshot

function delta(now, before, name) {
  const a = now[name], b = before[name];
  return typeof a === "number" && typeof b === "number" ? a - b : 0;
}

function meanOver(now, before, name) {
  const count = delta(now, before, name + "_count");
  return count > 0 ? (1000 * delta(now, before, name + "_sum")) / count : null;
}

function sumValues(x) {
  if (typeof x === "number") return x;
  return x ? Object.values(x).reduce((a, b) => a + b, 0) : 0;
}

function pct(x) { return (100 * x).toFixed(1) + "%"; }

function fmtBytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function setBar(id, fraction) { $(id).style.width = `${Math.max(0, Math.min(1, fraction)) * 100}%`; }

function renderStatus(status) {
  const m = status.metrics;
  const kv = status.kv_cache;
  $("st-running").textContent = m.num_requests_running;
  $("st-waiting").textContent = m.num_requests_waiting;
  $("st-kv").textContent = pct(kv.usage);
  setBar("st-kv-bar", kv.usage);
  $("st-kv-sub").textContent =
    `${kv.num_blocks - kv.num_free_blocks} / ${kv.num_blocks} blocks of ${kv.block_size} tokens`;
  const tiers = kv.kv_offload || {};
  if (tiers.ram) {
    const used = tiers.ram.blocks_stored / tiers.ram.capacity_blocks;
    $("st-ram").textContent = pct(used);
    setBar("st-ram-bar", used);
    $("st-ram-sub").textContent =
      `${tiers.ram.blocks_stored} / ${tiers.ram.capacity_blocks} blocks, ${tiers.ram.hits} hits`;
  }
  if (tiers.disk) {
    const used = tiers.disk.capacity_bytes ? tiers.disk.used_bytes / tiers.disk.capacity_bytes : 0;
    $("st-disk").textContent = tiers.disk.enabled ? pct(used) : "disabled";
    setBar("st-disk-bar", used);
    $("st-disk-sub").textContent = `${fmtBytes(tiers.disk.used_bytes)} / ${fmtBytes(tiers.disk.capacity_bytes)}, ` +
      `${tiers.disk.hits} hits`;
  }
  const queries = m.prefix_cache_queries_total || 0, hits = m.prefix_cache_hits_total || 0;
  $("st-prefix").textContent = queries ? pct(hits / queries) : "–";
  $("st-prefix-sub").textContent = `${hits} of ${queries} prompt tokens`;
  const finished = m.request_success_total || {};
  $("st-requests").textContent = sumValues(finished);
  $("st-requests-sub").textContent = Object.entries(finished).map(([k, v]) => `${k} ${v}`).join(", ") || "none yet";
  $("st-preemptions").textContent = m.num_preemptions_total;

  if (previous && status.time > previous.time) {
    const dt = status.time - previous.time;
    const before = previous.metrics;
    history.push({
      t: status.time,
      gen: delta(m, before, "generation_tokens_total") / dt,
      prompt: delta(m, before, "prompt_tokens_total") / dt,
      ttft: meanOver(m, before, "time_to_first_token_seconds"),
      itl: meanOver(m, before, "inter_token_latency_seconds"),
      e2e: meanOver(m, before, "e2e_request_latency_seconds"),
      queue: meanOver(m, before, "request_queue_time_seconds"),
      running: m.num_requests_running, waiting: m.num_requests_waiting, kv: 100 * m.kv_cache_usage_perc,
    });
    while (history.length && history[0].t < status.time - WINDOW_S) history.shift();
  }
  previous = { time: status.time, metrics: m };
  redrawCharts();
  $("status-updated").textContent = `Updated ${new Date(status.time * 1000).toLocaleTimeString()}; ` +
    `${status.served_model_name}, tokenmill ${status.version}; polling every ${POLL_MS / 1000} s, ` +
    `charts over the last ${WINDOW_S / 60} minutes.`;
  renderConfig(status);
}

function flatten(prefix, value, out) {
  if (value !== null && typeof value === "object" && !Array.isArray(value)) {
    for (const [k, v] of Object.entries(value)) flatten(prefix ? `${prefix}.${k}` : k, v, out);
  } else {
    out.push([prefix, Array.isArray(value) ? value.join(", ") : String(value)]);
  }
  return out;
}

let configShown = false;
function renderConfig(status) {
  if (configShown) return;
  const rows = [["model", status.model], ["served_model_name", status.served_model_name],
    ["version", status.version], ["device", status.device], ["dtype", status.dtype],
    ["num_threads", status.num_threads], ["cpu", `${status.cpu.model} (${status.cpu.isa_path})`]];
  flatten("kernels", status.kernels, rows);
  flatten("config", status.config, rows);
  flatten("structured_outputs.backend", status.structured_outputs && status.structured_outputs.backend, rows);
  const tbody = $("config-table").querySelector("tbody");
  tbody.replaceChildren();
  for (const [k, v] of rows) {
    const tr = document.createElement("tr");
    const a = document.createElement("td"), b = document.createElement("td");
    a.textContent = k;
    b.textContent = v;
    tr.append(a, b);
    tbody.append(tr);
  }
  configShown = true;
}

// A small SVG line chart: series = [{key, label, color}], over `history`; y from 0 to the max seen.
function drawChart(svg, series, scale) {
  const width = svg.clientWidth || 340, height = svg.clientHeight || 120;
  const left = 40, right = 8, top = 16, bottom = 14;
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  const now = history.length ? history[history.length - 1].t : 0;
  let ymax = 0;
  for (const p of history) for (const s of series) if (p[s.key] !== null) ymax = Math.max(ymax, p[s.key] * scale);
  ymax = ymax > 0 ? ymax * 1.1 : 1;
  const x = (t) => left + ((t - (now - WINDOW_S)) / WINDOW_S) * (width - left - right);
  const y = (v) => top + (1 - v / ymax) * (height - top - bottom);
  const ns = "http://www.w3.org/2000/svg";
  const el = (tag, attrs, text) => {
    const e = document.createElementNS(ns, tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    return e;
  };
  const parts = [];
  for (const frac of [0, 0.5, 1]) {
    const v = ymax * frac;
    parts.push(el("line", { class: "grid", x1: left, x2: width - right, y1: y(v), y2: y(v) }));
    const label = v >= 100 ? v.toFixed(0) : v.toPrecision(2);
    parts.push(el("text", { x: left - 4, y: y(v) + 3, "text-anchor": "end" }, label));
  }
  parts.push(el("text", { x: left, y: height - 2 }, `-${WINDOW_S / 60} min`));
  parts.push(el("text", { x: width - right, y: height - 2, "text-anchor": "end" }, "now"));
  let legendX = left;
  for (const s of series) {
    // a gap (null: no request finished in that interval) breaks the line
    let run = [];
    const flush = () => {
      if (run.length > 1) parts.push(el("polyline", { points: run.join(" "), stroke: s.color, "data-series": s.key }));
      if (run.length === 1) {  // a lone point between gaps: a dot
        const [cx, cy] = run[0].split(",");
        parts.push(el("circle", { cx, cy, r: 2, fill: s.color, "data-series": s.key }));
      }
      run = [];
    };
    for (const p of history) {
      if (p[s.key] === null) { flush(); continue; }
      run.push(`${x(p.t).toFixed(1)},${y(p[s.key] * scale).toFixed(1)}`);
    }
    flush();
    const last = [...history].reverse().find((p) => p[s.key] !== null);
    const label = `${s.label}${last ? " " + (last[s.key] * scale).toFixed(1) : ""}`;
    parts.push(el("text", { x: legendX, y: 10, style: `fill:${s.color}` }, label));
    legendX += 8 + 6 * label.length;
  }
  svg.replaceChildren(...parts);
}

function redrawCharts() {
  if ($("view-status").hidden) return;
  drawChart($("chart-throughput"), [{ key: "gen", label: "generation", color: "var(--s1)" },
                                    { key: "prompt", label: "prompt", color: "var(--s2)" }], 1);
  drawChart($("chart-latency"), [{ key: "ttft", label: "TTFT", color: "var(--s1)" },
                                 { key: "itl", label: "ITL", color: "var(--s2)" }], 1);
  drawChart($("chart-e2e"), [{ key: "e2e", label: "E2E", color: "var(--s3)" },
                             { key: "queue", label: "queue", color: "var(--s2)" }], 1);
  drawChart($("chart-queue"), [{ key: "running", label: "running", color: "var(--s1)" },
                               { key: "waiting", label: "waiting", color: "var(--s2)" }], 1);
  drawChart($("chart-kv"), [{ key: "kv", label: "KV pool", color: "var(--s4)" }], 1);
}

let modelsLoaded = false;
let polls = 0;
const MODELS_EVERY = 15;        // re-read /v1/models every 15 polls (adapters loaded or unloaded at run time)
async function poll() {
  try {
    const status = await getJSON("/debug/status?check_integrity=false");
    setServerState("serving", "ok");
    renderStatus(status);
    polls += 1;
    if (!modelsLoaded || polls % MODELS_EVERY === 0) { await loadModels(); modelsLoaded = true; }
  } catch (err) {
    const text = String(err.message || err);
    setServerState(text.startsWith("401") ? "API key needed" : text.startsWith("503") ? "loading…" : "unreachable",
                   "bad");
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

// ---- wiring -----------------------------------------------------------------------------------------
function init() {
  for (const tab of document.querySelectorAll(".tab")) tab.addEventListener("click", () => showView(tab.dataset.view));
  $("api-key").value = localStorage.getItem(STORE.key) || "";
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const key = $("api-key").value.trim();
    if (key) localStorage.setItem(STORE.key, key); else localStorage.removeItem(STORE.key);
    modelsLoaded = false;
  });
  loadSettings();
  saveSettings();
  for (const id of ["system-prompt", "temperature", "top-p", "max-tokens", "model"]) {
    $(id).addEventListener("input", saveSettings);
  }
  try { conversation = JSON.parse(localStorage.getItem(STORE.chat) || "[]"); } catch (_) { conversation = []; }
  renderConversation();
  $("new-chat").addEventListener("click", () => {
    if (controller) controller.abort();
    conversation = [];
    saveConversation();
    renderConversation();
  });
  $("chat-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("chat-input").value.trim();
    if (!text || controller) return;
    $("chat-input").value = "";
    sendMessage(text);
  });
  $("chat-input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("chat-form").requestSubmit(); }
  });
  $("stop").addEventListener("click", () => { if (controller) controller.abort(); });
  window.addEventListener("resize", redrawCharts);
  poll();
}

init();
