// The race: one prompt, greedy, generated with the KV cache and without it (and, optionally, once more
// from the prefix cache), shown side by side with live tokens/s and every token's latency on a chart.
import { $, streamTokenBatches } from "./api.js";
import { LatencyChart } from "./itl_chart.js";

const SERIES = [
  { name: "cached", label: "KV cache" },
  { name: "uncached", label: "no cache (recompute every step)" },
  { name: "prefix", label: "KV cache, prompt from the prefix cache" },
];

function formatSeconds(s) {
  return s == null ? "–" : s < 1 ? `${(s * 1000).toFixed(1)} ms` : `${s.toFixed(2)} s`;
}

/** One lane: its stream, its text and live figures, its points on the chart. */
class Lane {
  constructor(name, chart) {
    this.name = name;
    this.chart = chart;
    this.root = $(`lane-${name}`);
  }

  figure(name, text) {
    this.root.querySelector(`[data-figure="${name}"]`).textContent = text;
  }

  reset(enabled) {
    this.root.hidden = !enabled;
    this.text = "";
    this.count = 0;
    this.details = null;
    this.root.querySelector(".lane-text").replaceChildren(
      Object.assign(document.createElement("span"), { className: "prompt", textContent: $("race-prompt").value }));
    for (const name of ["tps", "tokens", "ttft", "total", "cached"]) this.figure(name, "–");
    this.figure("status", enabled ? "waiting" : "off");
    this.root.classList.remove("done", "failed");
  }

  async run(body) {
    this.figure("status", "running");
    const started = performance.now();
    let previous = started;
    let first = null;
    // Token 1's latency runs from the server's answer (the request queued), not from the fetch: the page's
    // own request set-up is no part of what the cache changes. Tokens that arrive together (the network
    // or a busy browser can join several steps' events) share their wait evenly.
    const accepted = () => { previous = performance.now(); };
    try {
      for await (const batch of streamTokenBatches(body, undefined, accepted)) {
        const now = performance.now();
        if (first === null) {
          first = now;
          this.figure("ttft", formatSeconds((now - started) / 1000));
        }
        const share = (now - previous) / batch.length;
        previous = now;
        for (const event of batch) {
          this.count = event.index;
          this.chart.add(this.name, event.index, share);
          this.text += event.token.text;
          const span = document.createElement("span");
          span.className = "token";
          span.textContent = event.token.text;
          this.root.querySelector(".lane-text").append(span);
          if (event.details) this.details = event.details;
        }
        const text = this.root.querySelector(".lane-text");
        text.scrollTop = text.scrollHeight;
        this.figure("tokens", String(this.count));
        if (this.count > 1 && now > first) this.figure("tps", ((this.count - 1) / ((now - first) / 1000)).toFixed(1));
        this.figure("total", formatSeconds((now - started) / 1000));
      }
      this.seconds = (previous - started) / 1000;
      if (this.details) {
        this.figure("ttft", formatSeconds(this.details.time_to_first_token_s));
        this.figure("cached", String(this.details.cached_tokens));
      }
      this.figure("status", "done");
      this.root.classList.add("done");
    } catch (error) {
      this.figure("status", `error: ${error.message}`);
      this.root.classList.add("failed");
      throw error;
    }
  }
}

/** Where two texts part, or -1 when they are the same. */
function firstDifference(a, b) {
  if (a === b) return -1;
  let i = 0;
  while (i < a.length && i < b.length && a[i] === b[i]) i++;
  return i;
}

function showVerdict(lanes) {
  const [cached, ...others] = lanes;
  const parted = others.map((lane) => [lane, firstDifference(cached.text, lane.text)]).filter(([, at]) => at >= 0);
  const verdict = $("race-verdict");
  verdict.dataset.identical = String(parted.length === 0);
  const lines = [];
  if (parted.length === 0) {
    lines.push(`The ${lanes.length} greedy texts are identical (${cached.count} tokens each): ` +
               "the cache changes the speed, not the answer.");
  } else {
    for (const [lane, at] of parted) lines.push(`The ${lane.name} lane's text differs from the cached one at character ${at}.`);
  }
  const uncached = lanes.find((lane) => lane.name === "uncached");
  if (uncached && cached.seconds > 0) {
    lines.push(`Without the cache the same tokens took ${(uncached.seconds / cached.seconds).toFixed(1)}× as long ` +
               `(${formatSeconds(uncached.seconds)} against ${formatSeconds(cached.seconds)}).`);
  }
  const prefix = lanes.find((lane) => lane.name === "prefix");
  if (prefix?.details && cached.details) {
    lines.push(`The prefix lane took ${prefix.details.cached_tokens} of its ${prefix.details.input_length} prompt tokens ` +
               `from the cache: first token after ${formatSeconds(prefix.details.time_to_first_token_s)} against ` +
               `${formatSeconds(cached.details.time_to_first_token_s)}.`);
  }
  verdict.textContent = lines.join(" ");
}

export class Race {
  constructor() {
    this.chart = new LatencyChart($("itl-chart"), SERIES);
    this.lanes = Object.fromEntries(SERIES.map(({ name }) => [name, new Lane(name, this.chart)]));
    this.running = false;
    $("race-form").addEventListener("submit", (event) => {
      event.preventDefault();
      if (!this.running) this.run();
    });
    for (const lane of Object.values(this.lanes)) lane.reset(lane.name !== "prefix" || $("race-prefix").checked);
  }

  async run() {
    const maxTokens = Number($("race-tokens").value);
    const withPrefix = $("race-prefix").checked;
    const atOnce = $("race-at-once").checked;
    // A fresh salt: the cached lane starts cold, and only the prefix lane can hit what it left.
    const salt = `race-${Math.random().toString(36).slice(2)}`;
    const body = (useCache) => ({
      inputs: $("race-prompt").value,
      parameters: { max_new_tokens: maxTokens, ignore_eos: true, use_cache: useCache, cache_salt: salt },
    });
    this.running = true;
    $("race-start").disabled = true;
    $("race-verdict").textContent = "";
    delete $("race-verdict").dataset.identical;
    this.chart.clear(maxTokens);
    const { cached, uncached, prefix } = this.lanes;
    for (const lane of Object.values(this.lanes)) lane.reset(lane !== prefix || withPrefix);
    try {
      if (atOnce) {
        await Promise.all([cached.run(body(true)).then(() => withPrefix && prefix.run(body(true))),
                           uncached.run(body(false))]);
      } else {
        await cached.run(body(true));
        await uncached.run(body(false));
        if (withPrefix) await prefix.run(body(true));
      }
      showVerdict(withPrefix ? [cached, uncached, prefix] : [cached, uncached]);
    } catch (error) {
      $("race-verdict").textContent = `The race stopped: ${error.message}`;
    } finally {
      this.running = false;
      $("race-start").disabled = false;
    }
  }
}
