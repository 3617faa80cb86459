// The attention view: a canvas heat map of which earlier tokens each generated token attended to, per
// layer and head or averaged over heads, and a token strip where hovering a generated token lights up
// what it looked at. Input: `details.attention` of a finished generation (see docs/playground.md).
const $ = (id) => document.getElementById(id);
const MEAN = "mean";
const RAMP = [[255, 255, 255], [107, 174, 214], [8, 48, 107]]; // white -> light blue -> deep blue
const FUTURE_COLOUR = "#ececec";
const ROW_LABEL_WIDTH = 110;
const MAX_CELL = 22;
const MIN_LABELLED_CELL = 9; // smaller cells get no per-token labels

export class AttentionView {
  /** attention: {tokens, query_start, layers, heads, weights[layer][head][query][key]} */
  constructor(attention, generatedTokens) {
    this.attention = attention;
    this.generatedTokens = generatedTokens;
    this.numQueries = attention.weights[0][0].length;
    this.numKeys = attention.tokens.length;
    this.layer = attention.layers - 1;
    this.head = MEAN;
    this.hovered = null; // the query row under the pointer
  }

  show() {
    const { layers, heads, query_start: queryStart } = this.attention;
    const covered = this.numQueries < this.generatedTokens ? `the first ${this.numQueries} of ${this.generatedTokens}` : `all ${this.numQueries}`;
    $("attention-note").textContent =
      `Rows: ${covered} generated tokens (queries); columns: every earlier token (keys, ${queryStart} from the prompt). ` +
      `${layers} layers × ${heads} heads. Grey cells are the future, which a token cannot see.`;
    fillSelect($("layer"), [...Array(layers).keys()].map((l) => [l, `${l}`]), this.layer);
    fillSelect($("head"), [[MEAN, "average over heads"], ...[...Array(heads).keys()].map((h) => [h, `${h}`])], this.head);
    $("layer").onchange = () => { this.layer = Number($("layer").value); this.redraw(); };
    $("head").onchange = () => { this.head = $("head").value === MEAN ? MEAN : Number($("head").value); this.redraw(); };
    $("sqrt-scale").onchange = () => this.redraw();
    this.buildTokenStrip();
    $("attention").hidden = false;
    this.bindCanvas();
    this.redraw();
    $("attention").scrollIntoView({ block: "start" });
  }

  hide() {
    $("attention").hidden = true;
  }

  /** The (queries x keys) weights for the chosen layer and head, or their mean over heads. */
  matrix() {
    const perHead = this.attention.weights[this.layer];
    if (this.head !== MEAN) return perHead[this.head];
    return perHead[0].map((row, q) => row.map((_, k) => perHead.reduce((sum, h) => sum + h[q][k], 0) / perHead.length));
  }

  intensity(weight) {
    return $("sqrt-scale").checked ? Math.sqrt(weight) : weight;
  }

  redraw() {
    this.weights = this.matrix();
    this.draw();
    this.highlight(this.hovered);
  }

  buildTokenStrip() {
    const { tokens, query_start: queryStart } = this.attention;
    const strip = $("attention-tokens");
    strip.replaceChildren();
    this.tokenSpans = tokens.map((text, position) => {
      const span = document.createElement("span");
      const query = position - queryStart;
      span.className = "tok " + (query >= 0 ? "generated" : "prompt");
      span.textContent = text.replaceAll("\n", "↵\n");
      if (query >= 0) {
        span.dataset.query = String(query);
        span.onmouseenter = () => this.highlight(query);
        span.onmouseleave = () => this.highlight(null);
      }
      strip.append(span);
      return span;
    });
  }

  /** Lights up what query row `query` attended to (null clears), in the strip and on the map. */
  highlight(query) {
    this.hovered = query;
    const row = query === null ? null : this.weights[query];
    this.tokenSpans.forEach((span, key) => {
      const weight = row ? row[key] : 0;
      span.style.backgroundColor = row && weight > 0 ? `rgba(33, 113, 181, ${this.intensity(weight).toFixed(3)})` : "";
      span.style.color = row && this.intensity(weight) > 0.55 ? "white" : "";
      span.title = row ? `weight ${weight.toFixed(4)}` : "";
      span.classList.toggle("hovered", query !== null && key === this.attention.query_start + query);
    });
    this.draw();
  }

  layout() {
    const available = $("attention").clientWidth - ROW_LABEL_WIDTH - 16;
    const cell = Math.max(2, Math.min(MAX_CELL, Math.floor(available / this.numKeys)));
    const top = cell >= MIN_LABELLED_CELL ? 70 : 12;
    return { cell, top, left: ROW_LABEL_WIDTH, width: ROW_LABEL_WIDTH + cell * this.numKeys + 8, height: top + cell * this.numQueries + 4 };
  }

  draw() {
    const canvas = $("heatmap");
    const { cell, top, left, width, height } = (this.geometry = this.layout());
    const ratio = window.devicePixelRatio || 1;
    canvas.width = width * ratio;
    canvas.height = height * ratio;
    canvas.style.width = `${width}px`;
    canvas.style.height = `${height}px`;
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    const queryStart = this.attention.query_start;
    for (let q = 0; q < this.numQueries; q++) {
      for (let k = 0; k < this.numKeys; k++) {
        ctx.fillStyle = k > queryStart + q ? FUTURE_COLOUR : colour(this.intensity(this.weights[q][k]));
        ctx.fillRect(left + k * cell, top + q * cell, cell, cell);
      }
    }
    ctx.strokeStyle = "#c0392b"; // where the prompt ends and generation begins
    ctx.beginPath();
    ctx.moveTo(left + queryStart * cell + 0.5, top - 4);
    ctx.lineTo(left + queryStart * cell + 0.5, top + this.numQueries * cell);
    ctx.stroke();
    this.drawLabels(ctx, cell, top, left);
    if (this.hovered !== null) {
      ctx.strokeStyle = "#f39c12";
      ctx.lineWidth = 2;
      ctx.strokeRect(left - 1, top + this.hovered * cell - 1, this.numKeys * cell + 2, cell + 2);
      ctx.lineWidth = 1;
    }
  }

  drawLabels(ctx, cell, top, left) {
    const tokens = this.attention.tokens;
    ctx.fillStyle = "#333";
    ctx.font = "11px ui-monospace, monospace";
    const every = cell >= MIN_LABELLED_CELL ? 1 : Math.ceil(MIN_LABELLED_CELL / cell);
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    for (let q = 0; q < this.numQueries; q += every) {
      ctx.fillText(shortLabel(tokens[this.attention.query_start + q]), left - 6, top + q * cell + cell / 2, left - 10);
    }
    if (cell < MIN_LABELLED_CELL) return;
    ctx.textAlign = "left";
    for (let k = 0; k < this.numKeys; k++) {
      ctx.save();
      ctx.translate(left + k * cell + cell / 2, top - 6);
      ctx.rotate(-Math.PI / 3);
      ctx.fillText(shortLabel(tokens[k]), 0, 0, 70);
      ctx.restore();
    }
  }

  bindCanvas() {
    const canvas = $("heatmap");
    const tooltip = $("heatmap-tooltip");
    canvas.onmousemove = (event) => {
      const { cell, top, left } = this.geometry;
      const q = Math.floor((event.offsetY - top) / cell);
      const k = Math.floor((event.offsetX - left) / cell);
      if (q < 0 || q >= this.numQueries || k < 0 || k >= this.numKeys) {
        tooltip.hidden = true;
        if (this.hovered !== null) this.highlight(null);
        return;
      }
      if (q !== this.hovered) this.highlight(q);
      const tokens = this.attention.tokens;
      tooltip.textContent = `${shortLabel(tokens[this.attention.query_start + q])} → ${shortLabel(tokens[k])}: ${this.weights[q][k].toFixed(4)}`;
      tooltip.style.left = `${event.offsetX + 14}px`;
      tooltip.style.top = `${event.offsetY + 14}px`;
      tooltip.hidden = false;
    };
    canvas.onmouseleave = () => {
      tooltip.hidden = true;
      this.highlight(null);
    };
  }
}

function fillSelect(select, options, selected) {
  select.replaceChildren(...options.map(([value, text]) => new Option(text, String(value), false, value === selected)));
}

function shortLabel(text) {
  const visible = text.replaceAll("\n", "↵").replaceAll(" ", "·");
  return visible.length > 12 ? visible.slice(0, 11) + "…" : visible;
}

function colour(t) {
  const x = Math.min(1, Math.max(0, t)) * (RAMP.length - 1);
  const i = Math.min(RAMP.length - 2, Math.floor(x));
  const f = x - i;
  const [r, g, b] = RAMP[i].map((c, j) => Math.round(c + (RAMP[i + 1][j] - c) * f));
  return `rgb(${r}, ${g}, ${b})`;
}
