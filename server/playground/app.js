// The playground: a chat streamed from /v1/chat/completions and a live panel fed by /metrics.
"use strict";

(() => {
  const STORE_KEY = "flashdecode-playground:v1";
  const KEY_STORE = "flashdecode-playground:api-key";
  const EXPORT_FORMAT = "flashdecode-playground-conversation";
  const POLL_MS = 1000;
  const RATE_WINDOW_S = 60;
  const ROLES = new Set(["system", "user", "assistant"]);
  const SETTINGS = ["system", "temperature", "top_p", "top_k", "max_tokens", "seed", "stop_strings"];

  const $ = (id) => document.getElementById(id);
  const md = window.markdownit({ html: false, linkify: true, typographer: false });
  // Links from model output open elsewhere and pass nothing along.
  const defaultLinkOpen = md.renderer.rules.link_open ||
    ((tokens, i, options, env, self) => self.renderToken(tokens, i, options));
  md.renderer.rules.link_open = (tokens, i, options, env, self) => {
    tokens[i].attrSet("target", "_blank");
    tokens[i].attrSet("rel", "noopener noreferrer nofollow");
    return defaultLinkOpen(tokens, i, options, env, self);
  };

  const state = {
    model: null,
    messages: [],          // {role, content, stats?, error?}
    apiKey: sessionStorage.getItem(KEY_STORE) || "",
    controller: null,      // AbortController of the answer being streamed
    rates: [],             // [seconds, sampled tokens counter] from /metrics
  };

  // ---- persistence -------------------------------------------------------------------------
  function save() {
    const settings = {};
    for (const id of SETTINGS) settings[id] = $(id).value;
    try {
      localStorage.setItem(STORE_KEY, JSON.stringify({ messages: state.messages, settings }));
    } catch (err) {
      setStatus(`Could not keep the conversation in this browser: ${err.message}`);
    }
  }

  function load() {
    let saved;
    try {
      saved = JSON.parse(localStorage.getItem(STORE_KEY) || "null");
    } catch {
      saved = null;
    }
    if (!saved) return;
    if (Array.isArray(saved.messages)) state.messages = saved.messages.filter(validMessage);
    for (const id of SETTINGS) {
      if (saved.settings && typeof saved.settings[id] === "string") $(id).value = saved.settings[id];
    }
  }

  function validMessage(m) {
    return m && typeof m === "object" && ROLES.has(m.role) && typeof m.content === "string";
  }

  // ---- rendering ---------------------------------------------------------------------------
  function renderAll() {
    const box = $("messages");
    box.querySelectorAll(".msg").forEach((el) => el.remove());
    for (const m of state.messages) box.appendChild(messageElement(m));
    $("empty-note").hidden = state.messages.length > 0;
    updateButtons();
    scrollToEnd();
  }

  function messageElement(m) {
    const el = document.createElement("article");
    el.className = `msg ${m.role}${m.error ? " error" : ""}`;
    const who = document.createElement("h3");
    who.className = "who";
    who.textContent = m.error ? "Error" : m.role === "user" ? "You" : state.model || "Assistant";
    const body = document.createElement("div");
    body.className = "content";
    el.append(who, body);
    fillContent(body, m);
    if (m.stats && Object.keys(m.stats).length) el.appendChild(statsElement(m.stats));
    return el;
  }

  function fillContent(body, m) {
    if (m.role === "assistant" && !m.error) {
      body.innerHTML = md.render(m.content);   // markdown-it escapes all HTML (html: false)
    } else {
      body.textContent = m.content;
    }
  }

  function statsElement(s) {
    const el = document.createElement("p");
    el.className = "stats";
    const parts = [];
    if (s.ttft_ms != null) parts.push(`TTFT ${fmtMs(s.ttft_ms)}`);
    if (s.tokens_per_s != null) parts.push(`${s.tokens_per_s.toFixed(1)} tok/s`);
    if (s.completion_tokens != null) parts.push(`${s.completion_tokens} tokens`);
    if (s.prompt_tokens != null) parts.push(`prompt ${s.prompt_tokens} (${s.cached_tokens || 0} cached)`);
    if (s.finish_reason) parts.push(`finish: ${s.finish_reason}`);
    for (const text of parts) {
      const span = document.createElement("span");
      span.textContent = text;
      el.append(span, " ");   // the space separates them for screen readers and copied text
    }
    return el;
  }

  function fmtMs(ms) {
    return ms < 1000 ? `${Math.round(ms)} ms` : `${(ms / 1000).toFixed(2)} s`;
  }

  function scrollToEnd() {
    const box = $("messages");
    box.scrollTop = box.scrollHeight;
  }

  function setStatus(text) {
    $("status").textContent = text;
  }

  function updateButtons() {
    const busy = state.controller !== null;
    $("messages").setAttribute("aria-busy", String(busy));   // read the answer once, not every token
    $("send").disabled = busy;
    $("stop").disabled = !busy;
    $("regenerate").disabled = busy || !state.messages.some((m) => m.role === "user");
  }

  // ---- requests ----------------------------------------------------------------------------
  function authHeaders() {
    return state.apiKey ? { Authorization: `Bearer ${state.apiKey}` } : {};
  }

  async function errorMessage(response) {
    let text = "";
    try {
      text = await response.text();
      const body = JSON.parse(text);
      const err = body.error;
      if (err && typeof err === "object") return `${response.status}: ${err.message}`;
      if (typeof err === "string") return `${response.status}: ${err}`;
    } catch {
      // not JSON: the text itself
    }
    return `${response.status} ${response.statusText}${text ? `: ${text.slice(0, 300)}` : ""}`;
  }

  function numberField(id, parse) {
    const raw = $(id).value.trim();
    if (raw === "") return undefined;
    const value = parse(raw);
    return Number.isNaN(value) ? raw : value;   // the server names what is wrong with it
  }

  function requestBody() {
    const messages = [];
    const system = $("system").value.trim();
    if (system) messages.push({ role: "system", content: system });
    for (const m of state.messages) {
      if (!m.error) messages.push({ role: m.role, content: m.content });
    }
    const body = {
      model: state.model || "default",
      messages,
      stream: true,
      stream_options: { include_usage: true },
      temperature: numberField("temperature", Number),
      top_p: numberField("top_p", Number),
      top_k: numberField("top_k", Number),
      max_tokens: numberField("max_tokens", Number),
      seed: numberField("seed", Number),
    };
    const stops = $("stop_strings").value.split("\n").filter((s) => s.length > 0);
    if (stops.length) body.stop = stops;
    return body;
  }

  // Yields each parsed `data:` payload of a server-sent event stream.
  async function* sseEvents(response) {
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value.replace(/\r\n?/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = event.split("\n").filter((l) => l.startsWith("data:"))
          .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
        if (data === "[DONE]") return;
        if (data) yield JSON.parse(data);
      }
    }
  }

  async function answer() {
    const controller = new AbortController();
    state.controller = controller;
    updateButtons();
    const request = JSON.stringify(requestBody());
    const reply = { role: "assistant", content: "", stats: {} };
    state.messages.push(reply);
    $("empty-note").hidden = true;
    const el = messageElement(reply);
    el.classList.add("streaming");
    $("messages").appendChild(el);
    scrollToEnd();
    const body = el.querySelector(".content");
    const started = performance.now();
    let first = null;
    let last = null;
    let received = 0;      // chunks with text: one per token (tokens that print nothing send none)
    let pending = false;
    const paint = () => {
      pending = false;
      fillContent(body, reply);
      scrollToEnd();
    };
    setStatus("Generating…");
    try {
      const response = await fetch("/v1/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json", ...authHeaders() },
        body: request,
        signal: controller.signal,
      });
      if (!response.ok) {
        if (response.status === 401) askForKey("The server refused the key (401).");
        throw new Error(await errorMessage(response));
      }
      for await (const chunk of sseEvents(response)) {
        if (chunk.error) throw new Error(chunk.error.message || String(chunk.error));
        const choice = chunk.choices && chunk.choices[0];
        if (choice) {
          const text = choice.delta && choice.delta.content;
          if (text) {
            const now = performance.now();
            if (first === null) {
              first = now;
              reply.stats.ttft_ms = now - started;
            }
            last = now;
            received += 1;
            reply.content += text;
            if (!pending) {
              pending = true;
              requestAnimationFrame(paint);
            }
          }
          if (choice.finish_reason) reply.stats.finish_reason = choice.finish_reason;
        }
        if (chunk.usage) {
          reply.stats.prompt_tokens = chunk.usage.prompt_tokens;
          reply.stats.completion_tokens = chunk.usage.completion_tokens;
          const details = chunk.usage.prompt_tokens_details;
          reply.stats.cached_tokens = details ? details.cached_tokens : 0;
        }
      }
      setStatus("Answer complete.");
    } catch (err) {
      if (controller.signal.aborted) {
        reply.stats.finish_reason = "stopped";
        setStatus("Stopped.");
      } else {
        state.messages.pop();
        if (reply.content) state.messages.push(reply);
        state.messages.push({ role: "assistant", content: err.message, error: true });
        setStatus(`Error: ${err.message}`);
      }
    } finally {
      if (reply.stats.completion_tokens == null && received) reply.stats.completion_tokens = received;
      const n = reply.stats.completion_tokens;
      if (first !== null && last > first && n > 1) {
        reply.stats.tokens_per_s = (n - 1) / ((last - first) / 1000);
      }
      state.controller = null;
      save();
      renderAll();
      $("prompt").focus();
    }
  }

  function send() {
    const text = $("prompt").value;
    if (!text.trim() || state.controller) return;
    state.messages.push({ role: "user", content: text });
    $("prompt").value = "";
    renderAll();
    save();
    answer();
  }

  function regenerate() {
    if (state.controller) return;
    while (state.messages.length && state.messages[state.messages.length - 1].role !== "user") {
      state.messages.pop();
    }
    if (!state.messages.length) return;
    renderAll();
    answer();
  }

  function stop() {
    if (state.controller) state.controller.abort();
  }

  // ---- import / export ---------------------------------------------------------------------
  function exportConversation() {
    const settings = {};
    for (const id of SETTINGS) settings[id] = $(id).value;
    const doc = { format: EXPORT_FORMAT, version: 1, model: state.model, exported: new Date().toISOString(),
                  settings, messages: state.messages };
    const blob = new Blob([JSON.stringify(doc, null, 2)], { type: "application/json" });
    const link = document.createElement("a");
    link.href = URL.createObjectURL(blob);
    link.download = `conversation-${new Date().toISOString().replace(/[:.]/g, "-")}.json`;
    document.body.appendChild(link);
    link.click();
    link.remove();
    setTimeout(() => URL.revokeObjectURL(link.href), 1000);
  }

  async function importConversation(file) {
    try {
      const doc = JSON.parse(await file.text());
      const messages = Array.isArray(doc) ? doc : doc && doc.messages;
      if (!Array.isArray(messages) || !messages.every(validMessage)) {
        throw new Error("expected {\"messages\": [{\"role\": ..., \"content\": ...}]} with roles system, user or assistant");
      }
      stop();
      const system = messages.filter((m) => m.role === "system").map((m) => m.content).join("\n");
      if (system) $("system").value = system;
      if (doc.settings && typeof doc.settings === "object") {
        for (const id of SETTINGS) {
          if (id !== "system" && typeof doc.settings[id] === "string") $(id).value = doc.settings[id];
        }
      }
      state.messages = messages.filter((m) => m.role !== "system").map((m) => ({
        role: m.role, content: m.content, ...(m.error ? { error: true } : {}),
        ...(m.stats && typeof m.stats === "object" ? { stats: cleanStats(m.stats) } : {}),
      }));
      save();
      renderAll();
      setStatus(`Imported ${state.messages.length} messages.`);
    } catch (err) {
      setStatus(`Import failed: ${err.message}`);
    }
  }

  function cleanStats(s) {
    const out = {};
    for (const k of ["ttft_ms", "tokens_per_s", "completion_tokens", "prompt_tokens", "cached_tokens"]) {
      if (typeof s[k] === "number" && Number.isFinite(s[k])) out[k] = s[k];
    }
    if (typeof s.finish_reason === "string") out.finish_reason = s.finish_reason.slice(0, 40);
    return out;
  }

  // ---- API key -----------------------------------------------------------------------------
  function askForKey(reason) {
    const dialog = $("key-dialog");
    if (dialog.open) return;
    $("key-reason").textContent = reason || "This server asks for an API key. It is kept for this browser tab only.";
    $("api-key").value = state.apiKey;
    dialog.showModal();
  }

  function keyDialogClosed() {
    if ($("key-dialog").returnValue !== "save") return;
    state.apiKey = $("api-key").value.trim();
    if (state.apiKey) sessionStorage.setItem(KEY_STORE, state.apiKey);
    else sessionStorage.removeItem(KEY_STORE);
    loadModel();
  }

  // ---- model and live metrics --------------------------------------------------------------
  async function loadModel() {
    try {
      const response = await fetch("/v1/models", { headers: authHeaders() });
      if (response.status === 401) {
        $("model-name").textContent = "API key needed";
        setHealth("warn");
        askForKey();
        return;
      }
      if (response.status === 503) {
        $("model-name").textContent = "loading the model…";
        setHealth("warn");
        setTimeout(loadModel, 2000);
        return;
      }
      if (!response.ok) throw new Error(await errorMessage(response));
      const models = await response.json();
      state.model = models.data[0].id;
      const card = models.data[0];
      $("model-name").textContent = card.max_model_len ? `${state.model} · ${card.max_model_len} tokens context`
        : state.model;
      setHealth("ok");
      renderAll();
    } catch (err) {
      $("model-name").textContent = `not ready: ${err.message}`;
      setHealth("bad");
      setTimeout(loadModel, 3000);
    }
  }

  function setHealth(kind) {
    $("health-dot").className = `dot ${kind}`;
  }

  // Sum of the samples of each metric name in Prometheus' text format, labels ignored.
  function parsePrometheus(text) {
    const values = new Map();
    for (const line of text.split("\n")) {
      if (!line || line.startsWith("#")) continue;
      const match = /^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)/.exec(line);
      if (!match) continue;
      const value = Number(match[3]);
      if (Number.isFinite(value)) values.set(match[1], (values.get(match[1]) || 0) + value);
    }
    return values;
  }

  async function pollMetrics() {
    if (document.visibilityState === "visible") {
      try {
        const response = await fetch("/metrics", { headers: authHeaders() });
        if (response.ok) {
          showMetrics(parsePrometheus(await response.text()));
          $("metrics-note").textContent = "From /metrics, polled every second.";
        } else {
          $("metrics-note").textContent = `/metrics answered ${response.status}.`;
        }
      } catch (err) {
        $("metrics-note").textContent = `/metrics unreachable: ${err.message}`;
      }
    }
    setTimeout(pollMetrics, POLL_MS);
  }

  function showMetrics(m) {
    const get = (name) => m.get(name);
    const running = get("llm_num_requests_running");
    if (running === undefined) {
      $("metrics-note").textContent = "The model is still loading.";
      return;
    }
    $("m-running").textContent = String(running);
    $("m-waiting").textContent = String(get("llm_num_requests_waiting"));
    const total = get("llm_kv_cache_blocks_total") || 0;
    const used = get("llm_kv_cache_blocks_used") || 0;
    const cached = get("llm_kv_cache_blocks_cached") || 0;
    $("m-kv").textContent = `${pct(used, total)} · ${used} / ${total} blocks`;
    $("m-kv-detail").textContent = cached ? `+${cached} cached` : "";
    $("m-kv-used").style.width = pct(used, total);
    $("m-kv-cached").style.width = pct(cached, total);
    const queries = get("llm_prefix_cache_queries_tokens_total") || 0;
    const hits = get("llm_prefix_cache_hits_tokens_total") || 0;
    $("m-hits").textContent = queries ? `${pct(hits, queries)} of ${queries} prompt tokens` : "no prompts yet";

    const now = performance.now() / 1000;
    const sampled = get("llm_sampled_tokens_total");
    if (sampled === undefined) return;
    const rates = state.rates;
    if (rates.length && sampled < rates[rates.length - 1][1]) rates.length = 0;   // the server restarted
    rates.push([now, sampled]);
    while (rates.length > 2 && rates[0][0] < now - RATE_WINDOW_S - 1) rates.shift();
    drawRates();
  }

  function pct(part, whole) {
    return whole ? `${((100 * part) / whole).toFixed(1)}%` : "0%";
  }

  // Tokens per second between consecutive polls, drawn as a line over the last minute.
  function drawRates() {
    const rates = state.rates;
    const points = [];
    for (let i = 1; i < rates.length; i++) {
      const dt = rates[i][0] - rates[i - 1][0];
      if (dt > 0) points.push([rates[i][0], (rates[i][1] - rates[i - 1][1]) / dt]);
    }
    if (!points.length) return;
    const current = points[points.length - 1][1];
    const peak = Math.max(...points.map((p) => p[1]));
    $("m-rate").textContent = current.toFixed(1);
    $("m-rate-peak").textContent = `peak ${peak.toFixed(1)} in the last minute`;
    const svg = $("rate-chart");
    const W = 240, H = 60, pad = 3;
    const now = rates[rates.length - 1][0];
    const top = Math.max(peak, 1);
    const xy = points.map(([t, r]) => [
      W - ((now - t) / RATE_WINDOW_S) * W,
      H - pad - (r / top) * (H - 2 * pad),
    ]).filter(([x]) => x >= 0);
    const ns = "http://www.w3.org/2000/svg";
    svg.replaceChildren();
    if (!xy.length) return;
    const line = xy.map(([x, y]) => `${x.toFixed(1)},${y.toFixed(1)}`).join(" ");
    const area = document.createElementNS(ns, "polygon");
    area.setAttribute("points", `${xy[0][0].toFixed(1)},${H} ${line} ${W},${H}`);
    area.setAttribute("class", "area");
    const path = document.createElementNS(ns, "polyline");
    path.setAttribute("points", line);
    path.setAttribute("class", "line");
    svg.append(area, path);
  }

  // ---- wiring ------------------------------------------------------------------------------
  function wire() {
    $("composer").addEventListener("submit", (e) => {
      e.preventDefault();
      send();
    });
    $("prompt").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
        e.preventDefault();
        send();
      }
    });
    document.addEventListener("keydown", (e) => {
      if (e.key === "Escape" && state.controller && !$("key-dialog").open) stop();
    });
    $("stop").addEventListener("click", stop);
    $("regenerate").addEventListener("click", regenerate);
    $("new-chat").addEventListener("click", () => {
      stop();
      state.messages = [];
      save();
      renderAll();
      setStatus("New conversation.");
      $("prompt").focus();
    });
    $("export").addEventListener("click", exportConversation);
    $("import").addEventListener("click", () => $("import-file").click());
    $("import-file").addEventListener("change", (e) => {
      const file = e.target.files[0];
      if (file) importConversation(file);
      e.target.value = "";
    });
    $("settings").addEventListener("input", save);
    $("settings").addEventListener("submit", (e) => e.preventDefault());
    $("key-button").addEventListener("click", () => askForKey());
    $("key-dialog").addEventListener("close", keyDialogClosed);
  }

  load();
  wire();
  renderAll();
  loadModel();
  pollMetrics();
})();
