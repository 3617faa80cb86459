// Server-Sent Events over fetch(): EventSource cannot POST (nor send the API key), so the body of a
// fetch() response is read with a stream reader and split into events here.

/** For each piece of the body the network hands over, the JSON payloads of the `data:` events it
 * completes ("[DONE]" is skipped); pieces that complete none yield nothing. */
export async function* sseBatches(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer = (buffer + value).replace(/\r\n?/g, "\n");
    const batch = [];
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const data = dataOf(buffer.slice(0, end));
      buffer = buffer.slice(end + 2);
      if (data !== null && data !== "[DONE]") batch.push(JSON.parse(data));
    }
    if (batch.length) yield batch;
  }
}

/** Yields the JSON payload of every `data:` event of `response` ("[DONE]" is skipped). */
export async function* sseData(response) {
  for await (const batch of sseBatches(response)) yield* batch;
}

/** The joined `data:` lines of one event block, or null when it has none (a comment, a keep-alive). */
function dataOf(block) {
  const lines = block.split("\n").filter((line) => line.startsWith("data:"));
  if (lines.length === 0) return null;
  return lines.map((line) => line.slice(5).replace(/^ /, "")).join("\n");
}
