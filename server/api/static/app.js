// The playground page: builds a TGI request from the form, streams tokens from POST /generate_stream,
// keeps the live figures, and hands the attention weights of a finished generation to the attention view.
import { sseData } from "./sse.js";
import { $, authHeaders } from "./api.js";
import { AttentionView } from "./attention.js";

const MAX_STOP = 4; // the server's limit

let running = null; // { controller, started, firstToken, count } while a generation streams
let attentionView = null;

/** TGI's `parameters.grammar` for the JSON-schema box: null when the box is empty. Throws a SyntaxError
 * when its text is not JSON (whether the schema itself is usable is the server's to say). */
function schemaGrammar() {
  const text = $("json_schema").value.trim();
  return text === "" ? null : { type: "json", value: JSON.parse(text) };
}

function showSchemaError(message) {
  $("schema-error").textContent = message ?? "";
  $("schema-error").hidden = message == null;
}

function requestBody() {
  const number = (id) => ($(id).value === "" ? null : Number($(id).value));
  const sampling = $("decoding").value === "sample";
  const parameters = {
    max_new_tokens: number("max_new_tokens"),
    repetition_penalty: number("repetition_penalty"),
    stop: $("stop").value.split("\n").filter((s) => s !== "").map((s) => s.replaceAll("\\n", "\n")).slice(0, MAX_STOP),
    use_cache: $("use_cache").checked,
    return_attention: $("return_attention").checked,
  };
  if (sampling) {
    const topK = number("top_k");
    Object.assign(parameters, {
      do_sample: true,
      temperature: number("temperature"),
      top_k: topK > 0 ? topK : null,
      top_p: number("top_p"),
      seed: number("seed"),
    });
  }
  const grammar = schemaGrammar();
  if (grammar) parameters.grammar = grammar;
  return { inputs: $("prompt").value, parameters };
}

function setFigure(id, text) {
  $(id).textContent = text;
}

function formatSeconds(s) {
  return s == null ? "–" : s < 1 ? `${(s * 1000).toFixed(1)} ms` : `${s.toFixed(2)} s`;
}

function showLiveFigures() {
  const { started, firstToken, count } = running;
  setFigure("token-count", String(count));
  if (firstToken !== null) {
    setFigure("ttft", formatSeconds((firstToken - started) / 1000));
    const seconds = (performance.now() - firstToken) / 1000;
    if (count > 1 && seconds > 0) setFigure("tps", ((count - 1) / seconds).toFixed(1));
  }
}

function showFinalFigures(details) {
  // The server's own measurements replace the browser's once the request is done.
  setFigure("ttft", formatSeconds(details.time_to_first_token_s));
  setFigure("tps", details.tokens_per_s == null ? "–" : details.tokens_per_s.toFixed(1));
  setFigure("token-count", String(details.generated_tokens));
  setFigure("cache-used", details.use_cache ? "used" : "not used");
  setFigure("seed-used", details.seed == null ? "greedy" : String(details.seed));
}

function appendToken(token) {
  const span = document.createElement("span");
  span.className = "token generated" + (token.special ? " special" : "");
  span.textContent = token.text;
  span.title = `id ${token.id}, logprob ${token.logprob.toFixed(3)}`;
  $("output").append(span);
}

function setRunning(isRunning) {
  $("generate").textContent = isRunning ? "Stop" : "Generate";
  $("generate").classList.toggle("stop", isRunning);
  $("status").className = isRunning ? "streaming" : "";
}

async function generate() {
  let body;
  try {
    body = requestBody();
  } catch (error) {
    showSchemaError(`The JSON schema is not JSON: ${error.message}`); // nothing is sent
    return;
  }
  showSchemaError(null);
  const controller = new AbortController();
  running = { controller, started: performance.now(), firstToken: null, count: 0 };
  attentionView?.hide();
  attentionView = null;
  $("show-attention").disabled = true;
  $("output").replaceChildren(Object.assign(document.createElement("span"), { className: "prompt", textContent: body.inputs }));
  for (const id of ["ttft", "tps", "seed-used"]) setFigure(id, "–");
  setFigure("token-count", "0");
  setFigure("cache-used", body.parameters.use_cache ? "on (requested)" : "off (requested)");
  setFigure("status", "waiting…");
  setRunning(true);
  try {
    const response = await fetch("/generate_stream", {
      method: "POST",
      headers: { "Content-Type": "application/json", Accept: "text/event-stream", ...authHeaders() },
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!response.ok) {
      const error = await response.json().catch(() => ({ error: response.statusText }));
      throw new Error(`${response.status}: ${error.error}`);
    }
    for await (const event of sseData(response)) {
      if (event.error) throw new Error(event.error);
      if (running.firstToken === null) running.firstToken = performance.now();
      running.count = event.index;
      appendToken(event.token);
      showLiveFigures();
      setFigure("status", "streaming…");
      if (event.details) finish(event.details);
    }
  } catch (error) {
    setFigure("status", error.name === "AbortError" ? "stopped" : `error: ${error.message}`);
  } finally {
    running = null;
    setRunning(false);
  }
}

function finish(details) {
  showFinalFigures(details);
  setFigure("status", `finished (${details.finish_reason})`);
  if (details.attention) {
    attentionView = new AttentionView(details.attention, details.generated_tokens);
    $("show-attention").disabled = false;
  }
}

async function showModelInfo() {
  try {
    const response = await fetch("/info", { headers: authHeaders() });
    if (response.status === 401) {
      $("model-info").textContent = "this server needs an API key: enter it below";
      return;
    }
    const info = await response.json();
    $("model-info").textContent = `${info.model_id} · ${info.model_device_type} · ${info.model_dtype} · context ${info.max_total_tokens}`;
  } catch {
    $("model-info").textContent = "server not ready";
  }
}

function syncDecoding() {
  const greedy = $("decoding").value === "greedy";
  for (const el of document.querySelectorAll(".sampling-only input")) el.disabled = greedy;
}

$("request-form").addEventListener("submit", (event) => {
  event.preventDefault();
  if (running) running.controller.abort(); // Stop: the server sees the disconnect and frees the slot
  else generate();
});
$("decoding").addEventListener("change", syncDecoding);
$("json_schema").addEventListener("input", () => showSchemaError(null));
$("api-key").addEventListener("change", showModelInfo);
$("show-attention").addEventListener("click", () => attentionView?.show());
syncDecoding();
showModelInfo();
