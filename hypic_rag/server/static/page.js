// hypic-rag's page: ask the index (streamed from POST /v1/ask), see the sources and what the cache saved, and look
// after the index's documents. Plain DOM, no framework, nothing fetched from elsewhere. Every string that comes
// from the server is inserted as text (textContent, createTextNode), never as markup.
"use strict";

const KEY_STORAGE = "hypic-rag-api-key";
const JOB_POLL_MS = 400;
const DOCUMENTS_PAGE = 100;

// ------------------------------------------------------------------------------------------------ small helpers
function byId(id) { return document.getElementById(id); }

/** An element with text content (never markup) and attributes. */
function el(tag, text, attributes) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  for (const [name, value] of Object.entries(attributes || {})) node.setAttribute(name, value);
  return node;
}

function fact(list, term, value) {
  list.append(el("dt", term), el("dd", value));
}

function milliseconds(ms) {
  return ms >= 1000 ? `${(ms / 1000).toFixed(2)} s` : `${Math.round(ms)} ms`;
}

function bytes(count) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = Number(count) || 0;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) { value /= 1024; unit += 1; }
  return `${value.toFixed(unit ? 1 : 0)} ${units[unit]}`;
}

function percent(part, whole) {
  return whole ? `${Math.round((100 * part) / whole)}%` : "0%";
}

// ------------------------------------------------------------------------------------------------ the API, with a key
// An optional API key, kept for this tab (sessionStorage) and sent as `Authorization: Bearer <key>`. A 401 (or a
// 403 on a write) shows the key field and the request is sent again with the key given there.
let keyWaiters = [];

function currentKey() { return sessionStorage.getItem(KEY_STORAGE) || ""; }

function askForKey(reason) {
  byId("key-reason").textContent = reason;
  byId("key-panel").hidden = false;
  byId("key-input").focus();
  return new Promise((resolve) => keyWaiters.push(resolve));
}

function keyGiven(event) {
  event.preventDefault();
  const key = byId("key-input").value.trim();
  if (!key) return;
  sessionStorage.setItem(KEY_STORAGE, key);
  byId("key-input").value = "";
  byId("key-panel").hidden = true;
  const waiting = keyWaiters;
  keyWaiters = [];
  waiting.forEach((resolve) => resolve());
}

async function errorText(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return `${response.status}: ${body.error.message}`;
  } catch (ignored) { /* not JSON */ }
  return `${response.status} ${response.statusText}`;
}

/** fetch `path` with the key (when one is set); asks for a key on 401, or 403 for a write, and tries again. */
async function api(path, init = {}) {
  for (;;) {
    const headers = new Headers(init.headers || {});
    const key = currentKey();
    if (key) headers.set("Authorization", `Bearer ${key}`);
    const response = await fetch(path, { ...init, headers });
    const write = init.method && init.method !== "GET";
    if (response.status === 401 || (response.status === 403 && write)) {
      const why = await errorText(response);
      await askForKey(key ? `The key was refused (${why}). Enter another.` : `This server needs a key (${why}).`);
      continue;
    }
    return response;
  }
}

async function apiJson(path, init) {
  const response = await api(path, init);
  if (!response.ok) throw new Error(await errorText(response));
  return response.json();
}

/** Server-sent events of a streamed response: calls onEvent(object) per `data:` line until `[DONE]`, then reads
 * the response to its end (a body left unread would hold its connection, and the browser has few per server). */
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let finished = false;
  for (;;) {
    const { value, done } = await reader.read();
    if (finished) { if (done) return; continue; }
    buffer += decoder.decode(value || new Uint8Array(), { stream: !done });
    let end;
    while (!finished && (end = buffer.indexOf("\n\n")) >= 0) {
      const frame = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of frame.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") { finished = true; break; }
        onEvent(JSON.parse(data));
      }
    }
    if (done) return;
  }
}

// ------------------------------------------------------------------------------------------------ asking
function answerCard(mode) {
  const card = byId("answer-template").content.firstElementChild.cloneNode(true);
  card.id = `answer-${mode}`;
  card.dataset.mode = mode;
  const title = mode === "full" ? "full: every token recomputed" : "hypic: chunks read from the cache";
  card.querySelector(".mode").textContent = title;
  card.setAttribute("aria-label", `Answer (${mode})`);
  return card;
}

function showSources(card, sources) {
  const list = card.querySelector(".sources");
  list.textContent = "";
  for (const source of sources) {
    const item = el("li", null, { "data-chunk-id": source.chunk_id });
    const head = el("div");
    head.append(el("strong", `${source.rank}. ${source.doc_id}`), " ",
                el("span", `score ${Number(source.score).toFixed(3)}`, { class: "score" }));
    if (source.hop) head.append(" ", el("span", "(found by the retrieval hop)", { class: "muted" }));
    if (source.neighbour_of) {
      const bringer = sources.find((other) => other.chunk_id === source.neighbour_of);
      const by = bringer ? `source ${bringer.rank}` : `chunk ${source.neighbour_of}`;
      head.append(" ", el("span", `(brought as the neighbour of ${by} in its document)`, { class: "muted" }));
    }
    const details = el("details");
    details.append(el("summary", "Chunk text"), el("pre", source.text, { class: "chunk" }));
    item.append(head, details);
    list.append(item);
  }
}

function partLabel(part, sourcesById) {
  if (part.part === "prefix") return "prompt prefix";
  if (part.part === "question") return "question";
  const source = sourcesById.get(part.chunk_id);
  return source ? `source ${source.rank}: ${source.doc_id}` : `chunk ${part.chunk_id}`;
}

function partSummary(part) {
  const { tokens, recomputed_tokens: recomputed } = part;
  if (part.part === "question") return `${tokens} tokens, recomputed`;
  if (recomputed === tokens) return `${tokens} tokens, recomputed${part.part === "chunk" ? " whole" : ""}`;
  const what = part.part === "chunk" && recomputed ? `first ${recomputed} recomputed (seam)` : "none recomputed";
  const read = part.cached_tokens ? `${part.cached_tokens} from the cache` : "";
  const encoded = part.encoded_tokens ? `${part.encoded_tokens} encoded now` : "";
  return [`${tokens} tokens`, what, read, encoded].filter(Boolean).join(", ");
}

function showPrompt(card, parts, sources) {
  const list = card.querySelector(".prompt");
  list.textContent = "";
  const sourcesById = new Map(sources.map((source) => [source.chunk_id, source]));
  const longest = Math.max(1, ...parts.map((part) => part.tokens));
  for (const part of parts) {
    const item = el("li", null, { "data-part": part.part });
    const bar = el("div", null, { class: "bar", "aria-hidden": "true" });
    bar.style.width = `${Math.max(1, (100 * part.tokens) / longest)}%`;
    for (const [kind, count] of [["recomputed", part.recomputed_tokens], ["cached", part.cached_tokens],
                                 ["encoded", part.encoded_tokens]]) {
      if (!count) continue;
      const piece = el("span", null, { class: kind });
      piece.style.width = `${(100 * count) / part.tokens}%`;
      bar.append(piece);
    }
    item.append(el("div", `${partLabel(part, sourcesById)}: ${partSummary(part)}`), bar);
    list.append(item);
  }
}

function showNumbers(card, done, clientFirstTokenMs) {
  const list = card.querySelector(".numbers");
  list.textContent = "";
  const { usage, timings } = done;
  const reused = usage.cached_tokens + usage.encoded_tokens;
  fact(list, "Time to first token", milliseconds(timings.time_to_first_token_ms));
  fact(list, "Total", milliseconds(timings.total_ms));
  if (clientFirstTokenMs !== null) fact(list, "First token on this page", milliseconds(clientFirstTokenMs));
  fact(list, "Prompt tokens", String(usage.prompt_tokens));
  fact(list, "Read from the cache", `${usage.cached_tokens} (${percent(usage.cached_tokens, usage.prompt_tokens)})`);
  if (usage.encoded_tokens) fact(list, "Encoded now, then cached", String(usage.encoded_tokens));
  fact(list, "Recomputed", `${usage.recomputed_tokens} (${percent(usage.recomputed_tokens, usage.prompt_tokens)})`);
  fact(list, "Answer tokens", String(usage.completion_tokens));
  if (done.recompute_policy) fact(list, "Recompute policy", done.recompute_policy);
  list.dataset.reused = String(reused);
}

/** Ask `question` in `mode`, streaming into `card`; resolves when the answer is complete (or failed). */
async function askInto(card, body) {
  const text = card.querySelector(".answer-text");
  text.setAttribute("aria-busy", "true");
  const began = performance.now();
  let firstTokenMs = null;
  let sources = [];
  try {
    const response = await api("/v1/ask", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
    });
    if (!response.ok) throw new Error(await errorText(response));
    await readEvents(response, (event) => {
      if (event.type === "sources") {
        sources = event.sources;
        showSources(card, sources);
      } else if (event.type === "token") {
        if (firstTokenMs === null) firstTokenMs = performance.now() - began;
        text.append(document.createTextNode(event.text));
      } else if (event.type === "done") {
        text.textContent = event.answer;  // the tokens add up to it; set whole so the node is one text
        card.querySelector(".note").textContent = event.note || "";
        showNumbers(card, event, firstTokenMs);
        showPrompt(card, event.prompt_parts || [], sources);
        card.dataset.done = "true";
      } else if (event.type === "error") {
        throw new Error(event.error && event.error.message ? event.error.message : "the answer failed");
      }
    });
    if (card.dataset.done !== "true") throw new Error("the stream ended before the answer was complete");
  } catch (error) {
    text.classList.add("error");
    text.textContent = `Error: ${error.message}`;
    card.dataset.done = "error";
  } finally {
    text.setAttribute("aria-busy", "false");
  }
}

async function ask(event) {
  event.preventDefault();
  const question = byId("question").value.trim();
  if (!question) return;
  const button = byId("ask-button");
  const status = byId("ask-status");
  const answers = byId("answers");
  const modes = byId("compare").checked ? ["hypic", "full"] : ["hypic"];
  const body = { question, stream: true, temperature: 0,
                 top_k: Number(byId("top-k").value) || 4, max_new_tokens: Number(byId("max-new-tokens").value) || 48 };
  button.disabled = true;
  status.textContent = "Answering…";
  answers.textContent = "";
  const cards = modes.map(answerCard);
  answers.append(...cards);
  // side by side: both stream at once; each is an ordinary request, bounded by the server's limits
  await Promise.all(cards.map((card, number) => askInto(card, { ...body, mode: modes[number] })));
  status.textContent = "Done.";
  button.disabled = false;
}

// ------------------------------------------------------------------------------------------------ the index
let documentsShown = 0;
let readOnly = true;

async function loadIndex() {
  const facts = byId("index-facts");
  byId("documents").dataset.loaded = "false";  // "true" once the table is filled again
  try {
    const [stats, health] = await Promise.all([apiJson("/v1/cache/stats"), apiJson("/healthz")]);
    readOnly = Boolean(health.read_only);
    facts.textContent = "";
    const cache = stats.cache || {};
    fact(facts, "Model", health.model);
    fact(facts, "Documents", String(stats.index.documents));
    fact(facts, "Chunks", String(stats.index.chunks));
    fact(facts, "Chunk tokens", String(stats.index.tokens));
    if (cache.disabled) fact(facts, "Cache", `disabled: ${cache.disabled}`);
    if (cache.entries !== undefined) fact(facts, "Cache entries", String(cache.entries));
    if (cache.value_bytes !== undefined) {
      fact(facts, "Cache size", `${bytes(cache.value_bytes)} (linear state ${bytes(cache.linear_bytes)}, `
        + `attention K/V ${bytes(cache.kv_bytes)})`);
    }
    if (cache.cache_format) fact(facts, "Cache format", cache.cache_format);
    const answering = stats.answering || ((stats.replicas || [])[0] || {}).answering;  // a front: its replicas'
    if (answering) {
      const origins = { serve: "set by serve --recompute-policy", calibration: "calibrated (hypic-rag calibrate)",
                        default: "the fixed seam (not calibrated)" };
      fact(facts, "Recompute policy",
           `${answering.recompute_policy}, ${origins[answering.policy_from] || answering.policy_from}`);
    }
    const tokens = (stats.server || {}).tokens || {};
    if (tokens.prompt) {
      fact(facts, "Prompt tokens read from the cache (this server)",
           `${tokens.cached} of ${tokens.prompt} (${percent(tokens.cached, tokens.prompt)})`);
    }
    byId("served").textContent = `${health.model} · ${stats.index.documents} documents`;
  } catch (error) {
    facts.textContent = "";
    fact(facts, "Error", error.message);
  }
  byId("upload").hidden = readOnly;
  byId("documents-note").textContent = readOnly
    ? "This server opened its index read-only: documents cannot be added or removed here." : "";
  byId("documents").querySelector("tbody").textContent = "";
  documentsShown = 0;
  await loadDocuments();
}

async function loadDocuments() {
  const body = byId("documents").querySelector("tbody");
  const more = byId("more-documents");
  try {
    const page = await apiJson(`/v1/documents?offset=${documentsShown}&limit=${DOCUMENTS_PAGE}`);
    for (const documentRow of page.documents) {
      const row = el("tr");
      row.dataset.docId = documentRow.doc_id;
      const name = el("td", documentRow.doc_id);
      if (documentRow.source && documentRow.source !== documentRow.doc_id) {
        name.append(el("div", documentRow.source, { class: "muted" }));
      }
      const actions = el("td");
      if (!readOnly) {
        const remove = el("button", "Remove", { type: "button", "aria-label": `Remove ${documentRow.doc_id}` });
        remove.addEventListener("click", () => removeDocument(documentRow.doc_id, remove));
        actions.append(remove);
      }
      row.append(name, el("td", String(documentRow.chunks), { class: "number" }),
                 el("td", String(documentRow.tokens), { class: "number" }), actions);
      body.append(row);
    }
    documentsShown += page.documents.length;
    more.hidden = documentsShown >= page.total;
  } catch (error) {
    byId("documents-note").textContent = `Documents could not be listed: ${error.message}`;
  }
  byId("documents").dataset.loaded = "true";
}

async function removeDocument(docId, button) {
  if (button.dataset.armed !== "true") {  // a second press removes: one stray key press never does
    button.dataset.armed = "true";
    button.textContent = "Press again to remove";
    setTimeout(() => { button.dataset.armed = "false"; button.textContent = "Remove"; }, 5000);
    return;
  }
  button.disabled = true;
  const status = byId("job-status");
  byId("job").hidden = false;
  try {
    const result = await apiJson(`/v1/documents/${encodeURIComponent(docId).replace(/%2F/g, "/")}`,
                                 { method: "DELETE" });
    status.textContent = `Removed ${result.doc_id} (${result.chunks_removed} chunks).`;
  } catch (error) {
    status.textContent = `Could not remove ${docId}: ${error.message}`;
  }
  await loadIndex();
}

/** Add `documents` ([{id, text}]) and follow the job's progress until it ends. */
async function addDocuments(documents) {
  const box = byId("job");
  const bar = byId("job-progress");
  const status = byId("job-status");
  box.hidden = false;
  bar.value = 0;
  status.textContent = `Sending ${documents.length} document(s)…`;
  try {
    const accepted = await apiJson("/v1/documents", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ documents }),
    });
    for (;;) {
      const job = await apiJson(accepted.status_url);
      const progress = job.progress || {};
      const steps = (progress.documents_total || 0) + (progress.chunks_total || 0);
      const doneSteps = (progress.documents_indexed || 0) + (progress.chunks_encoded || 0);
      bar.max = Math.max(steps, 1);
      bar.value = doneSteps;
      status.textContent = `${job.status}: ${progress.documents_indexed || 0} of ${progress.documents_total || 0} `
        + `documents indexed, ${progress.chunks_encoded || 0} of ${progress.chunks_total || 0} chunks cached`;
      if (["succeeded", "failed", "cancelled"].includes(job.status)) {
        if (job.error) status.textContent += ` (${job.error})`;
        break;
      }
      await new Promise((resolve) => setTimeout(resolve, JOB_POLL_MS));
    }
  } catch (error) {
    status.textContent = `Could not add the documents: ${error.message}`;
  }
  await loadIndex();
}

async function uploadFiles(event) {
  event.preventDefault();
  const files = Array.from(byId("files").files);
  if (!files.length) { byId("files").focus(); return; }
  const documents = await Promise.all(files.map(async (file) => ({ id: file.name, text: await file.text() })));
  byId("files").value = "";
  await addDocuments(documents);
}

async function uploadText(event) {
  event.preventDefault();
  const id = byId("doc-id").value.trim();
  const text = byId("doc-text").value;
  if (!id || !text.trim()) return;
  await addDocuments([{ id, text }]);
}

// ------------------------------------------------------------------------------------------------ panels
function showPanel(name) {
  for (const other of ["ask", "index"]) {
    byId(`panel-${other}`).hidden = other !== name;
    byId(`tab-${other}`).setAttribute("aria-pressed", String(other === name));
  }
  if (name === "index") loadIndex();
}

document.addEventListener("DOMContentLoaded", () => {
  byId("key-form").addEventListener("submit", keyGiven);
  byId("ask-form").addEventListener("submit", ask);
  byId("tab-ask").addEventListener("click", () => showPanel("ask"));
  byId("tab-index").addEventListener("click", () => showPanel("index"));
  byId("refresh-index").addEventListener("click", loadIndex);
  byId("more-documents").addEventListener("click", loadDocuments);
  byId("upload-files").addEventListener("submit", uploadFiles);
  byId("upload-text").addEventListener("submit", uploadText);
  apiJson("/healthz").then((health) => {
    byId("served").textContent = `${health.model} · ${health.documents} documents`;
  }).catch(() => { byId("served").textContent = "The server is not ready yet."; });
  document.body.dataset.ready = "true";
});
