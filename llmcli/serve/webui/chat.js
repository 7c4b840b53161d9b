// llmcli's chat page: talks to this server's OpenAI routes, keeps conversations in the browser (localStorage).
// Model output is text, never HTML: markdown.js turns it into elements whose text is set as text, and the page's
// Content-Security-Policy allows no inline script at all.
"use strict";

const STORE = "llmcli.conversations";
const SETTINGS = "llmcli.settings";
const KEY = "llmcli.key";
const NUMBERS = ["temperature", "top_p", "top_k", "min_p", "repeat_penalty", "max_tokens", "seed"];
const TRACE_TOP = 5; // candidates kept a token when the page asks for them

const MAX_SIDE = 1024; // pictures are scaled down to this many pixels on their longer side before they are kept and sent

const page = {
  attachments: [], // data URIs of the images the next message asks about
  conversations: load(STORE, []),
  current: null,
  controller: null, // the answer being streamed: its AbortController
  key: localStorage.getItem(KEY) || "",
};

function load(name, fallback) {
  try {
    const value = JSON.parse(localStorage.getItem(name));
    return value === null ? fallback : value;
  } catch {
    return fallback;
  }
}

function save() {
  try {
    localStorage.setItem(STORE, JSON.stringify(page.conversations));
  } catch {
    $("status").textContent = "This browser's storage is full: older conversations (and their images) are not kept.";
  }
}

// ---- images --------------------------------------------------------------------------------------------------

function attach(files) {
  for (const file of files) {
    if (!file.type.startsWith("image/")) continue;
    const reader = new FileReader();  // a data: URL (the page's policy allows images from data:, not blob:)
    reader.onload = () => {
      const picture = new Image();
      picture.onload = () => {
        const scale = Math.min(1, MAX_SIDE / Math.max(picture.width, picture.height));
        const canvas = document.createElement("canvas");
        canvas.width = Math.max(1, Math.round(picture.width * scale));
        canvas.height = Math.max(1, Math.round(picture.height * scale));
        canvas.getContext("2d").drawImage(picture, 0, 0, canvas.width, canvas.height);
        page.attachments.push(canvas.toDataURL("image/png"));
        showAttachments();
      };
      picture.onerror = () => { $("status").textContent = file.name + " is not an image this browser can read."; };
      picture.src = reader.result;
    };
    reader.readAsDataURL(file);
  }
}

function showAttachments() {
  const box = $("attachments");
  box.replaceChildren();
  page.attachments.forEach((image, index) => {
    const item = el("div", "attachment");
    item.append(thumb(image), button("×", "remove", () => { page.attachments.splice(index, 1); showAttachments(); }));
    box.append(item);
  });
}

function thumb(source) {
  const picture = el("img", "thumb");
  picture.src = source;
  picture.alt = "an attached image";
  return picture;
}

function wire({ role, content, images }) {
  if (!images?.length) return { role, content };
  const parts = images.map((url) => ({ type: "image_url", image_url: { url } }));
  return { role, content: content ? [...parts, { type: "text", text: content }] : parts };
}

function $(id) {
  return document.getElementById(id);
}

// ---- conversations -----------------------------------------------------------------------------------------

function conversation() {
  if (!page.current) {
    page.current = { id: String(Date.now()) + Math.random().toString(16).slice(2, 6), title: "New chat", messages: [] };
    page.conversations.unshift(page.current);
  }
  return page.current;
}

function showConversations() {
  const list = $("conversations");
  list.replaceChildren();
  for (const conv of page.conversations) {
    const item = el("li", conv === page.current ? "current" : "");
    const open = el("button", "open", conv.title);
    open.type = "button";
    open.title = conv.title;
    open.addEventListener("click", () => { if (!page.controller) { page.current = conv; showAll(); } });
    const remove = el("button", "delete", "×");
    remove.type = "button";
    remove.title = "Delete this conversation";
    remove.setAttribute("aria-label", "Delete " + conv.title);
    remove.addEventListener("click", () => {
      if (page.controller) return;
      page.conversations = page.conversations.filter((c) => c !== conv);
      if (page.current === conv) page.current = null;
      save();
      showAll();
    });
    item.append(open, remove);
    list.append(item);
  }
}

function showAll() {
  showConversations();
  const box = $("messages");
  box.replaceChildren();
  const conv = page.current;
  if (!conv) return;
  conv.messages.forEach((message, index) => box.append(messageView(message, index)));
  box.scrollTop = box.scrollHeight;
}

function messageView(message, index) {
  const view = el("article", "message " + message.role);
  view.dataset.index = String(index);
  view.append(el("div", "role", message.role));
  if (message.reasoning) view.append(thinkingView(message.reasoning, false));
  if (message.images?.length) {
    const images = el("div", "images");
    message.images.forEach((image) => images.append(thumb(image)));
    view.append(images);
  }
  const body = el("div", message.role === "assistant" ? "body" : "body plain");
  body.append(message.role === "assistant" ? markdown(message.content) : document.createTextNode(message.content));
  view.append(body);
  if (message.error) view.append(el("p", "error", message.error));
  if (message.stats) view.append(el("div", "stats", message.stats));
  if (message.tokens && !(page.controller && index === page.current.messages.length - 1)) view.append(tokensView(message.tokens));
  const actions = el("div", "actions");
  const conv = page.current;
  if (message.role === "user") actions.append(button("Edit", "edit", () => edit(view, index)));
  if (message.role === "assistant" && index === conv.messages.length - 1 && !page.controller) {
    actions.append(button("Regenerate", "regenerate", regenerate));
  }
  view.append(actions);
  return view;
}

// ---- token candidates (llmcli's `trace`) -------------------------------------------------------------------

function pieceText(hex) {
  const bytes = new Uint8Array(hex.length / 2);
  for (let i = 0; i < bytes.length; i++) bytes[i] = parseInt(hex.slice(2 * i, 2 * i + 2), 16);
  return new TextDecoder("utf-8").decode(bytes);  // (a piece that is part of a character shows U+FFFD)
}

function traced(wire) {
  // The server's trace of one token (openai_wire.trace_wire), kept small: its text, how it was chosen, candidates.
  return { piece: pieceText(wire.piece), special: wire.special, how: wire.how, p: wire.p, changed: wire.changed,
    candidates: wire.candidates.slice(0, 2 * TRACE_TOP).map(([, piece, , pModel, pSampler]) =>
      ({ piece: pieceText(piece), pModel, pSampler })) };
}

function tokensView(tokens) {
  const view = el("div", "tokens");
  view.append(el("div", "tokens-title", "tokens (click one)"));
  const line = el("div", "token-line");
  const detail = el("div", "token-detail");
  detail.hidden = true;
  tokens.forEach((token, i) => {
    const span = el("button", "token" + (token.special ? " special" : "") + (i % 2 ? " odd" : ""),
      token.piece.replace(/\n/g, "⏎"));
    span.type = "button";
    span.title = token.how + (token.how === "argmax" ? "" : " p=" + token.p.toFixed(3));
    span.addEventListener("click", () => {
      detail.hidden = false;
      const rows = token.candidates.map((c) =>
        el("li", c.piece === token.piece ? "chosen" : "",
          JSON.stringify(c.piece) + "  model " + c.pModel.toFixed(3) + " → sampler " + c.pSampler.toFixed(3)));
      const list = el("ol", "candidates");
      list.append(...rows);
      detail.replaceChildren(
        el("div", "", "#" + i + " " + JSON.stringify(token.piece) + " · " + token.how +
          (token.how === "argmax" ? "" : " p=" + token.p.toFixed(3)) +
          (token.changed.length ? " · changed by " + token.changed.join(" › ") : "")),
        list);
    });
    line.append(span);
  });
  view.append(line, detail);
  return view;
}

function thinkingView(text, open) {
  const thinking = el("details", "thinking");
  thinking.open = open;
  thinking.append(el("summary", "", "thinking"), el("span", "", text));
  return thinking;
}

function button(label, className, onClick) {
  const node = el("button", className, label);
  node.type = "button";
  node.addEventListener("click", onClick);
  return node;
}

function edit(view, index) {
  if (page.controller) return;
  const message = page.current.messages[index];
  const area = el("textarea", "editing");
  area.value = message.content;
  area.rows = Math.max(2, message.content.split("\n").length);
  const body = view.querySelector(".body");
  body.replaceWith(area);
  const actions = view.querySelector(".actions");
  actions.replaceChildren(
    button("Save & send", "save", () => {
      if (!area.value.trim()) return;
      page.current.messages = page.current.messages.slice(0, index);
      ask(area.value, message.images || []);
    }),
    button("Cancel", "cancel", showAll),
  );
  area.focus();
}

function regenerate() {
  const conv = page.current;
  if (page.controller || !conv || conv.messages.at(-1)?.role !== "assistant") return;
  conv.messages.pop();
  answer();
}

function ask(text, images = []) {
  const conv = conversation();
  conv.messages.push(images.length ? { role: "user", content: text, images } : { role: "user", content: text });
  if (conv.title === "New chat") conv.title = text.trim().split("\n")[0].slice(0, 60) || (images.length ? "An image" : "New chat");
  answer();
}

// ---- the server --------------------------------------------------------------------------------------------

function headers() {
  const sent = { "Content-Type": "application/json" };
  if (page.key) sent.Authorization = "Bearer " + page.key;
  return sent;
}

function settings() {
  const chosen = {};
  for (const name of NUMBERS) {
    const value = $(name).value.trim();
    if (value !== "") chosen[name] = Number(value);
  }
  const grammar = $("grammar").value;
  if (grammar.trim()) chosen.grammar = grammar;
  if ($("trace").checked) chosen.trace = TRACE_TOP;  // (llmcli's own field: each token's candidates, in SSE comments)
  return chosen;
}

function keepSettings() {
  const kept = { system: $("system").value, grammar: $("grammar").value, model: $("model").value,
    trace: $("trace").checked };
  for (const name of NUMBERS) kept[name] = $(name).value;
  localStorage.setItem(SETTINGS, JSON.stringify(kept));
}

async function errorOf(response) {
  try {
    const body = await response.json();
    return body.error?.message || body.error || response.statusText;
  } catch {
    return response.status + " " + response.statusText;
  }
}

async function loadModels() {
  const response = await fetch("v1/models", { headers: headers() });
  if (response.status === 401) return askKey(await errorOf(response));
  if (!response.ok) {
    $("status").textContent = "Could not list the models: " + (await errorOf(response));
    return;
  }
  const { data } = await response.json();
  const select = $("model");
  const wanted = load(SETTINGS, {}).model;
  select.replaceChildren(...data.map((model) => {
    const option = el("option", "", model.id);
    option.value = model.id;
    return option;
  }));
  if (wanted && data.some((model) => model.id === wanted)) select.value = wanted;
  $("status").textContent = data.length ? "" : "No model is installed.";
}

function askKey(problem) {
  const dialog = $("key-dialog");
  $("key-error").textContent = page.key ? problem : "";
  if (!dialog.open) dialog.showModal();
  $("key").focus();
}

function busy(on) {
  $("send").disabled = on;
  $("stop").hidden = !on;
  $("send").hidden = on;
}

function statsLine(timings, finish, started, firstAt, pieces) {
  if (timings) {
    const parts = ["TTFT " + timings.ttft_s.toFixed(2) + " s", timings.decode_tokens_per_s.toFixed(1) + " tok/s",
      timings.completion_tokens + " tokens", timings.cached_tokens + "/" + timings.prompt_tokens + " prompt tokens cached"];
    if (timings.images) parts.push(timings.images + (timings.images === 1 ? " image" : " images"));
    return parts.join(" · ") + (finish ? " · " + finish : "");
  }
  const ttft = firstAt === null ? "" : "TTFT " + ((firstAt - started) / 1000).toFixed(2) + " s · ";
  const seconds = firstAt === null ? 0 : (performance.now() - firstAt) / 1000;  // (a stopped answer: no server timings)
  const rate = seconds > 0 && pieces > 1 ? " · " + ((pieces - 1) / seconds).toFixed(1) + " pieces/s" : "";
  return ttft + pieces + " pieces" + rate + " · " + (finish || "stopped");
}

async function answer() {
  const conv = conversation();
  const system = $("system").value.trim();
  const sent = conv.messages.map(wire);
  if (system) sent.unshift({ role: "system", content: system });
  const reply = { role: "assistant", content: "", reasoning: "" };
  if ($("trace").checked) reply.tokens = [];
  conv.messages.push(reply);
  keepSettings();
  page.controller = new AbortController();
  busy(true);
  showAll();
  const view = $("messages").lastElementChild;
  const body = view.querySelector(".body");
  let drawn = false;
  const draw = () => {
    drawn = false;
    body.replaceChildren(markdown(reply.content));
    if (reply.reasoning && !view.querySelector(".thinking")) view.insertBefore(thinkingView("", true), body);
    if (reply.reasoning) view.querySelector(".thinking span").textContent = reply.reasoning;
    $("messages").scrollTop = $("messages").scrollHeight;
  };
  const started = performance.now();
  let firstAt = null;
  let pieces = 0;
  let timings = null;
  let finish = null;
  try {
    const response = await fetch("v1/chat/completions", {
      method: "POST", headers: headers(), signal: page.controller.signal,
      body: JSON.stringify({ model: $("model").value, messages: sent, stream: true, ...settings() }),
    });
    if (!response.ok) {
      reply.error = await errorOf(response);
      if (response.status === 401) askKey(reply.error);
      return;
    }
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value.replace(/\r/g, "");
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (line.startsWith(": trace {") && reply.tokens) {  // (a traced token: what the model and sampler made of it)
            reply.tokens.push(traced(JSON.parse(line.slice(8))));
            continue;
          }
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message || String(chunk.error));
          const choice = chunk.choices?.[0];
          const delta = choice?.delta || {};
          if (delta.content || delta.reasoning_content) {
            if (firstAt === null) firstAt = performance.now();
            pieces++;
            reply.content += delta.content || "";
            reply.reasoning += delta.reasoning_content || "";
            if (!drawn) { drawn = true; requestAnimationFrame(draw); }
          }
          if (choice?.finish_reason) finish = choice.finish_reason;
          if (chunk.timings) timings = chunk.timings;
        }
      }
    }
  } catch (error) {
    if (error.name !== "AbortError") reply.error = String(error.message || error);
    else finish = "stopped";
  } finally {
    reply.stats = reply.error ? "" : statsLine(timings, finish, started, firstAt, pieces);
    if (!reply.reasoning) delete reply.reasoning;
    if (reply.tokens && !reply.tokens.length) delete reply.tokens;
    page.controller = null;
    busy(false);
    save();
    showAll();
  }
}

// ---- wiring --------------------------------------------------------------------------------------------------

function start() {
  const kept = load(SETTINGS, {});
  for (const name of [...NUMBERS, "system", "grammar"]) if (kept[name] !== undefined) $(name).value = kept[name];
  $("trace").checked = Boolean(kept.trace);
  page.current = page.conversations[0] || null;
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("prompt").value;
    if ((!text.trim() && !page.attachments.length) || page.controller) return;
    $("prompt").value = "";
    const images = page.attachments;
    page.attachments = [];
    showAttachments();
    ask(text, images);
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => page.controller?.abort());
  $("image-file").addEventListener("change", (event) => { attach(event.target.files); event.target.value = ""; });
  $("prompt").addEventListener("paste", (event) => {
    const files = [...(event.clipboardData?.files || [])].filter((file) => file.type.startsWith("image/"));
    if (files.length) { event.preventDefault(); attach(files); }
  });
  $("composer").addEventListener("dragover", (event) => event.preventDefault());
  $("composer").addEventListener("drop", (event) => {
    const files = [...(event.dataTransfer?.files || [])];
    if (files.length) { event.preventDefault(); attach(files); }
  });
  $("new-chat").addEventListener("click", () => {
    if (page.controller) return;
    page.current = null;
    showAll();
    $("prompt").focus();
  });
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    page.key = $("key").value.trim();
    localStorage.setItem(KEY, page.key);
    $("key-dialog").close();
    loadModels();
  });
  for (const name of [...NUMBERS, "system", "grammar", "model"]) $(name).addEventListener("change", keepSettings);
  showAll();
  loadModels();
}

document.addEventListener("DOMContentLoaded", start);
