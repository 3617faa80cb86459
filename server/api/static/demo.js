// The guided demo: a small built-in workload, sized from the server's own pool, that makes the map show
// the cache at work: requests sharing a system prompt's blocks, prefix-cache hits, a cancellation, and
// more demand than the pool holds, so that cached blocks are evicted and running requests preempted.
import { $, callApi, streamTokens } from "./api.js";

const SYSTEM = "You are a player in a company of actors. Answer every question in blank verse, as a character " +
  "of the play would, and never step out of the scene.\n";
const QUESTIONS = ["What news from Verona?", "Who comes here, my lord?", "Why weep you so?", "Where is the king?",
                   "What say you to this?"];
const PAUSE_MS = 1200; // between steps, so that each one's end can be seen on the map
const CANCEL_AFTER = 8; // tokens before the cancelled request is stopped
const OVERCOMMIT = 1.3; // the flood asks for this many times the pool's tokens
const FLOOD_PROMPT_ROOM = 16; // tokens left for each flood prompt ("Scene 12:") within the context

const pause = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

export class GuidedDemo {
  constructor(map) {
    this.map = map;
    this.running = false;
    $("demo-start").addEventListener("click", () => { if (!this.running) this.run(); });
  }

  step(title, text) {
    const item = document.createElement("li");
    item.append(Object.assign(document.createElement("strong"), { textContent: title }), " ",
                Object.assign(document.createElement("span"), { textContent: text }));
    $("demo-steps").append(item);
    return item;
  }

  /** Appends the outcome of a step to its line, and keeps the figures on it for whoever reads the page. */
  outcome(item, text, figures = {}) {
    item.append(Object.assign(document.createElement("em"), { textContent: ` ${text}` }));
    Object.assign(item.dataset, figures);
    item.classList.add("done");
  }

  async run() {
    this.running = true;
    $("demo-start").disabled = true;
    $("demo-steps").replaceChildren();
    $("demo-status").textContent = "running…";
    let mostHolders = 0; // the most requests seen holding one block, on the map
    const watch = (snapshot) => { mostHolders = Math.max(mostHolders, ...snapshot.ref_counts); };
    this.map.listeners.add(watch);
    try {
      await this.workload(() => mostHolders);
      $("demo-status").textContent = "done";
    } catch (error) {
      $("demo-status").textContent = `stopped: ${error.message}`;
    } finally {
      this.map.listeners.delete(watch);
      this.running = false;
      $("demo-start").disabled = false;
    }
  }

  async workload(mostHolders) {
    const info = await callApi("/info");
    const start = await callApi("/kv");
    const context = info.max_total_tokens;
    const blockSize = start.block_size;
    const salt = `demo-${Math.random().toString(36).slice(2)}`; // a cold cache for this run only
    // A system prompt of at least three blocks (repeated if need be), within a third of the context.
    const probe = await callApi("/generate", { inputs: SYSTEM, parameters: { max_new_tokens: 1, details: true,
                                                                              cache_salt: `${salt}-probe` } });
    const perCopy = probe.details.input_length;
    const copies = Math.max(1, Math.min(Math.ceil((3 * blockSize) / perCopy), Math.floor(context / 3 / perCopy)));
    const system = SYSTEM.repeat(copies);
    const answer = Math.max(4, Math.min(160, context - copies * perCopy - 24));
    const prompt = (i) => `${system}Q: ${QUESTIONS[i]}\nA:`;
    const tgi = (i, extra = {}) => ({ inputs: prompt(i), parameters: { max_new_tokens: answer, ignore_eos: true,
                                                                       do_sample: true, temperature: 0.8, seed: i,
                                                                       cache_salt: salt, ...extra } });

    // 1. Sharing: the first request reads the system prompt; three more take its blocks from the cache.
    let item = this.step("1 · Sharing.", `Four requests start with the same ${copies * perCopy}-token system prompt. ` +
                         "The first computes it; the next three find its full blocks in the prefix cache and hold " +
                         "the same blocks (marked ×n on the map) instead of computing them again.");
    let before = await callApi("/kv");
    let firstToken;
    const gotFirst = new Promise((resolve) => { firstToken = resolve; });
    const first = (async () => {
      try { for await (const _ of streamTokens(tgi(0))) firstToken(); } finally { firstToken(); }
    })();
    await gotFirst;
    const others = callApi("/v1/completions", { prompt: [1, 2, 3].map(prompt), max_tokens: answer, temperature: 0.8,
                                               seed: 1, ignore_eos: true, cache_salt: salt });
    await Promise.all([first, others]);
    let after = await callApi("/kv");
    const shared = mostHolders();
    this.outcome(item, `${after.prefix_cache_hits - before.prefix_cache_hits} prompt tokens came from the cache; ` +
                 `up to ${shared} requests held one block at once.`,
                 { hitTokens: after.prefix_cache_hits - before.prefix_cache_hits, mostHolders: shared });
    await pause(PAUSE_MS);

    // 2. A hit on blocks no one holds any more, then a cancellation.
    item = this.step("2 · A hit, then a cancellation.", "The four are done: their blocks are cached (faded, palest " +
                     "first to go). A fifth request with the same system prompt takes them back (outlined: hit), and " +
                     `is cancelled after ${CANCEL_AFTER} tokens: its blocks return at the next step.`);
    before = after;
    const controller = new AbortController();
    let received = 0;
    try {
      for await (const _ of streamTokens(tgi(4), controller.signal)) {
        if (++received === CANCEL_AFTER) {
          controller.abort(); // the server sees the connection close and cancels the request
          break;
        }
      }
    } catch (error) {
      if (error.name !== "AbortError") throw error;
    }
    await pause(PAUSE_MS);
    after = await callApi("/kv");
    this.outcome(item, `${after.prefix_cache_hits - before.prefix_cache_hits} prompt tokens were hits; cancelled ` +
                 `after ${received} tokens, it holds nothing now (${after.held_blocks} blocks held).`,
                 { hitTokens: after.prefix_cache_hits - before.prefix_cache_hits, cancelledAfter: received });

    // 3. More demand than the pool: eviction, then preemption.
    const poolTokens = start.num_blocks * blockSize;
    const count = Math.max(8, Math.min(info.max_batch_size, 64, Math.ceil((OVERCOMMIT * poolTokens) / (context - FLOOD_PROMPT_ROOM))));
    const length = Math.min(context - FLOOD_PROMPT_ROOM, Math.ceil((OVERCOMMIT * poolTokens) / count));
    const fills = count * length > poolTokens;
    item = this.step("3 · Eviction and preemption.", `${count} new requests of ${length} tokens each ask for ` +
                     `${Math.round((100 * count * length) / poolTokens)}% of the pool. Free blocks go first, then ` +
                     "cached ones that served no hit, then those that did, least recently used first (evicted); when none is left, the newest running " +
                     "requests are preempted: their blocks go back, and they recompute when room returns." +
                     (fills ? "" : " (This server's pool is too large for the demo to fill it.)"));
    before = after;
    await callApi("/v1/completions", { prompt: Array.from({ length: count }, (_, i) => `Scene ${i + 1}:`),
                                       max_tokens: length, temperature: 0.8, seed: 3, ignore_eos: true,
                                       cache_salt: `${salt}-flood` });
    after = await callApi("/kv");
    const evictions = after.evictions - before.evictions, preemptions = after.preemptions - before.preemptions;
    this.outcome(item, `${evictions} blocks evicted, ${preemptions} preemptions.`, { evictions, preemptions });
  }
}
