// The race's chart: each token's latency by its index, one series per lane, drawn as SVG (a point per
// token, each carrying its index and milliseconds, so the page can be read back as well as seen).
const SVG = "http://www.w3.org/2000/svg";
const WIDTH = 900, HEIGHT = 300;
const PAD = { left: 56, right: 16, top: 14, bottom: 38 };

function el(name, attrs = {}, text = null) {
  const node = document.createElementNS(SVG, name);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  if (text !== null) node.textContent = text;
  return node;
}

/** A round step for about `count` ticks between 0 and `max`. */
function tickStep(max, count) {
  const raw = max / count;
  const magnitude = 10 ** Math.floor(Math.log10(raw));
  return [1, 2, 5, 10].map((m) => m * magnitude).find((s) => s >= raw);
}

export class LatencyChart {
  /** `series`: [{ name, label }] in drawing order; each name is also the CSS class of its marks. */
  constructor(svg, series) {
    this.svg = svg;
    this.series = series;
    this.svg.setAttribute("viewBox", `0 0 ${WIDTH} ${HEIGHT}`);
    this.clear(1);
  }

  /** Empties the chart for a race of `maxTokens` tokens per lane (the x axis). */
  clear(maxTokens) {
    this.maxTokens = Math.max(1, maxTokens);
    this.points = Object.fromEntries(this.series.map((s) => [s.name, []]));
    this.render();
  }

  /** Token `index` (1-based) of lane `name` arrived `ms` after the previous one (the first: after the request). */
  add(name, index, ms) {
    this.points[name].push({ index, ms });
    if (!this.pending) {
      this.pending = true;
      requestAnimationFrame(() => { this.pending = false; this.render(); });
    }
  }

  render() {
    const all = Object.values(this.points).flat();
    const yMax = Math.max(1, ...all.map((p) => p.ms)) * 1.08;
    const x = (i) => PAD.left + ((i - 1) / Math.max(1, this.maxTokens - 1)) * (WIDTH - PAD.left - PAD.right);
    const y = (ms) => HEIGHT - PAD.bottom - (ms / yMax) * (HEIGHT - PAD.top - PAD.bottom);
    const nodes = [];
    const yStep = tickStep(yMax, 5);
    for (let ms = 0; ms <= yMax; ms += yStep) {
      nodes.push(el("line", { class: "grid", x1: PAD.left, x2: WIDTH - PAD.right, y1: y(ms), y2: y(ms) }));
      nodes.push(el("text", { class: "tick", x: PAD.left - 6, y: y(ms) + 4, "text-anchor": "end" },
                    ms >= 100 ? ms.toFixed(0) : ms.toFixed(ms >= 10 ? 0 : 1)));
    }
    const xStep = tickStep(this.maxTokens, 8);
    for (let i = xStep; i <= this.maxTokens; i += xStep) {
      nodes.push(el("text", { class: "tick", x: x(i), y: HEIGHT - PAD.bottom + 16, "text-anchor": "middle" }, String(i)));
    }
    nodes.push(el("text", { class: "axis-label", x: (WIDTH + PAD.left) / 2, y: HEIGHT - 4, "text-anchor": "middle" },
                  "token index (token 1: from the server's answer; then from the token before)"));
    nodes.push(el("text", { class: "axis-label", transform: `translate(14 ${(HEIGHT - PAD.bottom) / 2}) rotate(-90)`,
                            "text-anchor": "middle" }, "latency (ms)"));
    for (const { name } of this.series) {
      const points = this.points[name];
      if (points.length === 0) continue;
      nodes.push(el("polyline", { class: `series ${name}`, points: points.map((p) => `${x(p.index)},${y(p.ms)}`).join(" ") }));
      for (const p of points) {
        const dot = el("circle", { class: `point ${name}`, cx: x(p.index), cy: y(p.ms), r: 2.6,
                                   "data-index": p.index, "data-ms": p.ms.toFixed(3) });
        dot.append(el("title", {}, `${name}: token ${p.index}, ${p.ms.toFixed(1)} ms`));
        nodes.push(dot);
      }
    }
    let lx = PAD.left + 10;
    for (const { name, label } of this.series) {
      nodes.push(el("circle", { class: `legend-dot ${name}`, cx: lx, cy: PAD.top + 4, r: 4 }));
      nodes.push(el("text", { class: "legend-label", x: lx + 9, y: PAD.top + 8 }, label));
      lx += 16 + label.length * 7.2;
    }
    this.svg.replaceChildren(...nodes);
  }
}
