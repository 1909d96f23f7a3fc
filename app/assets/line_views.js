// bertviz's line views, drawn in the browser; loaded with token_views.js (appkit/token_views.py joins
// the two files into one module, so the helpers there -- canvas, label, showTip, click, drill,
// frame, FOCUS, LINE -- are in scope):
//   head_view   queries left, keys right, a line per pair, opacity = weight; several heads of the
//               layer overlaid (bertviz's head view), each in its colour, toggled by the coloured
//               chips above it (the map's head is always shown)
//   model_view  every layer x head as a small head view (bertviz's model view)
// Both take a rectangular map (cross-attention: M target queries left, N source keys right, from
// d.query_tokens and d.tokens, d.m and d.n); there the focus is a key (a source token, the page's
// focus), its lines are the attention it receives; a click on a target token does not focus it.
// A chip click redraws at once here, then tells Python (trigger "heads" = {heads, head, seq}, through
// the page's focus bar when it has one, so only that fragment reruns): the session, the URL and
// the Export menu then know the heads shown.

// ---- head view (with head overlay) ---------------------------------------------------------------
function headViewTitle(d, heads) {
  const which = heads.length === 1 ? `head ${heads[0]}` : `heads ${heads.join(", ")}`;
  return `${d.title_base}, ${which}`;
}

function shownHeads(root, d) {  // Python's heads unless a chip click here is newer
  if (root.headsSeq === undefined || d.heads_seq >= root.headsSeq) {
    root.headsShown = [...d.heads_shown];
    root.headsSeq = d.heads_seq;
  }
  if (!root.headsShown.includes(d.head_shown)) root.headsShown.push(d.head_shown);
  return [...new Set(root.headsShown)].sort((a, b) => a - b);
}

function setHeads(root, heads) {
  const d = root.attnlab;
  root.headsShown = [...new Set([d.head_shown, ...heads])].sort((a, b) => a - b);
  root.headsSeq += 1;
  draw(root);
  const gr = group(d.group), to = gr.bar && gr.bar.isConnected ? gr.bar : root;
  to.attnlabHeads({ heads: root.headsShown, head: d.head_shown, seq: root.headsSeq });
}

function headChips(root, d, heads) {  // "Heads:" then one coloured chip per head of the layer
  let box = root.querySelector(".av-heads");
  if (!box) {
    box = document.createElement("div");
    box.className = "av-heads";
    root.insertBefore(box, root.querySelector("canvas"));
  }
  const items = [Object.assign(document.createElement("span"), { className: "av-heads-label", textContent: "Heads:" })];
  for (let h = 0; h < d.heads; h++) {
    const on = heads.includes(h), chip = document.createElement("span");
    chip.className = "av-chip" + (on ? " av-on" : "") + (h === d.head_shown ? " av-main" : "");
    chip.textContent = String(h);
    chip.dataset.head = h;
    chip.style.borderColor = d.colors[h];
    chip.style.background = on ? d.colors[h] : "white";
    chip.style.color = on ? "white" : d.colors[h];
    chip.title = h === d.head_shown ? `head ${h}: the map's head (always shown)` : `head ${h}: click to ${on ? "hide" : "show"}`;
    chip.onclick = () => {
      if (h !== d.head_shown) setHeads(root, on ? heads.filter((x) => x !== h) : [...heads, h]);
    };
    items.push(chip);
  }
  for (const [text, list] of [["all", [...Array(d.heads).keys()]], [`only ${d.head_shown}`, []]]) {
    const b = Object.assign(document.createElement("button"), { className: "av-heads-button", textContent: text });
    b.onclick = () => setHeads(root, list);
    items.push(b);
  }
  box.replaceChildren(...items);
}

function sides(d) {  // (queries M, keys N, query tokens, cross): cross-attention's are rectangular
  const cross = Array.isArray(d.query_tokens);
  return { M: cross ? d.m : d.n, N: d.n, queries: cross ? d.query_tokens : d.tokens, cross };
}

function drawHeadView(root, d, focus) {
  const { M, N, queries, cross } = sides(d), tokens = d.tokens, min = d.min_weight, heads = d.shownNow;
  const maps = heads.map((h) => d.heads_map.subarray(h * M * N, (h + 1) * M * N));  // (h, M, N)
  const one = heads.length === 1;
  headChips(root, d, heads);
  const row = 20, width = 460, xq = 150, xk = width - 150, top = 12;
  const [c, g] = canvas(root, "av-canvas", width, top * 2 + row * Math.max(M, N));
  let zmax = 0;
  for (const map of maps) for (let k = 0; k < map.length; k++) if (map[k] > zmax) zmax = map[k];
  const y = (i) => top + (i + 0.5) * row;
  const order = heads.map((h, k) => k).sort((a, b) => (heads[a] === d.head_shown) - (heads[b] === d.head_shown));
  for (const pass of focus === null ? [0] : [0, 1]) {  // the focused lines over the faded ones
    for (const k of order) {  // the map's head drawn last, on top
      const map = maps[k], rgb = one ? LINE : hexRgb(d.colors[heads[k]]);
      for (let i = 0; i < M; i++) {
        for (let j = 0; j < N; j++) {
          const w = map[i * N + j];
          if (!(w >= min)) continue;
          const touches = focus !== null && ((!cross && i === focus) || j === focus);
          if (pass === 1 && !touches) continue;
          if (pass === 0 && touches) continue;
          const level = w / (zmax || 1);
          const alpha = (0.15 + 0.85 * level) * (focus !== null && !touches ? 0.12 : 1);
          g.strokeStyle = touches && one ? FOCUS : `rgba(${rgb.join(",")},${touches ? 1 : alpha})`;
          g.globalAlpha = touches ? 0.25 + 0.75 * level : 1;
          g.lineWidth = 1 + 2.5 * level;
          g.beginPath();
          g.moveTo(xq, y(i));
          g.lineTo(xk, y(j));
          g.stroke();
        }
      }
    }
  }
  g.globalAlpha = 1;
  g.textBaseline = "middle";
  for (const [list, n, x, align, focusable] of [[queries, M, xq - 8, "right", !cross], [tokens, N, xk + 8, "left", true]]) {
    g.textAlign = align;
    for (let i = 0; i < n; i++) {
      const on = focusable && i === focus;
      g.fillStyle = on ? FOCUS : "#222";
      g.font = on ? "bold 12px sans-serif" : "12px sans-serif";
      g.fillText(label(list, i), x, y(i));
    }
  }
  const at = (ev) => {
    const r = c.getBoundingClientRect();
    const x = ev.clientX - r.left, i = Math.floor((ev.clientY - r.top - top) / row);
    if (i < 0) return null;
    if (x < xq + 4 && i < M) return { side: "query", i };
    if (x > xk - 4 && i < N) return { side: "key", i };
    return null;
  };
  const per = (k) => (one ? "" : `head ${heads[k]}: `);
  c.onmousemove = (ev) => {
    const p = at(ev);
    if (!p) return showTip(root, ev, null);
    if (p.side === "query") {
      const lines = maps.map((map, k) => per(k) + top3(Array.from(map.subarray(p.i * N, p.i * N + N)), tokens));
      const how = cross ? "\n(the focus is a source token: click one on the right)" : "";
      return showTip(root, ev, `query ${p.i}: ${queries[p.i]} → ${lines.join("\n")}${how}`);
    }
    const lines = maps.map((map, k) => {
      const col = Array.from({ length: M }, (_, i) => map[i * N + p.i]);
      const mass = col.reduce((a, b) => a + (Number.isFinite(b) ? b : 0), 0);
      return `${per(k)}column mass ${mass.toFixed(3)} ← ${top3(col, queries)}`;
    });
    showTip(root, ev, `key ${p.i}: ${tokens[p.i]}, ${lines.join("\n")}`);
  };
  c.onmouseleave = (ev) => showTip(root, ev, null);
  c.onclick = (ev) => {  // cross-attention: a source token (right) alone is focused
    const p = at(ev);
    if (p && (!cross || p.side === "key")) click(root, p.i);
  };
  root.pointOf = (pos) => {  // a token's label (cross-attention: a key's, on the right): for tests
    const r = c.getBoundingClientRect();
    return [r.left + (cross ? xk + 20 : xq - 20), r.top + y(pos)];
  };
  root.chipOf = (h) => {  // for tests
    const r = root.querySelector(`.av-chip[data-head="${h}"]`).getBoundingClientRect();
    return [r.left + r.width / 2, r.top + r.height / 2];
  };
}

// ---- model view ------------------------------------------------------------------------------
function drawModelView(root, d, focus) {
  // the pairs >= min_weight of every head, sparse: head h's are model_idx / model_val[off[h] .. off[h + 1])
  // (index i * N + j, value weight / model_max * 255)
  const { layers: L, heads: H, tokens } = d, idx = d.model_idx, val = d.model_val, off = d.model_off;
  const { M, N, queries, cross } = sides(d), S = Math.max(M, N);  // index k = i * N + j
  const left = 56, top = 22, gapx = 10;  // each head 72 px wide, narrower when the page is
  const cw = Math.max(24, Math.min(72, ((root.clientWidth || 1000) - left) / H - gapx));
  const rowpx = Math.max(3, Math.min(8, 260 / S)), ch = rowpx * S, gapy = 3 * rowpx + 8;
  const touching = (k) => (!cross && Math.floor(k / N) === focus) || k % N === focus;
  const [c, g] = canvas(root, "av-canvas", left + H * (cw + gapx), top + L * (ch + gapy));
  const line = (x0, y0, k, colour, level) => {
    g.strokeStyle = colour;
    g.lineWidth = 0.5 + 1.5 * level;
    g.beginPath();
    g.moveTo(x0 + 4, y0 + (Math.floor(k / N) + 0.5) * rowpx);
    g.lineTo(x0 + cw - 4, y0 + ((k % N) + 0.5) * rowpx);
    g.stroke();
  };
  g.textBaseline = "middle";
  g.fillStyle = "#222";
  g.textAlign = "center";
  for (let h = 0; h < H; h++) g.fillText(`head ${h}`, left + h * (cw + gapx) + cw / 2, 10);
  for (let l = 0; l < L; l++) {
    const y0 = top + l * (ch + gapy);
    g.fillStyle = "#222";
    g.textAlign = "right";
    g.fillText(`layer ${l}`, left - 6, y0 + ch / 2);
    for (let h = 0; h < H; h++) {
      const x0 = left + h * (cw + gapx), head = l * H + h;
      const pairs = [];
      for (let e = off[head]; e < off[head + 1]; e++) pairs.push(e);
      const strong = pairs.length > 2 * S ? [...pairs].sort((a, b) => val[b] - val[a]).slice(0, 2 * S) : pairs;
      for (const e of strong) {  // the 2 max(M, N) strongest pairs (as the plotly model view); focused: faded
        const level = val[e] / 255, k = idx[e];
        const touches = focus !== null && touching(k);
        line(x0, y0, k, touches ? FOCUS : `rgba(${LINE.join(",")},${(0.15 + 0.85 * level) * (focus !== null ? 0.12 : 1)})`, level);
      }
      if (focus !== null) {  // every pair the focused token sends and receives, over the rest
        for (const e of pairs) if (touching(idx[e])) line(x0, y0, idx[e], FOCUS, val[e] / 255);
        g.fillStyle = FOCUS;
        if (!cross) g.fillRect(x0, y0 + focus * rowpx, 4, rowpx);
        g.fillRect(x0 + cw - 4, y0 + focus * rowpx, 4, rowpx);
      }
      if (l === d.layer_shown && h === d.head_shown) frame(g, x0 - 3, y0 - 3, cw + 6, ch + 6);
    }
  }
  const at = (ev) => {
    const r = c.getBoundingClientRect();
    const x = ev.clientX - r.left - left, y = ev.clientY - r.top - top;
    const h = Math.floor(x / (cw + gapx)), l = Math.floor(y / (ch + gapy));
    const p = Math.floor((y - l * (ch + gapy)) / rowpx), key = x - h * (cw + gapx) > cw / 2;
    if (!(h >= 0 && h < H && l >= 0 && l < L && p >= 0 && p < S)) return null;
    return { l, h, p, focusable: (!cross || key) && p < N, what: cross ? (key ? "source key" : "target query") : "token" };
  };
  c.onmousemove = (ev) => {
    const p = at(ev), list = p && p.what === "target query" ? queries : tokens;
    showTip(root, ev, p && p.p < list.length && `layer ${p.l}, head ${p.h}\n${p.what} ${p.p}: ${list[p.p]}`);
  };
  c.onmouseleave = (ev) => showTip(root, ev, null);
  c.onclick = (ev) => {  // a token of the shown head: focus it; of another head: show that head too
    const p = at(ev);  // (cross-attention: a source key alone is focused)
    if (p && p.l === d.layer_shown && p.h === d.head_shown) {
      if (p.focusable) click(root, p.p);
    } else if (p) drill(root, p.l, p.h, p.focusable ? p.p : undefined);
  };
  root.pointOf = (pos, l = 0, h = 0) => {  // a token (cross-attention: a key, on the right): for tests
    const r = c.getBoundingClientRect();
    return [r.left + left + h * (cw + gapx) + (cross ? cw - 2 : 2), r.top + top + l * (ch + gapy) + (pos + 0.5) * rowpx];
  };
}

