// The page: chat with the served model over /v1/chat/completions (streamed), and the engine's telemetry from
// /v1/telemetry/stream, both read with fetch() so that the API key can go in the Authorization header
// (EventSource cannot send headers). Everything the model writes is set as text, never as HTML.
"use strict";

const STORE_CONVERSATIONS = "colibri-aio.conversations";
const STORE_SETTINGS = "colibri-aio.settings";
// The key is kept for this tab only (sessionStorage): a key typed into a page should not outlive it on disk.
const STORE_KEY = "colibri-aio.api-key";
// Seconds between telemetry samples: the server's default (run --stats-interval's too), or the page's
// ?telemetry=S (0.2 to 60, what the server accepts) for a closer look at short replies.
const TELEMETRY_INTERVAL_S = (() => {
  const asked = Number(new URLSearchParams(location.search).get("telemetry"));
  return asked >= 0.2 && asked <= 60 ? asked : 1;
})();
const RECONNECT_MS = 2000;

const $ = (id) => document.getElementById(id);

const state = {
  apiKey: sessionStorage.getItem(STORE_KEY) || "",
  model: null,
  conversations: loadJSON(localStorage, STORE_CONVERSATIONS, []),
  currentId: null,
  reply: null,          // {controller, message element} while a reply streams
  telemetry: null,      // AbortController of the telemetry stream
  charts: [],
};

function loadJSON(store, key, fallback) {
  try {
    const v = JSON.parse(store.getItem(key));
    return v ?? fallback;
  } catch {
    return fallback;
  }
}

function saveConversations() {
  try {
    localStorage.setItem(STORE_CONVERSATIONS, JSON.stringify(state.conversations));
  } catch (e) {
    setStatus(`conversations not saved: ${e.message}`, true);
  }
}

function setStatus(text, error = false) {
  const el = $("status");
  el.textContent = text;
  el.classList.toggle("error", error);
}

// --- HTTP -------------------------------------------------------------------------------------------------------

function headers(json) {
  const h = {};
  if (state.apiKey) h["Authorization"] = `Bearer ${state.apiKey}`;
  if (json) h["Content-Type"] = "application/json"; // the server refuses bodies of any other type (415)
  return h;
}

class HttpError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

async function failure(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body?.error?.message) message = `${response.status}: ${body.error.message}`;
  } catch { /* not JSON: keep the status line */ }
  return new HttpError(response.status, message);
}

// Calls onEvent(name, data) for each Server-Sent Event of a fetch() response; resolves when the stream ends.
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let name = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
        else if (line.startsWith("event:")) name = line.slice(6).trim();
      }
      if (data.length) onEvent(name, data.join("\n"));
    }
  }
}

// --- API key and the model ----------------------------------------------------------------------------------------

function askForKey(message) {
  $("key-form").hidden = false;
  setStatus(message, true);
  $("api-key").focus();
}

async function connect() {
  try {
    const r = await fetch("/v1/models", { headers: headers(false) });
    if (r.status === 401) {
      askForKey(state.apiKey ? "The API key was refused (401): check it and try again."
                             : "This server needs an API key.");
      $("model-name").textContent = "not connected";
      return false;
    }
    if (!r.ok) throw await failure(r);
    const body = await r.json();
    state.model = body.data?.[0]?.id ?? null;
    $("model-name").textContent = state.model ?? "(no model)";
    if (state.apiKey) $("key-form").hidden = true;
    setStatus("");
    startTelemetry();
    return true;
  } catch (e) {
    setStatus(`cannot reach the server: ${e.message}`, true);
    return false;
  }
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  state.apiKey = $("api-key").value.trim();
  sessionStorage.setItem(STORE_KEY, state.apiKey);
  connect().then((ok) => { if (ok) $("prompt").focus(); });
});

// --- settings ---------------------------------------------------------------------------------------------------

const SETTINGS = [["system-prompt", "system"], ["temperature", "temperature"], ["top-p", "top_p"],
                  ["max-tokens", "max_tokens"]];

function loadSettings() {
  const saved = loadJSON(localStorage, STORE_SETTINGS, {});
  for (const [id, key] of SETTINGS) if (saved[key] != null) $(id).value = saved[key];
  for (const [id] of SETTINGS) $(id).addEventListener("change", saveSettings);
}

function saveSettings() {
  const s = {};
  for (const [id, key] of SETTINGS) s[key] = $(id).value;
  localStorage.setItem(STORE_SETTINGS, JSON.stringify(s));
}

// Empty fields are left out of the request: the server then uses the model's own sampling defaults
// (general.sampling.* in the GGUF), as a client that does not name them gets.
function samplingFields() {
  const out = {};
  const number = (id) => ($(id).value.trim() === "" ? null : Number($(id).value));
  const t = number("temperature"), p = number("top-p"), n = number("max-tokens");
  if (t != null && Number.isFinite(t)) out.temperature = t;
  if (p != null && Number.isFinite(p)) out.top_p = p;
  if (n != null && Number.isInteger(n) && n > 0) out.max_tokens = n;
  return out;
}

// --- conversations ----------------------------------------------------------------------------------------------

function current() {
  return state.conversations.find((c) => c.id === state.currentId) ?? null;
}

function newConversation() {
  const c = { id: `${Date.now()}-${Math.random().toString(36).slice(2, 8)}`, title: "New chat", messages: [] };
  state.conversations.unshift(c);
  state.currentId = c.id;
  saveConversations();
  return c;
}

function renderConversations() {
  const list = $("conversation-list");
  list.replaceChildren();
  for (const c of state.conversations) {
    const li = document.createElement("li");
    li.classList.toggle("current", c.id === state.currentId);
    const open = document.createElement("button");
    open.type = "button";
    open.className = "open";
    open.textContent = c.title;
    if (c.id === state.currentId) open.setAttribute("aria-current", "true");
    open.addEventListener("click", () => { if (!state.reply) { state.currentId = c.id; renderAll(); } });
    const del = document.createElement("button");
    del.type = "button";
    del.className = "delete";
    del.textContent = "×";
    del.setAttribute("aria-label", `Delete conversation “${c.title}”`);
    del.addEventListener("click", () => {
      if (state.reply && c.id === state.currentId) return;
      state.conversations = state.conversations.filter((x) => x.id !== c.id);
      if (state.currentId === c.id) state.currentId = state.conversations[0]?.id ?? null;
      saveConversations();
      renderAll();
    });
    li.append(open, del);
    list.append(li);
  }
}

function messageElement(m) {
  const li = document.createElement("li");
  li.className = `message ${m.role}${m.error ? " error" : ""}`;
  const role = document.createElement("div");
  role.className = "role";
  role.textContent = m.role === "user" ? "You" : "Model";
  li.append(role);
  // The model's thinking (reasoning_content) apart from its answer, folded once the answer is there.
  const reasoning = document.createElement("details");
  reasoning.className = "reasoning";
  reasoning.open = true;
  const summary = document.createElement("summary");
  summary.textContent = "Thinking";
  const reasoningText = document.createElement("div");
  reasoningText.className = "reasoning-text";
  reasoning.append(summary, reasoningText);
  reasoning.hidden = !m.reasoning;
  reasoningText.textContent = m.reasoning ?? "";
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = m.content ?? "";
  const meta = document.createElement("div");
  meta.className = "meta";
  meta.textContent = m.meta ?? "";
  li.append(reasoning, content, meta);
  return { li, reasoning, reasoningText, content, meta };
}

function renderMessages() {
  const list = $("messages");
  list.replaceChildren();
  for (const m of current()?.messages ?? []) list.append(messageElement(m).li);
  list.scrollTop = list.scrollHeight;
}

function renderAll() {
  renderConversations();
  renderMessages();
}

// --- a reply ----------------------------------------------------------------------------------------------------

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

async function send(text) {
  const conversation = current() ?? newConversation();
  if (conversation.messages.length === 0) conversation.title = text.slice(0, 40);
  const history = conversation.messages.filter((m) => !m.error)
    .map((m) => ({ role: m.role, content: m.content }));
  const system = $("system-prompt").value.trim();
  const messages = [...(system ? [{ role: "system", content: system }] : []), ...history,
                    { role: "user", content: text }];
  conversation.messages.push({ role: "user", content: text });
  const reply = { role: "assistant", content: "", reasoning: "" };
  conversation.messages.push(reply);
  saveConversations();
  renderConversations();
  renderMessages();
  const view = messageElement(reply);
  $("messages").lastChild.replaceWith(view.li);
  view.li.setAttribute("aria-busy", "true");

  const controller = new AbortController();
  state.reply = { controller };
  setBusy(true);
  setStatus("generating…");
  const started = performance.now();
  let usage = null, finish = null;
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(true), signal: controller.signal,
      body: JSON.stringify({ model: state.model ?? undefined, messages, stream: true,
                             stream_options: { include_usage: true }, ...samplingFields() }),
    });
    if (!r.ok) throw await failure(r);
    await readEvents(r, (_name, data) => {
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new HttpError(0, chunk.error.message ?? "the stream ended with an error");
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices?.[0];
      if (!choice) return;
      if (choice.finish_reason) finish = choice.finish_reason;
      const d = choice.delta ?? {};
      if (d.reasoning_content) {
        reply.reasoning += d.reasoning_content;
        view.reasoningText.textContent = reply.reasoning;
        view.reasoning.hidden = false;
      }
      if (d.content) {
        reply.content += d.content;
        view.content.textContent = reply.content;
        if (reply.reasoning) view.reasoning.open = false;
      }
      const list = $("messages");
      list.scrollTop = list.scrollHeight;
    });
    const seconds = (performance.now() - started) / 1000;
    reply.meta = usage ? `${usage.completion_tokens} tokens in ${seconds.toFixed(1)} s` +
                         ` (${(usage.completion_tokens / seconds).toFixed(1)} tok/s)` +
                         (finish ? `, finish: ${finish}` : "")
                       : `${seconds.toFixed(1)} s`;
    setStatus("");
  } catch (e) {
    if (e.name === "AbortError") {
      reply.meta = "stopped";
      setStatus("stopped");
    } else {
      reply.meta = e.message;
      if (!reply.content) { reply.content = e.message; reply.error = true; view.li.classList.add("error"); }
      if (e.status === 401) askForKey("The API key was refused (401): check it and try again.");
      else setStatus(e.message, true);
    }
  } finally {
    view.content.textContent = reply.content;
    view.meta.textContent = reply.meta ?? "";
    view.li.removeAttribute("aria-busy");
    state.reply = null;
    setBusy(false);
    saveConversations();
  }
}

function stop() {
  state.reply?.controller.abort();
}

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || state.reply) return;
  $("prompt").value = "";
  send(text);
});

$("prompt").addEventListener("keydown", (event) => {
  // Enter sends, Shift+Enter is a new line; not while an input method composes a character.
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});

document.addEventListener("keydown", (event) => {
  if (event.key === "Escape" && state.reply) stop();
});

$("stop").addEventListener("click", stop);
$("new-chat").addEventListener("click", () => {
  if (state.reply) return;
  newConversation();
  renderAll();
  $("prompt").focus();
});

// --- telemetry --------------------------------------------------------------------------------------------------

// What the stream sends (colibri_aio/serve/telemetry_stream.py, the columns of `run --stats`); null where the
// server measured nothing (no block device under the model).
const CHART_SPECS = [
  { id: "chart-tps", title: "Tokens per second", series: [
    { label: "tok/s", color: "#0a84ff", value: (s) => s["tok/s"] }] },
  // An interval without expert lookups (idle) has no hit rate: a gap, not a drop to 0 %.
  { id: "chart-hits", title: "Expert hit rate", unit: "%", max: 100, stacked: true, series: [
    { label: "pinned", color: "#34a853", value: (s) => (s.lookups ? s["pin%"] : null) },
    { label: "cached", color: "#4285f4", value: (s) => (s.lookups ? s["lru%"] : null) },
    { label: "prefetched", color: "#fbbc05", value: (s) => (s.lookups ? s["pre%"] : null) }] },
  { id: "chart-disk", title: "Disk reads", unit: "MB/s", missing: "the model is on no block device", series: [
    { label: "device", color: "#ea4335", value: (s) => s["rMB/s"] },
    { label: "experts", color: "#9c27b0", value: (s) => s["ourMB/s"] }] },
  { id: "chart-util", title: "Disk busy", unit: "%", max: 100, missing: "the model is on no block device", series: [
    { label: "%util", color: "#ff6d00", value: (s) => s["%util"] }] },
  { id: "chart-inflight", title: "Expert reads in flight", digits: 0, series: [
    { label: "reads", color: "#00897b", value: (s) => s.infl }] },
  { id: "chart-slots", title: "Sequences and queue", digits: 0, series: [
    { label: "generating", color: "#3949ab", value: (s) => s.engine?.sequences_busy },
    { label: "waiting", color: "#e91e63", value: (s) => s.queue?.waiting },
    { label: "batch", color: "#8d6e63", value: (s) => s.batch }] },
  { id: "chart-rss", title: "Resident memory", unit: "MB", digits: 0, series: [
    { label: "RSS", color: "#607d8b", value: (s) => s.RSS_MB }] },
];

function setupCharts() {
  const parent = $("charts");
  state.charts = CHART_SPECS.map((spec) => new LineChart(parent, spec));
  window.addEventListener("resize", () => state.charts.forEach((c) => c.draw()));
}

function showReadout(s) {
  const rows = [
    ["prefetch", `${s.pf}${s["pf-why"] ? ` (${s["pf-why"]})` : ""}`],
    ["prefetch precision", `${s["pf-prec%"].toFixed(0)} %`],
    ["expert slots", s.slots],
    ["sequences", s.seqs],
    ["queue", `${s.queue.waiting} waiting of ${s.queue.capacity}`],
    ["disk", s.device ?? "none"],
    ["hit rate since start", `${(100 * s.engine.hit_rate).toFixed(1)} %`],
    ["tokens since start", `${s.engine.generated_tokens} generated, ${s.engine.prompt_tokens} prefilled`],
  ];
  const dl = $("readout");
  dl.replaceChildren();
  for (const [k, v] of rows) {
    const dt = document.createElement("dt");
    dt.textContent = k;
    const dd = document.createElement("dd");
    dd.textContent = String(v);
    dl.append(dt, dd);
  }
}

function startTelemetry() {
  state.telemetry?.abort();
  const controller = new AbortController();
  state.telemetry = controller;
  const note = $("telemetry-state");
  (async () => {
    while (!controller.signal.aborted) {
      try {
        const r = await fetch(`/v1/telemetry/stream?interval=${TELEMETRY_INTERVAL_S}`,
                              { headers: headers(false), signal: controller.signal });
        if (r.status === 401) {
          note.textContent = "telemetry needs the API key";
          return;
        }
        if (!r.ok) throw await failure(r);
        note.textContent = `live, one sample every ${TELEMETRY_INTERVAL_S} s`;
        await readEvents(r, (name, data) => {
          if (name !== "telemetry") return;
          const sample = JSON.parse(data);
          state.charts.forEach((c) => c.push(sample));
          showReadout(sample);
        });
        note.textContent = "telemetry stream ended; reconnecting…";
      } catch (e) {
        if (controller.signal.aborted) return;
        note.textContent = `telemetry: ${e.message}; reconnecting…`;
      }
      await new Promise((resolve) => setTimeout(resolve, RECONNECT_MS));
    }
  })();
}

// --- start ------------------------------------------------------------------------------------------------------

setupCharts();
loadSettings();
state.currentId = state.conversations[0]?.id ?? null;
renderAll();
if (state.apiKey) $("api-key").value = state.apiKey;
connect().then((ok) => { if (ok) $("prompt").focus(); });
