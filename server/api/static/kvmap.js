// The live map of the KV-cache block pool: one cell per block, fed by GET /kv/stream while the tab is
// open (the server takes no snapshots when no one watches). Held blocks take their request's colour,
// shared ones show how many requests hold them, cached ones fade by eviction order (the palest goes first),
// and a block hit by the prefix cache in the last second is outlined.
import { $, authHeaders } from "./api.js";
import { sseData } from "./sse.js";

const HIT_MS = 1000; // how long a hit stays outlined
const LISTED_REQUESTS = 12; // running requests listed under the map; the rest are counted
const RECONNECT_MS = 1000;

/** A request's colour, the same for the same id. */
export function requestColour(requestId) {
  let h = 0;
  for (const c of requestId) h = (h * 31 + c.charCodeAt(0)) >>> 0;
  return `hsl(${(h * 137.508) % 360}, 62%, 48%)`;
}

export class KVMap {
  constructor() {
    this.latest = null; // the newest snapshot
    this.listeners = new Set(); // called with each snapshot (the guided demo)
    this.hitAt = []; // per block: when its hit count last went up (performance.now())
    this.controller = null;
    setInterval(() => this.latest && this.controller && this.render(), 250); // expires the hit outlines
  }

  /** Starts watching (the tab is open). */
  start() {
    if (this.controller) return;
    this.controller = new AbortController();
    this.watch(this.controller.signal);
  }

  /** Stops watching: the stream closes and the server's snapshot loop stops with its last watcher. */
  stop() {
    this.controller?.abort();
    this.controller = null;
  }

  async watch(signal) {
    while (!signal.aborted) {
      try {
        const response = await fetch("/kv/stream", { headers: authHeaders(), signal });
        if (response.status === 401) {
          $("kv-status").textContent = "this server needs an API key: enter it at the top of the page";
          this.controller = null;
          return;
        }
        if (!response.ok) throw new Error(`${response.status} ${response.statusText}`);
        $("kv-status").textContent = "live";
        for await (const snapshot of sseData(response)) this.show(snapshot);
        $("kv-status").textContent = "reconnecting…"; // the stream ends after a while; a new one starts
      } catch (error) {
        if (signal.aborted) return;
        $("kv-status").textContent = `disconnected (${error.message}); retrying…`;
      }
      await new Promise((resolve) => setTimeout(resolve, RECONNECT_MS));
    }
  }

  show(snapshot) {
    const now = performance.now();
    const previous = this.latest;
    if (!previous || previous.num_blocks !== snapshot.num_blocks) this.hitAt = new Array(snapshot.num_blocks).fill(-Infinity);
    else snapshot.hit_counts.forEach((hits, b) => { if (hits > previous.hit_counts[b]) this.hitAt[b] = now; });
    this.latest = snapshot;
    this.render();
    for (const listener of this.listeners) listener(snapshot);
  }

  render() {
    const s = this.latest;
    const map = $("kv-map");
    if (map.children.length !== s.num_blocks) {
      // big cells for a small pool, small ones for a large pool (a thousand blocks still fit a screen)
      map.style.setProperty("--cell", `${s.num_blocks <= 128 ? 34 : s.num_blocks <= 512 ? 24 : 15}px`);
      map.replaceChildren(...Array.from({ length: s.num_blocks }, (_, b) => {
        const cell = document.createElement("div");
        cell.dataset.block = String(b);
        return cell;
      }));
    }
    const holders = new Map(); // block -> request ids, in admission order
    for (const r of s.requests) for (const b of r.blocks) holders.set(b, [...(holders.get(b) ?? []), r.request_id]);
    const lruRank = new Map(s.cached_lru.map((b, i) => [b, i]));
    const now = performance.now();
    for (const cell of map.children) {
      const b = Number(cell.dataset.block);
      const held = holders.get(b);
      const hit = now - this.hitAt[b] < HIT_MS;
      let state = "free", colour = "", opacity = "", label = "";
      let title = `block ${b}`;
      if (held) {
        state = held.length > 1 ? "held shared" : "held";
        colour = requestColour(held[0]);
        label = held.length > 1 ? `×${held.length}` : "";
        title += `: held by ${held.join(", ")}`;
      } else if (lruRank.has(b)) {
        state = "cached";
        // the next to be evicted (rank 0) is palest
        opacity = (0.3 + (0.7 * (lruRank.get(b) + 1)) / s.cached_lru.length).toFixed(2);
        title += `: cached, ${s.cached_lru.length - lruRank.get(b) - 1} cached blocks evicted after it`;
      } else {
        title += ": free";
      }
      if (s.hit_counts[b]) title += ` · ${s.hit_counts[b]} prefix-cache hits`;
      cell.className = `cell ${state}${hit ? " hit" : ""}`;
      cell.style.background = colour;
      cell.style.opacity = opacity;
      cell.textContent = label;
      cell.title = title;
    }
    this.renderCounters(s);
    this.renderRequests(s);
  }

  renderCounters(s) {
    const rate = s.prefix_cache_queries ? `${((100 * s.prefix_cache_hits) / s.prefix_cache_queries).toFixed(1)}%` : "–";
    const figures = { free: s.free_blocks, held: s.held_blocks, cached: s.cached_blocks, running: s.requests.length,
                      waiting: s.num_waiting, "hit-rate": rate, evictions: s.evictions, preemptions: s.preemptions };
    for (const [name, value] of Object.entries(figures)) $(`kv-${name}`).textContent = String(value);
    $("kv-pool").textContent = `${s.num_blocks} blocks of ${s.block_size} tokens`;
  }

  renderRequests(s) {
    const shared = (b) => s.ref_counts[b] > 1;
    const items = s.requests.slice(0, LISTED_REQUESTS).map((r) => {
      const item = document.createElement("li");
      const swatch = Object.assign(document.createElement("span"), { className: "swatch" });
      swatch.style.background = requestColour(r.request_id);
      const sharedCount = r.blocks.filter(shared).length;
      item.append(swatch, `${r.request_id} · ${r.num_tokens} tokens in ${r.blocks.length} blocks` +
                  (sharedCount ? ` (${sharedCount} shared)` : "") +
                  (r.cached_tokens ? ` · ${r.cached_tokens} prompt tokens from the cache` : "") +
                  (r.use_cache ? "" : " · no cache: recomputes every step"));
      return item;
    });
    if (s.requests.length > LISTED_REQUESTS) {
      items.push(Object.assign(document.createElement("li"), {
        className: "more", textContent: `… and ${s.requests.length - LISTED_REQUESTS} more running` }));
    }
    $("kv-requests").replaceChildren(...items);
  }
}
