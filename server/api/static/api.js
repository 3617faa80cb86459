// What every tab of the playground shares: element lookup, the API key, and the calls to the public API.
import { sseBatches } from "./sse.js";

export const $ = (id) => document.getElementById(id);

// The server's key when it has one (--api-key): the page itself is public, its API calls are not.
export const authHeaders = () => ($("api-key").value ? { Authorization: `Bearer ${$("api-key").value}` } : {});

/** The message of an error answer, in TGI's shape ({error}) or OpenAI's ({error: {message}}). */
async function failure(response) {
  const body = await response.json().catch(() => ({ error: response.statusText }));
  const message = typeof body.error === "string" ? body.error : body.error?.message;
  return new Error(`${response.status}: ${message ?? response.statusText}`);
}

/** GET or POST (with a JSON body) a route of the API; its JSON answer, or an Error naming the status. */
export async function callApi(path, body = null, signal = undefined) {
  const headers = body === null ? authHeaders() : { "Content-Type": "application/json", ...authHeaders() };
  const response = await fetch(path, { method: body === null ? "GET" : "POST", headers, signal,
                                       body: body === null ? undefined : JSON.stringify(body) });
  if (!response.ok) throw await failure(response);
  return response.json();
}

/** The events of POST /generate_stream for a TGI request body, in the batches the network delivers them
 * (tokens of several steps can arrive together); an error event throws. `onAccepted` is called when the
 * server's answer begins (it has queued the request), before the first token. */
export async function* streamTokenBatches(body, signal = undefined, onAccepted = () => {}) {
  const response = await fetch("/generate_stream", {
    method: "POST",
    headers: { "Content-Type": "application/json", Accept: "text/event-stream", ...authHeaders() },
    body: JSON.stringify(body),
    signal,
  });
  if (!response.ok) throw await failure(response);
  onAccepted();
  for await (const batch of sseBatches(response)) {
    const failed = batch.find((event) => event.error);
    if (failed) throw new Error(failed.error);
    yield batch;
  }
}

/** The events of POST /generate_stream one by one. */
export async function* streamTokens(body, signal = undefined) {
  for await (const batch of streamTokenBatches(body, signal)) yield* batch;
}
