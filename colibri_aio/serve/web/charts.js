// Small line charts on <canvas>, drawn by hand: a few time series each, the last CAPACITY samples, no library
// (the page ships without a build step or a CDN). A canvas says nothing to a screen reader, so each chart's
// caption carries the latest values as text, and the figure's aria-label repeats them.
"use strict";

const CAPACITY = 120; // samples kept per chart: two minutes at the default one-second interval

class LineChart {
  // spec: {id, title, unit, series: [{label, color, value: sample => number|null}], max (fixed top, optional),
  //        stacked (series drawn as stacked areas), digits}
  constructor(parent, spec) {
    this.spec = spec;
    this.values = spec.series.map(() => []);
    this.samples = 0;
    this.figure = document.createElement("figure");
    this.figure.className = "chart";
    this.figure.id = spec.id;
    this.figure.setAttribute("role", "img");
    const caption = document.createElement("figcaption");
    const title = document.createElement("span");
    title.className = "title";
    title.textContent = spec.title;
    caption.append(title);
    this.legend = spec.series.map((s) => {
      const item = document.createElement("span");
      const swatch = document.createElement("span");
      swatch.className = "swatch";
      swatch.style.background = s.color;
      const text = document.createElement("span");
      text.className = "value";
      item.append(swatch, text);
      caption.append(item);
      return text;
    });
    this.canvas = document.createElement("canvas");
    this.canvas.setAttribute("aria-hidden", "true");
    this.note = document.createElement("span");
    this.note.className = "none";
    this.figure.append(caption, this.canvas, this.note);
    parent.append(this.figure);
    this.render();
  }

  push(sample) {
    this.spec.series.forEach((s, i) => {
      const v = s.value(sample);
      const list = this.values[i];
      list.push(typeof v === "number" && Number.isFinite(v) ? v : null);
      if (list.length > CAPACITY) list.shift();
    });
    this.samples += 1;
    this.figure.dataset.samples = String(this.samples);
    this.render();
  }

  latestText() {
    const digits = this.spec.digits ?? 1;
    return this.spec.series.map((s, i) => {
      const v = this.values[i][this.values[i].length - 1];
      return `${s.label} ${v == null ? "–" : v.toFixed(digits)}${this.spec.unit ? " " + this.spec.unit : ""}`;
    });
  }

  render() {
    const texts = this.latestText();
    this.legend.forEach((el, i) => { el.textContent = texts[i]; });
    this.figure.setAttribute("aria-label", `${this.spec.title}: ${texts.join(", ")}`);
    const missing = this.samples > 0 && this.values.every((l) => l.every((v) => v == null));
    this.note.textContent = missing ? (this.spec.missing || "not measured here") : "";
    this.draw();
  }

  draw() {
    const canvas = this.canvas;
    const ratio = window.devicePixelRatio || 1;
    const width = Math.max(1, Math.round(canvas.clientWidth * ratio));
    const height = Math.max(1, Math.round(canvas.clientHeight * ratio));
    if (canvas.width !== width || canvas.height !== height) {
      canvas.width = width;
      canvas.height = height;
    }
    const ctx = canvas.getContext("2d");
    ctx.clearRect(0, 0, width, height);
    const style = getComputedStyle(document.documentElement);
    const muted = style.getPropertyValue("--muted").trim() || "#888";
    const line = style.getPropertyValue("--line").trim() || "#ccc";
    const series = this.spec.stacked ? this.stackedValues() : this.values;
    let top = this.spec.max;
    if (top === undefined) {
      top = 0;
      for (const list of series) for (const v of list) if (v != null && v > top) top = v;
      top = niceCeiling(top);
    }
    const pad = 4 * ratio;
    const plotH = height - 2 * pad;
    const y = (v) => pad + plotH * (1 - Math.min(v, top) / top);
    const x = (i) => (width * i) / (CAPACITY - 1);
    // grid: the top value and the middle, labelled, so a reader sees the scale
    ctx.strokeStyle = line;
    ctx.lineWidth = 1;
    ctx.fillStyle = muted;
    ctx.font = `${10 * ratio}px system-ui, sans-serif`;
    for (const f of [1, 0.5]) {
      ctx.beginPath();
      ctx.moveTo(0, y(top * f));
      ctx.lineTo(width, y(top * f));
      ctx.stroke();
      ctx.fillText(formatTick(top * f), 3 * ratio, y(top * f) + 11 * ratio);
    }
    // newest sample at the right edge
    series.forEach((list, k) => {
      const offset = CAPACITY - list.length;
      ctx.strokeStyle = this.spec.series[k].color;
      ctx.lineWidth = 1.5 * ratio;
      ctx.beginPath();
      let drawing = false;
      list.forEach((v, i) => {
        if (v == null) { drawing = false; return; }
        if (drawing) ctx.lineTo(x(offset + i), y(v));
        else ctx.moveTo(x(offset + i), y(v));
        drawing = true;
      });
      ctx.stroke();
    });
  }

  // Each series on top of the ones before it (the parts of one whole, e.g. pinned + cached + prefetched hits).
  stackedValues() {
    const sums = [];
    return this.values.map((list) => list.map((v, i) => {
      const s = (sums[i] ?? 0) + (v ?? 0);
      sums[i] = s;
      return v == null ? null : s;
    }));
  }
}

function niceCeiling(v) {
  if (!(v > 0)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 5, 10]) if (v <= m * p) return m * p;
  return 10 * p;
}

function formatTick(v) {
  return v >= 100 ? v.toFixed(0) : v >= 10 ? v.toFixed(0) : v.toFixed(v >= 1 ? 1 : 2);
}

window.LineChart = LineChart;
