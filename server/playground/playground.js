// The playground: a long document, a question, one to four extension settings side by side.
// It speaks the server's own API (/tokenize, /v1/models, /v1/chat/completions, /v1/completions)
// as any client would; nothing here is a second implementation of the server.

const $ = (selector, root = document) => root.querySelector(selector);
const KEY_STORE = "rope-extend-api-key"; // sessionStorage: gone when the tab closes
const MAX_COLUMNS = 4;
const COUNT_DELAY_MS = 400; // count tokens once typing pauses, not on every key
const FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ";
const NUMBER_FIELDS = ["window", "leaky_k", "group", "shift", "local", "chunk_size", "local_window", "beta"];

const page = { model: null, trainLength: 0, servedMax: 0, methods: { auto: [] }, defaultMethod: "auto" };

// ---- the API ---------------------------------------------------------------------------

function requestHeaders() {
  const headers = { "Content-Type": "application/json" };
  const key = sessionStorage.getItem(KEY_STORE);
  if (key) headers.Authorization = `Bearer ${key}`;
  return headers;
}

function post(path, body, signal) {
  return fetch(path, { method: "POST", headers: requestHeaders(), body: JSON.stringify(body), signal });
}

/** The OpenAI error body of a failed response as {message, param}. */
async function errorOf(response) {
  const text = await response.text();
  try {
    const { error } = JSON.parse(text);
    return { message: error.message, param: error.param || "" };
  } catch {
    return { message: `${response.status} ${response.statusText}: ${text.slice(0, 200)}`, param: "" };
  }
}

/** The events of an OpenAI stream (server-sent events), parsed, until [DONE]. */
async function* streamEvents(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const data = buffer.slice(0, end).split("\n").filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).trim()).join("");
      buffer = buffer.slice(end + 2);
      if (data === "[DONE]") return;
      if (data) yield JSON.parse(data);
    }
  }
}

// ---- errors, next to the field they name -------------------------------------------------

function clearErrors() {
  document.querySelectorAll(".field-error").forEach((line) => { line.textContent = ""; });
  document.querySelectorAll(".invalid").forEach((input) => input.classList.remove("invalid"));
}

/** Show an API error where its `param` points: a column's setting, the document, max_tokens. */
function showError(error, column = null) {
  const param = error.param || "";
  if (column && param.startsWith("context_extension")) {
    $(".field-error", column).textContent = error.message;
    const input = $(`[name="${param.split(".")[1]}"]`, column);
    if (input) input.classList.add("invalid");
    return;
  }
  const line = [...document.querySelectorAll(".field-error[data-param]")]
    .find((candidate) => param && candidate.dataset.param.split(" ").includes(param));
  if (line) {
    line.textContent = error.message;
    const input = { messages: "#doc", prompt: "#doc", max_tokens: "#max-tokens" }[param];
    if (input) $(input).classList.add("invalid");
  }
  if (column) $(".field-error", column).textContent = line ? `${param}: see above` : error.message;
  else if (!line) $("#server-error").textContent = error.message;
}

// ---- the document and its length in tokens -------------------------------------------------

let countRequest = 0;
let countTimer = null;

function scheduleCount() {
  clearTimeout(countTimer);
  // until the new text is counted, the count shown is the old text's: say it is pending
  $("#doc-count").textContent = "counting…";
  delete $("#doc-count").dataset.tokens;
  countTimer = setTimeout(countTokens, COUNT_DELAY_MS);
}

async function tokenCount(text) {
  const response = await post("/tokenize", { prompt: text, add_special_tokens: false });
  if (!response.ok) throw await errorOf(response);
  return (await response.json()).count;
}

async function countTokens() {
  const request = ++countRequest; // a slower, older answer must not overwrite a newer one
  const text = $("#doc").value;
  if (!text) return showCount(0);
  $("#doc-count").textContent = "counting…";
  try {
    const count = await tokenCount(text);
    if (request === countRequest) showCount(count);
  } catch (error) {
    if (request === countRequest) {
      $("#doc-count").textContent = "";
      showError({ param: "prompt", ...error, message: error.message || String(error) });
    }
  }
}

function showCount(count) {
  const { trainLength, servedMax } = page;
  const fill = $("#meter-fill");
  fill.style.width = `${Math.min(1, count / (servedMax || 1)) * 100}%`;
  fill.classList.toggle("past", count > trainLength);
  fill.classList.toggle("over", count >= servedMax);
  const verdict = !count ? "no text yet"
    : count >= servedMax ? "longer than the served maximum: the server will refuse it"
    : count <= trainLength ? "inside the training length: plain RoPE is enough"
    : "past the training length: extension matters";
  $("#doc-count").textContent = `${count.toLocaleString()} tokens (training ${trainLength.toLocaleString()}, `
    + `served maximum ${servedMax.toLocaleString()}): ${verdict}`;
  $("#doc-count").dataset.tokens = count;
}

async function loadFile(file) {
  const text = await file.text();
  if (text.includes("\u0000")) {
    showError({ param: "prompt", message: `${file.name} is not a text file` });
    return;
  }
  $("#doc").value = text;
  clearErrors();
  scheduleCount();
}

// ---- the columns: one setting each ---------------------------------------------------------

function addColumn(method) {
  if (document.querySelectorAll(".column").length >= MAX_COLUMNS) return null;
  const column = $("#column-template").content.firstElementChild.cloneNode(true);
  const select = $("[name=method]", column);
  for (const name of Object.keys(page.methods)) select.append(new Option(name, name));
  select.value = method in page.methods ? method : "auto";
  select.addEventListener("change", () => showUsedFields(column));
  $(".remove", column).addEventListener("click", () => {
    column.controller?.abort();
    if (document.querySelectorAll(".column").length > 1) column.remove();
    updateColumnButtons();
  });
  $(".cancel", column).addEventListener("click", () => column.controller?.abort());
  showUsedFields(column);
  $("#columns").append(column);
  updateColumnButtons();
  return column;
}

function updateColumnButtons() {
  $("#add-column").disabled = document.querySelectorAll(".column").length >= MAX_COLUMNS;
}

/** Only the fields the chosen method reads (log-n goes with every method). */
function showUsedFields(column) {
  const used = page.methods[$("[name=method]", column).value] || [];
  column.querySelectorAll(".settings label[data-field]").forEach((label) => {
    label.classList.toggle("unused", label.dataset.field !== "log_n" && !used.includes(label.dataset.field));
  });
}

/** The column's context_extension: the method and the fields it uses that are filled in; a
 *  value that is not a number goes as typed, so that the server's error names it. */
function extensionOf(column) {
  const method = $("[name=method]", column).value;
  const used = page.methods[method] || [];
  const extension = { method };
  const typed = (name) => $(`[name=${name}]`, column).value.trim();
  const asNumber = (text) => (text !== "" && Number.isFinite(Number(text)) ? Number(text) : text);
  for (const name of NUMBER_FIELDS) {
    if (used.includes(name) && typed(name) !== "") extension[name] = asNumber(typed(name));
  }
  if (used.includes("factor") && typed("factor") !== "") {
    extension.factor = typed("factor") === "auto" ? "auto" : asNumber(typed("factor"));
  }
  if (typed("log_n")) extension.log_n = typed("log_n") === "true";
  return extension;
}

function requestBody(extension) {
  const document_ = $("#doc").value;
  const question = $("#question").value;
  const common = {
    model: page.model, max_tokens: asInteger($("#max-tokens").value), temperature: 0, stream: true,
    stream_options: { include_usage: true }, context_extension: extension,
  };
  if ($("#mode").value === "complete") {
    return ["/v1/completions", { ...common, prompt: `${document_} ${question}` }];
  }
  const content = document_ ? `${document_}\n\n${question}` : question;
  return ["/v1/chat/completions", { ...common, messages: [{ role: "user", content }] }];
}

function asInteger(text) {
  const number = Number(text);
  return Number.isInteger(number) ? number : text; // as typed otherwise: the server names the field
}

/** One column's request, streamed into it; its Cancel aborts it (the server then aborts it too). */
async function runColumn(column) {
  column.controller?.abort();
  const controller = new AbortController();
  column.controller = controller;
  const output = $(".output", column);
  const text = document.createTextNode(""); // appended to in place: no re-render of what came before
  output.replaceChildren(text);
  output.classList.add("running");
  $(".applied", column).textContent = "";
  const stats = $(".stats", column);
  stats.textContent = "waiting for the first token…";
  $(".cancel", column).disabled = false;
  const started = performance.now();
  let first = null;
  let usage = null;
  let pieces = 0;
  try {
    const [path, body] = requestBody(extensionOf(column));
    const response = await post(path, body, controller.signal);
    if (!response.ok) {
      stats.textContent = `refused (${response.status})`;
      showError(await errorOf(response), column);
      return;
    }
    $(".applied", column).textContent = response.headers.get("x-context-extension") || "";
    for await (const event of streamEvents(response.body)) {
      if (event.error) {
        showError(event.error, column);
        break;
      }
      const choice = (event.choices || [])[0];
      const piece = choice ? (choice.delta ? choice.delta.content : choice.text) || "" : "";
      if (piece) {
        first ??= performance.now();
        pieces += 1;
        text.appendData(piece);
      }
      if (event.usage) usage = event.usage;
      stats.textContent = statsLine(started, first, performance.now(), usage, pieces);
    }
    stats.textContent = statsLine(started, first, performance.now(), usage, pieces) + " · done";
    column.dataset.state = "done";
  } catch (error) {
    if (error.name === "AbortError") {
      stats.textContent = statsLine(started, first, performance.now(), usage, pieces) + " · cancelled";
      column.dataset.state = "cancelled";
    } else {
      showError({ message: error.message || String(error) }, column);
    }
  } finally {
    output.classList.remove("running");
    $(".cancel", column).disabled = true;
  }
}

function statsLine(started, first, now, usage, pieces) {
  if (first === null) return "waiting for the first token…";
  const tokens = usage ? usage.completion_tokens : pieces;
  const rate = tokens > 1 && now > first ? ((tokens - 1) / ((now - first) / 1000)).toFixed(1) : "–";
  const prompt = usage ? ` · ${usage.prompt_tokens.toLocaleString()} prompt tokens` : "";
  return `first token ${((first - started) / 1000).toFixed(2)} s · ${rate} tokens/s${prompt}`;
}

function runAll() {
  clearErrors();
  for (const column of document.querySelectorAll(".column")) {
    delete column.dataset.state;
    runColumn(column);
  }
}

// ---- the needle-in-a-haystack demo ---------------------------------------------------------

async function makeHaystack() {
  clearErrors();
  const length = Number($("#demo-length").value);
  const depth = Math.min(100, Math.max(0, Number($("#demo-depth").value))) / 100;
  const key = String(10000 + Math.floor(Math.random() * 90000));
  const needle = ` The pass key is ${key}. Remember it. ${key} is the pass key. `;
  try {
    const perFiller = (await tokenCount(FILLER.repeat(16))) / 16;
    const fillers = Math.max(1, Math.round((length - 40) / perFiller));
    const before = Math.round(fillers * depth);
    $("#doc").value = FILLER.repeat(before) + needle + FILLER.repeat(fillers - before);
  } catch (error) {
    showError({ param: "prompt", ...error });
    return;
  }
  $("#question").value = "What is the pass key? The pass key is";
  $("#mode").value = "complete";
  $("#max-tokens").value = 8;
  const distance = Math.round(length * (1 - depth));
  $(".hint", $("#demo")).textContent = `The hidden pass key is ${key}, about ${distance.toLocaleString()} tokens `
    + `before the question (training length ${page.trainLength.toLocaleString()}).`;
  document.querySelectorAll(".column").forEach((column) => column.remove());
  addColumn("none");
  addColumn("rerope");
  scheduleCount();
}

// ---- start-up ------------------------------------------------------------------------------

async function loadServer() {
  $("#server-error").textContent = "";
  const setup = await (await fetch("/playground/setup.json")).json();
  page.methods = setup.methods;
  page.defaultMethod = setup.default_method;
  const response = await fetch("/v1/models", { headers: requestHeaders() });
  if (!response.ok) {
    const error = await errorOf(response);
    $("#model-facts").textContent = "not connected";
    $("#server-error").textContent = response.status === 401
      ? `${error.message} Enter the server's API key above.` : error.message;
    $("#api-key").classList.toggle("invalid", response.status === 401);
    return false;
  }
  $("#api-key").classList.remove("invalid");
  const card = (await response.json()).data[0];
  Object.assign(page, { model: card.id, trainLength: card.train_length, servedMax: card.max_model_len });
  $("#model-facts").textContent = `${card.id} · trained on ${card.train_length.toLocaleString()} tokens · `
    + `serves up to ${card.max_model_len.toLocaleString()}`;
  $("#meter-train").style.left = `${Math.min(1, card.train_length / card.max_model_len) * 100}%`;
  return true;
}

async function start() {
  $("#api-key").value = sessionStorage.getItem(KEY_STORE) || "";
  $("#api-key").addEventListener("change", async (event) => {
    sessionStorage.setItem(KEY_STORE, event.target.value);
    if (await loadServer()) scheduleCount();
  });
  const doc = $("#doc");
  doc.addEventListener("input", scheduleCount);
  doc.addEventListener("dragover", (event) => { event.preventDefault(); doc.classList.add("dropping"); });
  doc.addEventListener("dragleave", () => doc.classList.remove("dropping"));
  doc.addEventListener("drop", (event) => {
    event.preventDefault();
    doc.classList.remove("dropping");
    const [file] = event.dataTransfer.files;
    if (file) loadFile(file);
  });
  $("#file").addEventListener("change", (event) => event.target.files[0] && loadFile(event.target.files[0]));
  $("#run").addEventListener("click", runAll);
  $("#add-column").addEventListener("click", () => addColumn("rerope"));
  $("#demo-make").addEventListener("click", makeHaystack);
  try {
    await loadServer();
  } catch (error) {
    $("#server-error").textContent = `the server did not answer: ${error.message}`;
  }
  addColumn(page.defaultMethod);
  addColumn(page.defaultMethod === "rerope" ? "leaky_rerope" : "rerope");
  document.body.dataset.ready = "true";
}

start();
