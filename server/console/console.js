// Pagoda's console: reads /v1/engine/state/stream (server-sent events, with the API key when the
// server has one) and draws the KV block pool, the requests and their block tables, the steps,
// the latencies and the clients; the playground streams a chat from /v1/chat/completions.
"use strict";

const COLORS = ["#e8e8e8", "#4a90d9", "#8e44ad", "#9ccc65"];  // free, in use, shared, cached
const STATE_NAMES = ["free", "in use", "shared", "cached"];
const SELECTED = "#ff9800";
const $ = (id) => document.getElementById(id);

let key = localStorage.getItem("pagoda-api-key") || "";
let latest = null;
let selected = null;      // the request whose block table is shown
let playgroundId = null;  // the playground's request, selected while it runs

function headers(extra) {
  const h = Object.assign({}, extra || {});
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function setStatus(text, error) {
  $("status").textContent = text;
  $("status").classList.toggle("error", !!error);
}

function askForKey(message) {
  setStatus(message, true);
  $("key-form").hidden = false;
  $("key").focus();
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  key = $("key").value.trim();
  localStorage.setItem("pagoda-api-key", key);
  $("key-form").hidden = true;
  connect();
});

// -- the state stream ------------------------------------------------------------------------

// Calls onData with each server-sent event's data (its "data:" lines joined) until the body ends.
async function readEvents(response, onData) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, {stream: true});
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("");
      if (data) onData(data);
    }
  }
}

let stream = null;  // the state stream's AbortController: one stream at a time

function retry(message) {
  setStatus(message, true);
  setTimeout(connect, 2000);
}

async function connect() {
  if (stream !== null) stream.abort();
  const controller = stream = new AbortController();
  setStatus("connecting…");
  let response;
  try {
    response = await fetch("/v1/engine/state/stream?interval=0.25", {headers: headers(), signal: controller.signal});
  } catch (err) {
    if (!controller.signal.aborted) retry("server unreachable; retrying");
    return;
  }
  if (response.status === 401) {
    askForKey("this server needs its API key");
    return;
  }
  if (!response.ok) {
    retry("error " + response.status + "; retrying");
    return;
  }
  setStatus("live");
  try {
    await readEvents(response, (data) => render(JSON.parse(data)));
  } catch (err) {
    if (controller.signal.aborted) return;  // a newer stream took over
    console.warn("the state stream broke:", err);
  }
  if (!controller.signal.aborted) retry("disconnected; retrying");
}

// -- drawing --------------------------------------------------------------------------------

function render(state) {
  latest = state;
  $("model").textContent = state.model + (state.num_replicas > 1 ? ` (replica ${state.replica} of ${state.num_replicas})` : "");
  const plugins = state.policy.plugins.length ? ", plugins " + state.policy.plugins.join(", ") : "";
  $("policy").textContent = `scheduling ${state.policy.scheduling}, eviction ${state.policy.eviction}${plugins}`;
  drawGrid(state);
  drawRequests(state);
  drawBlockTable(state);
  drawSteps(state);
  drawLatency(state);
  drawClients(state);
}

function gridShape(n, canvas) {
  const columns = Math.max(1, Math.ceil(Math.sqrt(n * canvas.width / canvas.height)));
  const size = Math.max(1, Math.floor(canvas.width / columns));
  return {columns, size};
}

function drawGrid(state) {
  const canvas = $("grid");
  const ctx = canvas.getContext("2d");
  const blocks = state.kv.blocks;
  const {columns, size} = gridShape(blocks.length, canvas);
  const rows = Math.ceil(blocks.length / columns);
  if (canvas.height !== rows * size) canvas.height = Math.max(size, rows * size);
  const mine = new Set();
  const request = state.requests.find((r) => r.id === (selected || playgroundId));
  if (request) request.blocks.forEach((b) => mine.add(b));
  const counts = [0, 0, 0, 0];
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  const gap = size > 3 ? 1 : 0;
  for (let i = 0; i < blocks.length; i++) {
    counts[blocks[i]]++;
    ctx.fillStyle = mine.has(i) ? SELECTED : COLORS[blocks[i]];
    ctx.fillRect((i % columns) * size, Math.floor(i / columns) * size, size - gap, size - gap);
  }
  $("kv-counts").textContent =
    `${state.kv.num_blocks} blocks of ${state.kv.block_size} tokens: ` +
    `in use ${counts[1]} · shared ${counts[2]} · cached ${counts[3]} · free ${counts[0]}` +
    (state.kv.num_cpu_blocks ? ` · swap ${state.kv.num_cpu_blocks - state.kv.num_free_cpu_blocks}/${state.kv.num_cpu_blocks}` : "");
  $("kv-counts").dataset.used = String(counts[1] + counts[2]);
}

$("grid").addEventListener("mousemove", (event) => {
  if (!latest) return;
  const canvas = $("grid");
  const rect = canvas.getBoundingClientRect();
  const {columns, size} = gridShape(latest.kv.blocks.length, canvas);
  const x = (event.clientX - rect.left) * canvas.width / rect.width;
  const y = (event.clientY - rect.top) * canvas.height / rect.height;
  const index = Math.floor(y / size) * columns + Math.floor(x / size);
  const tip = $("tooltip");
  if (index < 0 || index >= latest.kv.blocks.length) { tip.hidden = true; return; }
  const owners = latest.requests.filter((r) => r.blocks.includes(index)).map((r) => r.id);
  tip.textContent = `block ${index}: ${STATE_NAMES[latest.kv.blocks[index]]}, refs ${latest.kv.ref_counts[index]}` +
    (owners.length ? " · " + owners.join(", ") : "");
  tip.style.left = event.clientX + 12 + "px";
  tip.style.top = event.clientY + 12 + "px";
  tip.hidden = false;
});
$("grid").addEventListener("mouseleave", () => { $("tooltip").hidden = true; });

function cell(row, text) {
  const td = document.createElement("td");
  td.textContent = text;
  row.appendChild(td);
  return td;
}

function drawRequests(state) {
  $("queue-counts").textContent = `${state.num_running} running, ${state.num_waiting} waiting; ` +
    `${state.stats.preemptions} preemptions, prefix cache ${state.stats.prefix_cache_hits}/${state.stats.prefix_cache_queries} tokens`;
  const body = $("requests").tBodies[0];
  body.replaceChildren();
  for (const r of state.requests) {
    const row = document.createElement("tr");
    row.dataset.id = r.id;
    if (r.id === selected) row.classList.add("selected");
    cell(row, r.id.length > 22 ? r.id.slice(0, 20) + "…" : r.id).title = r.id;
    cell(row, r.queue);
    cell(row, r.status);
    cell(row, r.priority);
    cell(row, r.client || "");
    cell(row, `${r.computed_tokens}/${r.prompt_tokens + r.output_tokens}`);
    cell(row, r.cached_tokens);
    cell(row, r.preemptions);
    cell(row, r.blocks.length + (r.swapped_blocks.length ? ` (+${r.swapped_blocks.length} swapped)` : ""));
    row.addEventListener("click", () => { selected = r.id; render(latest); });
    body.appendChild(row);
  }
}

function drawBlockTable(state) {
  const body = $("block-table").tBodies[0];
  body.replaceChildren();
  const id = selected || playgroundId;
  const request = state.requests.find((r) => r.id === id);
  $("selected-id").textContent = request ? request.id : id ? `${id} (finished)` : "(click a request)";
  if (!request) return;
  request.blocks.forEach((block, i) => {
    const row = document.createElement("tr");
    cell(row, i);
    cell(row, block);
    cell(row, state.kv.ref_counts[block]).className = "ref";
    cell(row, STATE_NAMES[state.kv.blocks[block]]);
    body.appendChild(row);
  });
  request.swapped_blocks.forEach((block, i) => {
    const row = document.createElement("tr");
    cell(row, request.blocks.length + i);
    cell(row, "cpu " + block);
    cell(row, "");
    cell(row, "swapped out");
    body.appendChild(row);
  });
}

function drawSteps(state) {
  const canvas = $("steps");
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  const steps = state.steps;
  const budget = state.budget.max_num_batched_tokens;
  const width = canvas.width / Math.max(steps.length, 60);
  steps.forEach((step, i) => {
    const [, , tokens, running] = step;
    const h = Math.min(1, tokens / budget) * (canvas.height - 2);
    ctx.fillStyle = "#4a90d9";
    ctx.fillRect(i * width, canvas.height - h, Math.max(1, width - 1), h);
    ctx.fillStyle = "#e67e22";
    const y = canvas.height - Math.min(1, running / state.budget.max_num_seqs) * (canvas.height - 2);
    ctx.fillRect(i * width, y - 1, Math.max(1, width - 1), 2);
  });
  const last = steps[steps.length - 1];
  const span = steps.length > 1 ? last[1] - steps[0][1] : 0;
  const rate = span > 0 ? steps.slice(1).reduce((sum, step) => sum + step[2], 0) / span : 0;
  $("step-summary").textContent = last
    ? `step ${last[0]}: ${last[2]} of ${budget} tokens (bars), ${last[3]} running of ${state.budget.max_num_seqs} ` +
      `(line); ${rate.toFixed(0)} tokens/s over the last ${steps.length} steps`
    : "no step yet";
}

function fmt(seconds) {
  return seconds === null ? "–" : seconds < 1 ? (seconds * 1000).toFixed(0) + " ms" : seconds.toFixed(2) + " s";
}

function drawLatency(state) {
  const l = state.latency;
  $("latency").textContent = `TTFT p50 ${fmt(l.ttft.p50)}, p90 ${fmt(l.ttft.p90)}, p99 ${fmt(l.ttft.p99)} · ` +
    `TPOT p50 ${fmt(l.tpot.p50)}, p90 ${fmt(l.tpot.p90)}, p99 ${fmt(l.tpot.p99)}`;
  const canvas = $("latency-plot");
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  const recent = l.recent;
  const top = Math.max(0.001, ...recent.map((r) => r[1] || 0));
  recent.forEach((r, i) => {
    const x = (i + 0.5) * canvas.width / Math.max(recent.length, 60);
    if (r[1] !== null) {
      ctx.fillStyle = "#4a90d9";
      ctx.fillRect(x - 2, canvas.height - r[1] / top * (canvas.height - 4) - 2, 4, 4);
    }
    if (r[2] !== null) {
      ctx.fillStyle = "#e67e22";
      ctx.fillRect(x - 2, canvas.height - Math.min(1, r[2] / top) * (canvas.height - 4) - 2, 4, 4);
    }
  });
}

function drawClients(state) {
  const body = $("clients").tBodies[0];
  body.replaceChildren();
  for (const [client, c] of Object.entries(state.clients)) {
    const row = document.createElement("tr");
    cell(row, client);
    cell(row, c.in_flight);
    cell(row, c.served_tokens === undefined ? "" : Math.round(c.served_tokens));
    body.appendChild(row);
  }
}

// -- the playground -------------------------------------------------------------------------

$("send").addEventListener("click", async () => {
  const answer = $("answer");
  answer.textContent = "";
  const body = {
    messages: [{role: "user", content: $("prompt").value}],
    temperature: Number($("temperature").value), max_tokens: Number($("max-tokens").value), stream: true,
  };
  let response;
  try {
    response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers({"Content-Type": "application/json"}), body: JSON.stringify(body),
    });
  } catch (err) {
    answer.textContent = "the server did not answer: " + err;
    return;
  }
  if (!response.ok) {
    const error = await response.json().catch(() => ({}));
    answer.textContent = "error " + response.status + ": " + ((error.error || {}).message || "");
    if (response.status === 401) askForKey("this server needs its API key");
    return;
  }
  playgroundId = response.headers.get("X-Request-Id");
  answer.dataset.requestId = playgroundId || "";
  await readEvents(response, (data) => {
    if (data === "[DONE]") return;
    for (const choice of JSON.parse(data).choices || []) answer.textContent += (choice.delta || {}).content || "";
  });
  answer.dataset.done = "true";
});

async function start() {
  const settings = await fetch("/console/settings").then((r) => r.json()).catch(() => ({}));
  if (settings.needs_key && !key) askForKey("this server needs its API key");
  else connect();
}

start();
