// report.html's script (surgery/report): draws each study metric's heatmap from the page's JSON block;
// hovering a cell shows its grid values, mean and interval, clicking lists its per-example values.
// Every string from the run goes in as textContent, never as HTML. Nothing is fetched.
"use strict";
(function () {
  const SVG = "http://www.w3.org/2000/svg";
  const block = document.getElementById("report-data");
  const data = block ? JSON.parse(block.textContent) : {};
  const tip = document.getElementById("tip");

  // A number as Python's "%.4g" writes it (the exact float32 the file holds: Math.fround).
  function fmt(value) {
    if (value === null || value === undefined) return "–";
    const v = Math.fround(value);
    if (Number.isNaN(v)) return "nan";
    if (!Number.isFinite(v)) return v > 0 ? "inf" : "-inf";
    if (v === 0) return Object.is(v, -0) ? "-0" : "0";
    const [mantissa, power] = v.toExponential(3).split("e");
    const exponent = parseInt(power, 10);
    const trim = (s) => (s.indexOf(".") >= 0 ? s.replace(/0+$/, "").replace(/\.$/, "") : s);
    if (exponent >= -4 && exponent < 4) return trim(v.toFixed(3 - exponent));
    const sign = exponent < 0 ? "-" : "+";
    return trim(mantissa) + "e" + sign + String(Math.abs(exponent)).padStart(2, "0");
  }

  function el(tag, text, cls) {
    const node = document.createElement(tag);
    if (text !== undefined) node.textContent = text;
    if (cls) node.className = cls;
    return node;
  }

  function svg(tag, attrs) {
    const node = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
    return node;
  }

  // Colours: one-sided (viridis-like) from 0 when every value is >= 0, else diverging around 0 (blue, white, red).
  const VIRIDIS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
  const DIVERGING = [[33, 102, 172], [146, 197, 222], [247, 247, 247], [244, 165, 130], [178, 24, 43]];
  function colour(stops, t) {
    if (t === null || !Number.isFinite(t)) return "#ccc";
    const x = Math.min(1, Math.max(0, t)) * (stops.length - 1);
    const i = Math.min(stops.length - 2, Math.floor(x));
    const f = x - i;
    const c = stops[i].map((a, k) => Math.round(a + (stops[i + 1][k] - a) * f));
    return "rgb(" + c.join(",") + ")";
  }

  function scale(means) {
    const finite = means.filter((v) => v !== null && Number.isFinite(v));
    const low = finite.reduce((a, v) => Math.min(a, v), 0);
    const limit = finite.reduce((a, v) => Math.max(a, Math.abs(v)), 0) || 1;
    if (low >= 0) return { paint: (v) => colour(VIRIDIS, v === null ? null : v / limit), low: 0, high: limit };
    return { paint: (v) => colour(DIVERGING, v === null ? null : (v / limit + 1) / 2), low: -limit, high: limit };
  }

  // The colour bar under a heatmap: its lowest and highest values at the ends.
  function legend(colours) {
    const steps = 40, w = 5;
    const bar = svg("svg", { width: 70 + steps * w + 70, height: 22, class: "legend" });
    for (let i = 0; i < steps; i++) {
      const v = colours.low + ((i + 0.5) / steps) * (colours.high - colours.low);
      bar.append(svg("rect", { x: 70 + i * w, y: 2, width: w, height: 12, fill: colours.paint(v) }));
    }
    const low = svg("text", { x: 66, y: 12, class: "tick", "text-anchor": "end" });
    low.textContent = fmt(colours.low);
    const high = svg("text", { x: 74 + steps * w, y: 12, class: "tick" });
    high.textContent = fmt(colours.high);
    bar.append(low, high);
    return bar;
  }

  function tokenText(axis, i) {
    return axis.tokens && axis.tokens[i] !== null && axis.tokens[i] !== undefined ? JSON.stringify(axis.tokens[i]) : null;
  }

  // The cell's grid values: "layer = 1, pos = 3 "w42"".
  function where(study, index) {
    const parts = [];
    let rest = index;
    const sizes = study.axes.map((a) => a.values.length);
    const at = new Array(sizes.length);
    for (let k = sizes.length - 1; k >= 0; k--) {
      at[k] = rest % sizes[k];
      rest = Math.floor(rest / sizes[k]);
    }
    study.axes.forEach((axis, k) => {
      const token = tokenText(axis, at[k]);
      parts.push(axis.name + " = " + axis.values[at[k]] + (token ? " " + token : ""));
    });
    return parts.join(", ");
  }

  function showTip(study, metric, index, event) {
    tip.replaceChildren();
    tip.append(el("div", where(study, index), "tip-cell"));
    tip.append(el("div", metric.name + " mean " + fmt(metric.mean[index]), "tip-mean"));
    if (metric.low && metric.high) {
      const level = study.ci ? Math.round(study.ci * 100) + "% " : "";
      tip.append(el("div", level + "CI [" + fmt(metric.low[index]) + ", " + fmt(metric.high[index]) + "]", "tip-ci"));
    }
    tip.append(el("div", study.examples + " example(s); click for each", "tip-hint"));
    tip.hidden = false;
    tip.style.left = event.pageX + 14 + "px";
    tip.style.top = event.pageY + 14 + "px";
  }

  function showDetail(study, metric, index) {
    const box = document.getElementById("detail");
    box.replaceChildren();
    box.append(el("h3", metric.name + " at " + where(study, index)));
    const summary = "mean " + fmt(metric.mean[index]) +
      (metric.low ? ", CI [" + fmt(metric.low[index]) + ", " + fmt(metric.high[index]) + "]" : "");
    box.append(el("p", summary));
    if (study.shown < study.examples) {
      box.append(el("p", "the first " + study.shown + " of " + study.examples + " examples (all in study.safetensors)", "warn"));
    }
    const table = el("table", undefined, "examples");
    const head = el("tr");
    head.append(el("th", "example"), el("th", "value"));
    table.append(head);
    for (let e = 0; e < study.shown; e++) {
      const row = el("tr");
      row.append(el("td", String(e), "num"), el("td", fmt(metric.values[index * study.shown + e]), "num"));
      table.append(row);
    }
    box.append(table);
    box.hidden = false;
  }

  // One metric's heatmap: the last axis across, the one before down, a menu per other axis.
  function heatmap(holder, study, metric) {
    const axes = study.axes;
    const across = axes[axes.length - 1];
    const down = axes.length > 1 ? axes[axes.length - 2] : null;
    const others = axes.slice(0, Math.max(0, axes.length - 2));
    const chosen = others.map(() => 0);
    const colours = scale(metric.mean);
    const paint = colours.paint;
    const controls = el("div", undefined, "controls");
    others.forEach((axis, k) => {
      const label = el("label", axis.name + " ");
      const menu = el("select");
      axis.values.forEach((v, i) => menu.append(Object.assign(el("option", v), { value: String(i) })));
      menu.addEventListener("change", () => {
        chosen[k] = parseInt(menu.value, 10);
        draw();
      });
      label.append(menu);
      controls.append(label);
    });
    if (others.length) holder.append(controls);
    const frame = el("div", undefined, "frame");
    holder.append(frame, legend(colours));
    const cols = across.values.length;
    const rows = down ? down.values.length : 1;
    const cw = Math.max(4, Math.min(36, Math.floor(760 / cols)));
    const ch = Math.max(4, Math.min(26, Math.floor(420 / rows)));
    const left = 70, top = 8, bottom = across.tokens ? 90 : 40;

    function draw() {
      let base = 0;
      others.forEach((axis, k) => (base = base * axis.values.length + chosen[k]));
      base *= cols * rows;
      const image = svg("svg", { width: left + cols * cw + 10, height: top + rows * ch + bottom, class: "map" });
      for (let r = 0; r < rows; r++) {
        for (let c = 0; c < cols; c++) {
          const index = base + r * cols + c;
          const cell = svg("rect", { x: left + c * cw, y: top + r * ch, width: cw, height: ch,
            fill: paint(metric.mean[index]), "data-cell": index });
          cell.addEventListener("mousemove", (event) => showTip(study, metric, index, event));
          cell.addEventListener("mouseleave", () => (tip.hidden = true));
          cell.addEventListener("click", () => showDetail(study, metric, index));
          image.append(cell);
        }
      }
      const everyX = Math.ceil(cols / Math.max(1, Math.floor((cols * cw) / 14)));
      for (let c = 0; c < cols; c += everyX) {
        const x = left + c * cw + cw / 2, y = top + rows * ch + 6;
        const token = tokenText(across, c);
        const text = svg("text", { x: x, y: y, class: "tick", transform: "rotate(60 " + x + " " + y + ")" });
        text.textContent = token ? token + " (" + across.values[c] + ")" : across.values[c];
        image.append(text);
      }
      const everyY = Math.ceil(rows / Math.max(1, Math.floor((rows * ch) / 12)));
      for (let r = 0; down && r < rows; r += everyY) {
        const text = svg("text", { x: left - 4, y: top + r * ch + ch / 2 + 4, class: "tick", "text-anchor": "end" });
        text.textContent = down.values[r];
        image.append(text);
      }
      const name = svg("text", { x: left + (cols * cw) / 2, y: top + rows * ch + bottom - 4, class: "axis",
        "text-anchor": "middle" });
      name.textContent = across.name;
      image.append(name);
      if (down) {
        const side = svg("text", { x: 12, y: top + (rows * ch) / 2, class: "axis", "text-anchor": "middle",
          transform: "rotate(-90 12 " + (top + (rows * ch) / 2) + ")" });
        side.textContent = down.name;
        image.append(side);
      }
      frame.replaceChildren(image);
    }
    draw();
  }

  if (data.study) {
    document.querySelectorAll(".heatmap").forEach((holder) => {
      const metric = data.study.metrics[parseInt(holder.dataset.metric, 10)];
      if (metric) heatmap(holder, data.study, metric);
    });
  }
})();
