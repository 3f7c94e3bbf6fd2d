// A line chart of one figure against step, drawn as SVG with no library: a few hundred lines of
// uPlot would buy nothing a training curve needs, and an SVG element is named for a screen reader.
(() => {
"use strict";

const SVGNS = "http://www.w3.org/2000/svg";

function svgEl(name, attrs) {
  const el = document.createElementNS(SVGNS, name);
  for (const [key, value] of Object.entries(attrs || {})) el.setAttribute(key, String(value));
  return el;
}

function fmtNum(value) {
  if (value === null || value === undefined || Number.isNaN(value)) return "—";
  const abs = Math.abs(value);
  if (abs !== 0 && (abs < 1e-3 || abs >= 1e6)) return value.toExponential(2);
  return abs >= 100 ? value.toFixed(1) : value.toPrecision(4).replace(/\.?0+$/, "");
}

// A line's points, at most two to a unit of the chart's width: in each column the lowest and the
// highest, in their order, so a spike stays drawn. A long run's thousands of points cost the
// browser a redraw each update and add nothing a 400-unit-wide line can show.
function thin(run, key, column, width) {
  if (run.length <= 2 * width) return run;
  const out = [];
  let at = null, low = -1, high = -1;
  const flush = () => {
    if (low < 0) return;
    if (low === high) out.push(run[low]);
    else if (low < high) out.push(run[low], run[high]);
    else out.push(run[high], run[low]);
  };
  run.forEach((p, i) => {
    const here = Math.floor(column(p));
    if (here !== at) {
      flush();
      at = here;
      low = high = i;
    } else {
      if (p[key] < run[low][key]) low = i;
      if (p[key] > run[high][key]) high = i;
    }
  });
  flush();
  return out;
}

// A chart: <figure> with an <svg role="img" aria-label=NAME>; draw(points) redraws it whole.
// Options: x, the points' key along the axis ("step"); xText, how an x value reads ("step 40");
// range, a fixed [low, high] for the values (percentages); small, a row's compact chart; gap, the
// most x may move between two points of one line (a cluster that did not answer leaves none).
function makeChart(name, key, options) {
  const x = (options && options.x) || "step";
  const xText = (options && options.xText) || ((value) => `step ${value}`);
  const range = options && options.range;
  const gap = (options && options.gap) || Infinity;
  const height = options && options.small ? 100 : 200;
  const figure = document.createElement("figure");
  const caption = document.createElement("figcaption");
  caption.textContent = name;
  const svg = svgEl("svg", { role: "img", "aria-label": name, class: options && options.small ? "chart small" : "chart",
                             viewBox: `0 0 400 ${height}`, preserveAspectRatio: "none", "data-points": 0 });
  const title = svgEl("title");
  title.textContent = name;
  svg.appendChild(title);
  figure.append(caption, svg);

  function draw(points) {
    const data = points.filter((p) => typeof p[key] === "number" && Number.isFinite(p[key]));
    while (svg.lastChild !== title) svg.removeChild(svg.lastChild);
    svg.setAttribute("data-points", String(data.length));
    const left = 56, right = 392, top = 8, bottom = height - 18;
    svg.appendChild(svgEl("line", { class: "axis", x1: left, y1: bottom, x2: right, y2: bottom }));
    svg.appendChild(svgEl("line", { class: "axis", x1: left, y1: top, x2: left, y2: bottom }));
    if (!data.length) {
      title.textContent = `${name}: no points yet`;
      return;
    }
    let x0 = data[0][x], x1 = data[data.length - 1][x];
    let y0 = range ? range[0] : Infinity, y1 = range ? range[1] : -Infinity;
    if (!range) for (const p of data) { y0 = Math.min(y0, p[key]); y1 = Math.max(y1, p[key]); }
    if (x1 === x0) x1 = x0 + 1;
    if (y1 === y0) { y0 -= Math.abs(y0) * 0.1 || 1; y1 += Math.abs(y1) * 0.1 || 1; }
    const sx = (x) => left + (x - x0) / (x1 - x0) * (right - left);
    const sy = (y) => bottom - (y - y0) / (y1 - y0) * (bottom - top);
    // One line per run of values: a point whose value is null (a host that did not answer) is a
    // gap; one without the key at all (an eval that did not report this metric) is skipped.
    const runs = [[]];
    for (const p of points) {
      const run = runs[runs.length - 1];
      if (run.length && p[x] - run[run.length - 1][x] > gap) runs.push([]);
      if (typeof p[key] === "number" && Number.isFinite(p[key])) runs[runs.length - 1].push(p);
      else if (p[key] === null && runs[runs.length - 1].length) runs.push([]);
    }
    for (const run of runs.filter((r) => r.length)) {
      const path = thin(run, key, (p) => sx(p[x]), right - left).map((p) => `${sx(p[x]).toFixed(1)},${sy(p[key]).toFixed(1)}`).join(" ");
      svg.appendChild(svgEl("polyline", { class: "series", points: path, "vector-effect": "non-scaling-stroke" }));
    }
    const last = data[data.length - 1];
    svg.appendChild(svgEl("circle", { class: "last", cx: sx(last[x]), cy: sy(last[key]), r: 2.5 }));
    for (const [value, y] of [[y1, top + 8], [y0, bottom]]) {
      const label = svgEl("text", { x: left - 4, y, "text-anchor": "end" });
      label.textContent = fmtNum(value);
      svg.appendChild(label);
    }
    for (const [value, x, anchor] of [[x0, left, "start"], [x1, right, "end"]]) {
      const label = svgEl("text", { x, y: bottom + 13, "text-anchor": anchor });
      label.textContent = xText(value);
      svg.appendChild(label);
    }
    title.textContent = `${name}: ${fmtNum(last[key])} at ${xText(last[x])} (${data.length} points)`;
  }

  draw([]);
  return { element: figure, draw };
}

window.distrunCharts = { makeChart, fmtNum };
})();
