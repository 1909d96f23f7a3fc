// attnlab's token views, drawn in the browser (appkit/token_views.py mounts them):
//   heatmap     one head's map, every token labelled "position: token" (a subset on long axes)
//   head_view   bertviz's head view, several heads overlaid (drawn by line_views.js)
//   token_mass  the tokens in reading order shaded by the attention they receive (or, with a
//               focus, by the row the focused token sends)
//   model_view  every layer x head as a small head view (bertviz's model view; line_views.js)
//   grid        every layer x head as a small map (means over token blocks on long windows)
//   focus_bar   which token is focused (and a button to clear it)
// Click to focus: a click on a token in any view focuses it in every view of the same analysis on
// the page at once (no server round trip), then tells Python (trigger "focus" = {focus, seq}) so the
// focus reaches the URL and the other pages: through the page's focus bar when it has one (Python
// reruns only the bar's fragment, so the views are not sent again), else through the view itself.
// A click on the focused token clears it.
// Drill down: the grid and the model view frame the head the page shows; a click on another head
// (a map of the grid, a token of the model view, which it also focuses) tells Python (trigger
// "head" = {layer, head, focus, seq}), which makes it the layer and head of the map and head view.
// Python's data carries the focus it knows and the sequence number of the last click it handled:
// an older answer never overwrites a newer click.

const FOCUS = "#ff7f0e";
const LINE = [31, 119, 180];
const VIRIDIS = ["#440154", "#482878", "#3e4989", "#31688e", "#26828e", "#1f9e89", "#35b779", "#6ece58", "#b5de2b", "#fde725"];
const BUS = (window.attnlabTokenViews ||= { groups: new Map() });  // group -> {focus, seq, roots: Set}

function group(name) {
  if (!BUS.groups.has(name)) BUS.groups.set(name, { focus: null, seq: 0, roots: new Set() });
  return BUS.groups.get(name);
}

function decode(b64, Kind) {  // little-endian base64 -> typed array
  if (!b64) return null;
  let bytes;
  if (Uint8Array.fromBase64) bytes = Uint8Array.fromBase64(b64);
  else {
    const s = atob(b64);
    bytes = new Uint8Array(s.length);
    for (let i = 0; i < s.length; i++) bytes[i] = s.charCodeAt(i);
  }
  return new Kind(bytes.buffer);
}

function hexRgb(h) {
  return [1, 3, 5].map((i) => parseInt(h.slice(i, i + 2), 16));
}
const VIR = VIRIDIS.map(hexRgb);

function viridis(t) {  // t in [0, 1] -> css colour (linear between the 10 stops)
  if (!Number.isFinite(t)) return "#e6e6e6";
  const x = Math.min(Math.max(t, 0), 1) * (VIR.length - 1);
  const i = Math.min(Math.floor(x), VIR.length - 2), f = x - i;
  const c = VIR[i].map((a, k) => Math.round(a + f * (VIR[i + 1][k] - a)));
  return `rgb(${c[0]},${c[1]},${c[2]})`;
}

const LUT = Uint8Array.from({ length: 256 * 3 }, (_, k) => viridis(Math.floor(k / 3) / 255).match(/\d+/g)[k % 3]);

function paint(rgba, values, start, count, zmax) {  // values[start ...] / zmax -> viridis pixels (NaN: grey)
  for (let k = 0; k < count; k++) {
    const v = values[start + k] / zmax, o = 4 * k;
    if (v === v) {
      const c = 3 * Math.round((v < 0 ? 0 : v > 1 ? 1 : v) * 255);
      rgba[o] = LUT[c];
      rgba[o + 1] = LUT[c + 1];
      rgba[o + 2] = LUT[c + 2];
    } else rgba[o] = rgba[o + 1] = rgba[o + 2] = 230;
    rgba[o + 3] = 255;
  }
}

function blues(t) {  // plotly's "Blues", approximately: white -> dark blue
  if (!Number.isFinite(t)) return "#f4f4f4";
  const x = Math.min(Math.max(t, 0), 1);
  const a = [247, 251, 255], b = [8, 48, 107];
  return `rgb(${a.map((v, k) => Math.round(v + x * (b[k] - v))).join(",")})`;
}

function label(tokens, i) {
  const t = tokens[i];
  return `${i}: ${t.length > 12 ? t.slice(0, 11) + "…" : t}`;
}

function top3(values, tokens) {  // "j: tok 0.41, ..." of the three largest entries
  const order = [...values.keys()].sort((a, b) => (values[b] || 0) - (values[a] || 0)).slice(0, 3);
  return order.map((j) => `${j}: ${tokens[j]} ${values[j].toFixed(2)}`).join(", ");
}

function canvas(root, cls, w, h) {
  let c = root.querySelector("canvas." + cls);
  if (!c) {
    c = document.createElement("canvas");
    c.className = cls;
    root.appendChild(c);
  }
  const r = window.devicePixelRatio || 1;
  c.width = Math.round(w * r);
  c.height = Math.round(h * r);
  c.style.width = w + "px";
  c.style.height = h + "px";
  const g = c.getContext("2d");
  g.setTransform(r, 0, 0, r, 0, 0);
  g.clearRect(0, 0, w, h);
  g.font = "12px sans-serif";
  return [c, g];
}

function header(root, text) {
  let h = root.querySelector(".av-title");
  if (!h) {
    h = document.createElement("div");
    h.className = "av-title";
    root.appendChild(h);
  }
  h.textContent = text;
}

function tip(root) {
  let t = root.querySelector(".av-tip");
  if (!t) {
    t = document.createElement("div");
    t.className = "av-tip";
    root.appendChild(t);
  }
  return t;
}

function showTip(root, ev, text) {
  const t = tip(root);
  if (!text) {
    t.style.display = "none";
    return;
  }
  const box = root.getBoundingClientRect();
  t.textContent = text;
  t.style.display = "block";
  t.style.left = ev.clientX - box.left + 14 + "px";
  t.style.top = ev.clientY - box.top + 14 + "px";
}

// ---- heatmap ---------------------------------------------------------------------------------
function drawHeatmap(root, d, focus) {
  const N = d.n, map = d.map, tokens = d.tokens;
  const width = Math.max(320, root.clientWidth || 600);
  const probe = document.createElement("canvas").getContext("2d");
  probe.font = "12px sans-serif";
  const longest = Math.max(0, ...tokens.map((_, i) => probe.measureText(label(tokens, i)).width));
  const left = Math.min(130, longest + 26), top = 8, bottom = Math.min(110, longest + 24), bar = 80;
  const cell = Math.max(1, Math.min(28, (width - left - bar) / N));
  const side = cell * N;
  const [c, g] = canvas(root, "av-canvas", left + side + bar, top + side + bottom);
  const zmax = d.zmax > 0 ? d.zmax : 1;
  const img = new ImageData(Math.max(N, 1), Math.max(N, 1));  // one pixel per cell, then scaled
  paint(img.data, map, 0, N * N, zmax);
  const off = document.createElement("canvas");
  off.width = off.height = Math.max(N, 1);
  off.getContext("2d").putImageData(img, 0, 0);
  g.imageSmoothingEnabled = false;
  if (N) g.drawImage(off, left, top, side, side);
  const every = cell >= 8 ? 1 : Math.ceil(9 / cell);  // every token labelled down to 8 px a cell
  g.font = `${Math.round(Math.min(12, Math.max(8, cell - 1)))}px sans-serif`;
  g.fillStyle = "#222";
  g.textBaseline = "middle";
  g.textAlign = "right";
  for (let i = 0; i < N; i += every) g.fillText(label(tokens, i), left - 4, top + (i + 0.5) * cell);
  g.textAlign = "right";
  for (let j = 0; j < N; j += every) {
    g.save();
    g.translate(left + (j + 0.5) * cell, top + side + 4);
    g.rotate(-Math.PI / 2);
    g.fillText(label(tokens, j), 0, 0);
    g.restore();
  }
  g.font = "12px sans-serif";
  g.textAlign = "center";
  g.fillText("key", left + side / 2, top + side + bottom - 8);
  g.save();
  g.translate(12, top + side / 2);
  g.rotate(-Math.PI / 2);
  g.fillText("query", 0, 0);
  g.restore();
  for (let k = 0; k < 100; k++) {  // the colour bar, 0 at the bottom
    g.fillStyle = viridis(k / 99);
    g.fillRect(left + side + 14, top + side - ((k + 1) * side) / 100, 14, side / 100 + 1);
  }
  g.fillStyle = "#222";
  g.textAlign = "left";
  g.fillText(zmax.toFixed(3), left + side + 32, top + 6);
  g.fillText("0", left + side + 32, top + side - 6);
  g.fillText("weight", left + side + 32, top + side / 2);
  if (focus !== null) {
    g.strokeStyle = FOCUS;
    g.lineWidth = 2;
    g.strokeRect(left, top + focus * cell, side, cell);  // the row it sends
    g.strokeRect(left + focus * cell, top, cell, side);  // the column it receives
  }
  const at = (ev) => {
    const r = c.getBoundingClientRect();
    const x = ev.clientX - r.left - left, y = ev.clientY - r.top - top;
    const i = Math.floor(y / cell), j = Math.floor(x / cell);
    if (x < 0 && y >= 0 && i < N) return { i, j: null };  // a query label
    if (y > side && x >= 0 && j < N) return { i: null, j };  // a key label
    return i >= 0 && j >= 0 && i < N && j < N ? { i, j } : null;
  };
  c.onmousemove = (ev) => {
    const p = at(ev);
    if (!p) return showTip(root, ev, null);
    if (p.j === null) return showTip(root, ev, `query ${label(tokens, p.i)}`);
    if (p.i === null) return showTip(root, ev, `key ${label(tokens, p.j)}`);
    showTip(root, ev, `query ${p.i}: ${tokens[p.i]}\nkey ${p.j}: ${tokens[p.j]}\nweight ${map[p.i * N + p.j].toFixed(4)}`);
  };
  c.onmouseleave = (ev) => showTip(root, ev, null);
  c.onclick = (ev) => {
    const p = at(ev);
    if (p) click(root, p.i === null ? p.j : p.i);  // a cell focuses its query
  };
  root.pointOf = (pos, key = 1) => {  // client coordinates of cell (pos, key): for tests
    const r = c.getBoundingClientRect();
    return [r.left + left + (key + 0.5) * cell, r.top + top + (pos + 0.5) * cell];
  };
}

// ---- token strip -----------------------------------------------------------------------------
function drawStrip(root, d, focus) {
  const N = d.n, strip = d.strip, tokens = d.tokens, quantized = !strip;  // long windows: 16-bit rows
  const values = new Float64Array(N);
  for (let j = 0; j < N; j++) {
    if (focus === null && quantized) values[j] = d.strip_mass[j];  // exact column mass
    else if (focus === null) {
      let s = 0;
      for (let i = 0; i < N; i++) s += strip[i * N + j];
      values[j] = s;  // column mass
    } else if (quantized) {
      const v = d.strip_q[focus * N + j];
      values[j] = v === 65535 ? NaN : (v * d.strip_max) / 65534;  // the row the focused token sends
    } else values[j] = strip[focus * N + j];
  }
  const approx = quantized && focus !== null ? "≈ " : "";
  const sorted = Array.from(values).filter(Number.isFinite).sort((a, b) => a - b);
  const q = (sorted.length - 1) * 0.95, lo = Math.floor(q);  // the 95th percentile (linear)
  const cap = sorted.length ? Math.max(sorted[lo] + (q - lo) * ((sorted[lo + 1] ?? sorted[lo]) - sorted[lo]), 1e-9) : 1;
  const max = sorted.length ? sorted[sorted.length - 1] : 0;
  const what = focus === null ? "mass" : "weight";
  header(root, focus === null ? d.strip_title : `${d.variant}: attention ${focus}: ${tokens[focus]} sends (${d.strip_where})`);
  let box = root.querySelector(".av-strip");
  if (!box) {
    box = document.createElement("div");
    box.className = "av-strip";
    root.appendChild(box);
  }
  const cells = [];
  for (let j = 0; j < N; j++) {
    const t = values[j] / cap;
    const span = document.createElement("span");
    span.className = "av-token" + (j === focus ? " av-focus" : "");
    span.textContent = tokens[j];
    span.style.background = blues(t);
    span.style.color = t > 0.55 ? "white" : "#111";
    span.dataset.position = j;
    span.title = `token ${j}: ${tokens[j]}\n${what} ${approx}${values[j].toFixed(4)}`;
    span.onclick = () => click(root, j);
    cells.push(span);
  }
  box.replaceChildren(...cells);
  let note = root.querySelector(".av-note");
  if (!note) {
    note = document.createElement("div");
    note.className = "av-note";
    root.appendChild(note);
  }
  note.textContent = `Colour: ${what} (1/N = ${(1 / N).toPrecision(3)}), from 0 (white) to ${cap.toPrecision(3)} (dark blue)` +
    (max > cap ? `; the scale is capped at the 95th percentile (${cap.toPrecision(3)}; max ${max.toPrecision(3)}): hover a token for its value.` : ".");
  root.pointOf = (pos) => {
    const r = cells[pos].getBoundingClientRect();
    return [r.left + r.width / 2, r.top + r.height / 2];
  };
}

// ---- grid ------------------------------------------------------------------------------------
function drawGrid(root, d, focus) {
  const { layers: L, heads: H, side_m: m, side_n: n, block: f, tokens } = d, g4 = d.grid;  // (L, H, m, n)
  const gap = 6, left = 58, top = 20, bar = 70;  // maps of cell_px, narrower when the page is
  const cell = Math.max(16, Math.min(d.cell_px, ((root.clientWidth || 1000) - left - bar) / H - gap));
  const [c, g] = canvas(root, "av-canvas", left + H * (cell + gap) + bar, top + L * (cell + gap));
  const zmax = d.zmax > 0 ? d.zmax : 1;
  const off = document.createElement("canvas");
  off.width = Math.max(n, 1);
  off.height = Math.max(m, 1);
  const og = off.getContext("2d"), img = og.createImageData(off.width, off.height);
  g.imageSmoothingEnabled = false;
  g.textBaseline = "middle";
  g.fillStyle = "#222";
  g.textAlign = "center";
  for (let h = 0; h < H; h++) g.fillText(`head ${h}`, left + h * (cell + gap) + cell / 2, 9);
  for (let l = 0; l < L; l++) {
    g.fillStyle = "#222";
    g.textAlign = "right";
    g.fillText(`layer ${l}`, left - 6, top + l * (cell + gap) + cell / 2);
    for (let h = 0; h < H; h++) {
      paint(img.data, g4, (l * H + h) * m * n, m * n, zmax);
      og.putImageData(img, 0, 0);
      const x0 = left + h * (cell + gap), y0 = top + l * (cell + gap);
      g.drawImage(off, x0, y0, cell, cell);
      if (focus !== null) {  // the focused token's row and column (its token block's, when averaged)
        const b = Math.floor(focus / f);
        g.strokeStyle = FOCUS;
        g.lineWidth = 1.5;
        g.strokeRect(x0, y0 + (b * cell) / m, cell, cell / m);
        g.strokeRect(x0 + (b * cell) / n, y0, cell / n, cell);
      }
      if (l === d.layer_shown && h === d.head_shown) frame(g, x0 - 3, y0 - 3, cell + 6, cell + 6);
    }
  }
  const x0 = left + H * (cell + gap) + 8, span = L * (cell + gap) - gap;
  for (let k = 0; k < 100; k++) {
    g.fillStyle = viridis(k / 99);
    g.fillRect(x0, top + span - ((k + 1) * span) / 100, 14, span / 100 + 1);
  }
  g.fillStyle = "#222";
  g.textAlign = "left";
  g.fillText(zmax.toFixed(3), x0 + 18, top + 6);
  g.fillText("0", x0 + 18, top + span - 6);
  g.fillText("weight", x0 + 18, top + span / 2);
  const PLURAL = { query: "queries", key: "keys" };
  const range = (i, count, what) =>
    f === 1 ? `${what} ${i}: ${tokens[i]}` : `${PLURAL[what]} ${i * f}-${Math.min((i + 1) * f, count) - 1}`;
  c.onmousemove = (ev) => {
    const r = c.getBoundingClientRect();
    const x = ev.clientX - r.left - left, y = ev.clientY - r.top - top;
    const h = Math.floor(x / (cell + gap)), l = Math.floor(y / (cell + gap));
    const j = Math.floor(((x - h * (cell + gap)) / cell) * n), i = Math.floor(((y - l * (cell + gap)) / cell) * m);
    if (h < 0 || h >= H || l < 0 || l >= L || i < 0 || i >= m || j < 0 || j >= n) return showTip(root, ev, null);
    const v = g4[(l * H + h) * m * n + i * n + j];
    showTip(root, ev, `layer ${l}, head ${h}\n${range(i, d.n, "query")}\n${range(j, d.n, "key")}\nweight ${v.toFixed(4)}`);
  };
  c.onmouseleave = (ev) => showTip(root, ev, null);
  const tile = (ev) => {
    const r = c.getBoundingClientRect();
    const h = Math.floor((ev.clientX - r.left - left) / (cell + gap)), l = Math.floor((ev.clientY - r.top - top) / (cell + gap));
    return h >= 0 && h < H && l >= 0 && l < L ? { l, h } : null;
  };
  c.onclick = (ev) => {  // a map of the grid: its layer and head become the page's
    const t = tile(ev);
    if (t && (t.l !== d.layer_shown || t.h !== d.head_shown)) drill(root, t.l, t.h);
  };
  root.pointOf = (l, h) => {
    const r = c.getBoundingClientRect();
    return [r.left + left + h * (cell + gap) + cell / 2, r.top + top + l * (cell + gap) + cell / 2];
  };
}

// ---- focus bar -------------------------------------------------------------------------------
function drawFocusBar(root, d, focus) {
  let line = root.querySelector(".av-bar");
  if (!line) {
    line = document.createElement("div");
    line.className = "av-bar";
    root.appendChild(line);
  }
  if (focus === null) {
    line.replaceChildren(Object.assign(document.createElement("span"), { className: "av-hint", textContent: d.hint }));
    return;
  }
  const what = document.createElement("span");
  what.innerHTML = "<b></b> — the row it sends and the column it receives are outlined in orange; click it again or clear.";
  what.firstChild.textContent = `Focus: token ${focus} “${d.tokens[focus]}”`;
  const clear = Object.assign(document.createElement("button"), { className: "av-clear", textContent: "Clear focus" });
  clear.onclick = () => click(root, focus);
  line.replaceChildren(what, clear);
}

const DRAW = { grid: drawGrid, focus_bar: drawFocusBar, heatmap: drawHeatmap, head_view: drawHeadView, token_mass: drawStrip, model_view: drawModelView };

function draw(root) {
  const d = root.attnlab, focus = group(d.group).focus;
  if (d.kind === "head_view") {  // the heads overlaid (line_views.js)
    d.shownNow = shownHeads(root, d);
    d.title = headViewTitle(d, d.shownNow);
  }
  const f = focus !== null && focus < d.n ? focus : null;
  if (d.kind !== "token_mass" && d.kind !== "focus_bar") header(root, f === null || d.kind === "heatmap" ? d.title : `${d.title} (focus: ${f}: ${d.tokens[f]})`);
  DRAW[d.kind](root, d, f);
  root.dataset.focus = f === null ? "" : String(f);  // read by the browser tests
  root.dataset.title = d.kind === "focus_bar" ? root.textContent : root.querySelector(".av-title").textContent;
}

function click(root, position) {
  const d = root.attnlab, gr = group(d.group);
  gr.focus = gr.focus === position ? null : position;  // the focused token clicked again: cleared
  gr.seq += 1;
  for (const r of gr.roots) if (r.isConnected) draw(r);
  const to = gr.bar && gr.bar.isConnected ? gr.bar : root;
  to.attnlabSend({ focus: gr.focus === null ? -1 : gr.focus, seq: gr.seq });
}

function frame(g, x, y, w, h) {  // the head the page shows, in the grid and the model view
  g.strokeStyle = "#222";
  g.lineWidth = 2;
  g.strokeRect(x, y, w, h);
}

function drill(root, layer, head, position) {
  // Drill down: a head of the grid or the model view becomes the layer and head of the page's map
  // and head view (a full rerun: Python sends their data). A model-view click also focuses its
  // token, drawn at once here and sent along.
  const d = root.attnlab, gr = group(d.group);
  if (position !== undefined) {
    gr.focus = gr.focus === position ? null : position;
    gr.seq += 1;
    for (const r of gr.roots) if (r.isConnected) draw(r);
  }
  root.attnlabHead({ layer, head, focus: gr.focus === null ? -1 : gr.focus, seq: gr.seq });
}

export default function (component) {
  const { data, parentElement, setTriggerValue } = component;
  let root = parentElement.querySelector(".attnlab-view");
  if (!root) {
    root = document.createElement("div");
    root.className = "attnlab-view";
    parentElement.appendChild(root);
  }
  const d = { ...data, grid: decode(data.grid, Float32Array), map: decode(data.map, Float32Array), strip: decode(data.strip, Float32Array),
    strip_q: decode(data.strip_q, Uint16Array), strip_mass: decode(data.strip_mass, Float32Array), model_idx: decode(data.model_idx, Uint16Array), model_val: decode(data.model_val, Uint8Array),
    model_off: decode(data.model_off, Uint32Array), heads_map: decode(data.heads_map, Float32Array) };
  root.attnlab = d;
  root.attnlabSend = (v) => setTriggerValue("focus", v);
  root.attnlabHead = (v) => setTriggerValue("head", v);
  root.attnlabHeads = (v) => setTriggerValue("heads", v);
  root.redraw = () => draw(root);
  root.dataset.kind = d.kind;
  const gr = group(d.group);
  for (const r of gr.roots) if (!r.isConnected) gr.roots.delete(r);
  gr.roots.add(root);
  if (d.kind === "focus_bar") gr.bar = root;
  if (d.seq >= gr.seq) {  // Python's focus is at least as new as the last click here
    gr.focus = d.focus;
    gr.seq = d.seq;
  }
  draw(root);
  let width = root.clientWidth;  // the maps and line views fit the page's width: redrawn when it changes
  const resize = new ResizeObserver(() => {
    if (root.clientWidth !== width && d.kind !== "token_mass" && d.kind !== "focus_bar") {
      width = root.clientWidth;
      draw(root);
    }
  });
  resize.observe(root);
  return () => {
    resize.disconnect();
    gr.roots.delete(root);
  };
}
