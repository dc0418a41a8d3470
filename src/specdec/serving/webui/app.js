// specdec's chat page: talks to this server only (/props, /v1/models, /v1/chat/completions), streams answers with
// token_sources, colours each piece by the proposer of its tokens. Text from the model and the user is only ever
// put in the page with textContent / createTextNode: never parsed as HTML.
"use strict";

(() => {
  const SOURCES = ["draft", "suffix", "lookup", "target"]; // the legend; another name shows as "other"
  const TARGET_ONLY = "target-only";
  const DEFAULT = "default";

  const state = {
    conversations: [], // {id, title, messages: [{role, content, spans: [[text, source]], stats, error}]}
    current: null,
    running: null, // the AbortController of the answer streaming now
    props: null,
    loading: false, // the server answered 503 "Loading model": the page asks again until it answers
    nextId: 1,
  };

  const $ = (id) => document.getElementById(id);

  function element(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function sourceClass(source) {
    if (source === null) return "tok src-none";
    return "tok src-" + (SOURCES.includes(source) ? source : "other");
  }

  // ------------------------------------------------------------------ the server's description
  async function getJSON(path) {
    const response = await fetch(path, { headers: { Accept: "application/json" } });
    if (!response.ok) {
      const error = new Error(`${path}: HTTP ${response.status}`);
      error.status = response.status;
      error.retryAfter = Number(response.headers.get("Retry-After")) || 1;
      throw error;
    }
    return response.json();
  }

  function mib(value) {
    return value ? `${value} MiB` : "off";
  }

  async function loadServer() {
    try {
      const [props, models] = await Promise.all([getJSON("/props"), getJSON("/v1/models")]);
      state.props = props;
      const spec = props.specdec || {};
      $("info-model").textContent = (models.data && models.data[0] && models.data[0].id) || props.model_alias || "?";
      const ctx = props.default_generation_settings && props.default_generation_settings.n_ctx;
      $("info-context").textContent = ctx ? `${ctx} tokens` : "?";
      const kv = spec.kv_dtype || {};
      $("info-kv").textContent = Object.keys(kv).map((role) => `${role} ${kv[role]}`).join(", ") || "?";
      $("info-cache").textContent = `RAM ${mib(spec.prompt_cache_mib)}, suffix ${mib(spec.suffix_cache_mib)}`;
      $("info-workers").textContent = String(spec.workers || props.total_slots || "?");
      fillProposers(spec.proposers || [], spec.has_draft !== false);
      if (state.loading) setStatus("", false);
      state.loading = false;
    } catch (error) {
      if (error.status === 503) { // llama-server's "Loading model": the model is still loading, ask again
        state.loading = true;
        setStatus("the server is loading its model…", false);
        setTimeout(loadServer, Math.min(error.retryAfter, 10) * 1000);
        return;
      }
      setStatus(`cannot read the server's description: ${error.message}`, true);
      fillProposers([], true);
    }
  }

  function fillProposers(names, hasDraft) {
    const select = $("proposer");
    select.replaceChildren();
    const add = (value, label, disabled) => {
      const option = element("option", "", label);
      option.value = value;
      option.disabled = Boolean(disabled);
      select.append(option);
    };
    add(DEFAULT, hasDraft ? "default (hybrid)" : "default (suffix)");
    for (const name of names) {
      if (name === "hybrid") continue; // the default
      const needsDraft = name === "draft";
      add(name, needsDraft && !hasDraft ? `${name} (no draft model)` : name, needsDraft && !hasDraft);
    }
    add(TARGET_ONLY, "target only (no speculation)");
  }

  // ------------------------------------------------------------------ conversations
  function newConversation() {
    const conversation = { id: state.nextId++, title: "New chat", messages: [] };
    state.conversations.unshift(conversation);
    state.current = conversation;
    renderAll();
    $("input").focus();
  }

  function renderList() {
    const list = $("conversations");
    list.replaceChildren();
    for (const conversation of state.conversations) {
      const item = element("li");
      const button = element("button", conversation === state.current ? "conversation active" : "conversation",
                             conversation.title);
      button.type = "button";
      button.title = conversation.title;
      button.disabled = state.running !== null;
      button.addEventListener("click", () => {
        state.current = conversation;
        renderAll();
      });
      item.append(button);
      list.append(item);
    }
    $("new-chat").disabled = state.running !== null;
  }

  function renderAll() {
    renderList();
    const box = $("messages");
    box.replaceChildren();
    const messages = state.current ? state.current.messages : [];
    if (!messages.length) box.append(element("p", "empty", "Send a message to start. Answers stream here, " +
                                             "coloured by the proposer of their tokens."));
    for (const message of messages) box.append(renderMessage(message));
    box.scrollTop = box.scrollHeight;
  }

  function renderMessage(message) {
    const node = element("article", `message ${message.role}`);
    node.append(element("div", "role", message.role === "user" ? "you" : "assistant"));
    const body = element("div", "body");
    if (message.role === "assistant") {
      for (const [text, source] of message.spans) body.append(span(text, source));
      if (message.error && !message.content) body.append(element("span", "error", message.error));
    } else {
      body.append(document.createTextNode(message.content));
    }
    node.append(body);
    if (message.role === "assistant") {
      const stats = element("div", "stats");
      node.append(stats);
      showStats(stats, message);
    }
    message.node = node;
    return node;
  }

  function span(text, source) {
    const node = element("span", sourceClass(source), text);
    if (source) node.title = source;
    return node;
  }

  // ------------------------------------------------------------------ one answer
  function requestBody(conversation) {
    const messages = [];
    const system = $("system").value.trim();
    if (system) messages.push({ role: "system", content: system });
    for (const message of conversation.messages) {
      if (message.content) messages.push({ role: message.role, content: message.content });
    }
    const body = {
      model: $("info-model").textContent,
      messages,
      stream: true,
      stream_options: { include_usage: true },
      token_sources: true,
      temperature: Number($("temperature").value) || 0,
    };
    const maxTokens = parseInt($("max-tokens").value, 10);
    if (maxTokens > 0) body.max_tokens = maxTokens;
    const mode = $("proposer").value;
    const draftTokens = $("draft-tokens").value.trim();
    if (mode === TARGET_ONLY) {
      body.num_draft_tokens = 0;
    } else {
      if (mode !== DEFAULT) body.proposer = mode;
      if (draftTokens && draftTokens !== "auto") body.num_draft_tokens = parseInt(draftTokens, 10);
    }
    return body;
  }

  // Server-sent events from a fetch body: yields each event's data
  async function* events(response) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        const data = block.split("\n").filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).replace(/^ /, "")).join("\n");
        if (data) yield data;
      }
    }
  }

  async function errorText(response) {
    try {
      const answer = await response.json();
      if (answer && answer.error && answer.error.message) return answer.error.message;
    } catch (ignored) { /* not JSON */ }
    return `HTTP ${response.status}`;
  }

  async function send(text) {
    const conversation = state.current;
    conversation.messages.push({ role: "user", content: text });
    if (conversation.title === "New chat") conversation.title = text.split("\n")[0].slice(0, 60) || "chat";
    const body = requestBody(conversation);
    const reply = { role: "assistant", content: "", spans: [], stats: {} };
    conversation.messages.push(reply);
    const controller = new AbortController();
    state.running = controller;
    setRunning(true);
    renderAll();
    const live = reply.node.querySelector(".body");
    const statsNode = reply.node.querySelector(".stats");
    const started = performance.now();
    const add = (piece, source) => {
      const last = reply.spans[reply.spans.length - 1];
      if (last && last[1] === source) last[0] += piece; else reply.spans.push([piece, source]);
      reply.content += piece;
      live.append(span(piece, source));
    };
    try {
      const response = await fetch("/v1/chat/completions", {
        method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
        signal: controller.signal,
      });
      if (!response.ok) throw new Error(await errorText(response));
      for await (const data of events(response)) {
        if (data === "[DONE]") break;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message || "the server reported an error");
        const block = chunk.specdec || {};
        const choice = chunk.choices && chunk.choices[0];
        const content = choice && choice.delta && choice.delta.content;
        if (content) {
          if (reply.stats.ttft === undefined) reply.stats.ttft = (performance.now() - started) / 1000;
          if (Array.isArray(block.sources)) {
            for (const piece of block.sources) add(String(piece.text), String(piece.source));
          } else {
            add(content, null); // no sources sent: plain text
          }
          scrollDown();
        }
        if (choice && choice.finish_reason) {
          Object.assign(reply.stats, fieldsOf(block), { finish: choice.finish_reason });
        }
        if (chunk.usage) {
          reply.stats.completion = chunk.usage.completion_tokens;
          reply.stats.prompt = chunk.usage.prompt_tokens;
        }
        showStats(statsNode, reply);
      }
    } catch (error) {
      if (error.name === "AbortError") reply.stats.finish = "stopped";
      else reply.error = error.message;
      if (reply.error && !reply.content) live.append(element("span", "error", reply.error));
    } finally {
      state.running = null;
      setRunning(false);
      showStats(statsNode, reply);
      renderList();
      $("input").focus();
    }
  }

  function fieldsOf(block) {
    const fields = {};
    for (const name of ["tokens_per_second", "accepted_tokens", "proposed_tokens", "target_passes",
                        "cached_tokens", "rounds"]) {
      if (typeof block[name] === "number") fields[name] = block[name];
    }
    return fields;
  }

  function showStats(node, message) {
    node.replaceChildren();
    const s = message.stats || {};
    const item = (label, value, name) => {
      const part = element("span", "stat", "");
      part.dataset.stat = name;
      part.append(element("span", "label", label + " "), element("span", "value", value));
      node.append(part);
    };
    if (s.ttft !== undefined) item("first token", `${s.ttft.toFixed(2)} s`, "ttft");
    if (s.tokens_per_second !== undefined) item("speed", `${s.tokens_per_second.toFixed(1)} tok/s`, "tps");
    if (s.cached_tokens !== undefined) {
      item("cached", s.prompt !== undefined ? `${s.cached_tokens} / ${s.prompt} prompt tokens`
        : `${s.cached_tokens} prompt tokens`, "cached");
    }
    if (s.proposed_tokens !== undefined) item("accepted", `${s.accepted_tokens} / ${s.proposed_tokens}`, "accepted");
    if (s.target_passes && s.completion !== undefined) {
      item("per target pass", `${(s.completion / s.target_passes).toFixed(2)} tokens`, "per-pass");
    }
    if (s.finish) item("end", s.finish, "finish");
    if (message.error && message.content) node.append(element("span", "error", message.error));
  }

  // ------------------------------------------------------------------ the page's controls
  function setStatus(text, isError) {
    const status = $("status");
    status.textContent = text;
    status.className = isError ? "error" : "";
  }

  function setRunning(running) {
    $("send").hidden = running;
    $("stop").hidden = !running;
    $("new-chat").disabled = running;
    setStatus(running ? "generating…" : "", false);
  }

  function scrollDown() {
    const box = $("messages");
    box.scrollTop = box.scrollHeight;
  }

  function submit(event) {
    if (event) event.preventDefault();
    const input = $("input");
    const text = input.value;
    if (!text.trim() || state.running) return;
    input.value = "";
    send(text);
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("composer").addEventListener("submit", submit);
    $("input").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) submit(event);
    });
    $("stop").addEventListener("click", () => state.running && state.running.abort());
    $("new-chat").addEventListener("click", newConversation);
    $("colour").addEventListener("change", (event) => {
      $("messages").classList.toggle("coloured", event.target.checked);
    });
    newConversation();
    loadServer();
  });
})();
