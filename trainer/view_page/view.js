// perceptrl view: renders the run embedded in #run-data (see trainer/viewer.py).
// Text from the run (prompts, model output) only ever becomes DOM text nodes.
"use strict";

const DATA = JSON.parse(document.getElementById("run-data").textContent);
const PAGE_SIZE = 20; // groups rendered at once
const DEFAULT_CURVES = ["reward/mean", "eval/accuracy", "eval/success_rate", "actor/entropy",
  "actor/kl", "actor/approx_kl", "actor/clipfrac", "rollout/zero_std_groups",
  "rollout/clip_ratio", "rollout/completion_len_mean", "rollout/success_rate", "time/step"];
const state = { tab: "rollouts", step: "all", filter: "all", search: "", page: 0,
  colour: "adv", metric: "" };
let timers = [];

// ---------------------------------------------------------------- DOM helpers
function el(tag, attrs, ...kids) {
  const node = tag === "svg" || SVG_TAGS.has(tag)
    ? document.createElementNS("http://www.w3.org/2000/svg", tag) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null) continue;
    if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else if (k === "src" && !String(v).startsWith("data:image/")) continue; // embedded only
    else node.setAttribute(k, v);
  }
  for (const kid of kids.flat(Infinity)) {
    if (kid === null || kid === undefined || kid === false) continue;
    node.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
  }
  return node;
}
const SVG_TAGS = new Set(["line", "circle", "polyline", "text", "g", "rect", "title"]);
const fmt = (x, d = 3) => (x === null || x === undefined ? "–" : Number(x).toFixed(d));

// ---------------------------------------------------------------- data
const GROUPS = DATA.records.flatMap((rec) => rec.groups.map((g) => ({ step: rec.step, g })));
const isEpisodeGroup = (g) => g.rows.some((r) => "actions" in r);

function rewardsAlike(g) {
  const rs = g.rows.map((r) => r.reward);
  return Math.max(...rs) === Math.min(...rs);
}

const FILTERS = {
  all: ["all groups", () => true],
  alike: ["scored alike", (g) => g.rows.length > 1 && rewardsAlike(g)],
  mixed: ["rewards differ", (g) => !rewardsAlike(g)],
  truncated: ["with cut samples", (g) => g.rows.some((r) => r.truncated || r.end === "truncated")],
};

function shownGroups() {
  const q = state.search.toLowerCase();
  return GROUPS.filter(({ step, g }) =>
    (state.step === "all" || String(step) === state.step) &&
    FILTERS[state.filter][1](g) &&
    (!q || JSON.stringify([g.prompt, g.id, g.env, g.rows.map((r) => r.text)]).toLowerCase().includes(q)));
}

// ---------------------------------------------------------------- tabs and controls
const TABS = { rollouts: ["Rollouts", renderRollouts], metrics: ["Metrics", renderMetrics],
  doctor: ["Doctor", renderDoctor] };

function renderTabs() {
  const nav = document.getElementById("tabs");
  nav.replaceChildren(...Object.entries(TABS).map(([key, [label]]) => el("button", {
    class: state.tab === key ? "active" : "", "data-tab": key,
    onclick: () => { state.tab = key; render(); },
  }, label)));
}

function select(name, options, value, onchange) {
  return el("select", { name, onchange: (e) => onchange(e.target.value) },
    options.map(([v, label]) => {
      const o = el("option", { value: v }, label);
      o.selected = String(v) === String(value);
      return o;
    }));
}

function rolloutControls() {
  const steps = [["all", "all steps"], ...DATA.records.map((r) => [String(r.step), `step ${r.step}`])];
  const set = (k) => (v) => { state[k] = v; state.page = 0; render(); };
  return [
    el("label", {}, "Step", select("step", steps, state.step, set("step"))),
    el("label", {}, "Show", select("filter", Object.entries(FILTERS).map(([k, [l]]) => [k, l]),
      state.filter, set("filter"))),
    el("label", {}, "Colour tokens by", select("colour", [["adv", "advantage"], ["logp", "log-prob"],
      ["step_rewards", "process reward"]], state.colour, set("colour"))),
    el("label", {}, "Search", el("input", { name: "search", type: "search", value: state.search,
      onchange: (e) => set("search")(e.target.value) })),
  ];
}

function render() {
  timers.forEach(clearInterval);
  timers = [];
  renderTabs();
  TABS[state.tab][1](document.getElementById("main"), document.getElementById("controls"));
  window.__viewReady = true; // the browser test waits for this
}

// ---------------------------------------------------------------- rollouts
function renderRollouts(main, controls) {
  controls.replaceChildren(...rolloutControls());
  const groups = shownGroups();
  const pages = Math.max(1, Math.ceil(groups.length / PAGE_SIZE));
  state.page = Math.min(state.page, pages - 1);
  const page = groups.slice(state.page * PAGE_SIZE, (state.page + 1) * PAGE_SIZE);
  const pager = el("div", { class: "pager" },
    el("span", { class: "count", id: "group-count", "data-count": groups.length },
      `${groups.length} groups`),
    el("button", { disabled: state.page === 0 ? "" : null,
      onclick: () => { state.page--; render(); } }, "previous"),
    `page ${state.page + 1} of ${pages}`,
    el("button", { disabled: state.page >= pages - 1 ? "" : null,
      onclick: () => { state.page++; render(); } }, "next"));
  const empty = DATA.records.length ? "No group matches." :
    "This run kept no rollout records (log.rollouts_every=0, or an SFT run).";
  const single = page.every(({ g }) => g.rows.length === 1); // PPO segments: a grid of cards
  main.replaceChildren(pager, page.length ? el("div", { class: single ? "groups grid" : "groups" },
    page.map(({ step, g }) => (isEpisodeGroup(g) ? episodeGroup(step, g) : textGroup(step, g))))
    : el("p", { class: "empty" }, empty));
}

function groupHeader(step, g, label) {
  const rs = g.rows.map((r) => fmt(r.reward, 2)).join(" ");
  return el("h3", {}, `step ${step} · group ${g.group}${label ? " · " + label : ""} · rewards ${rs}`,
    g.rows.length > 1 && rewardsAlike(g) ? " · scored alike" : "");
}

function textGroup(step, g) {
  const prompt = el("div", { class: "prompt" },
    (g.images || []).map((src) => el("img", { src, alt: "prompt image" })),
    el("div", {}, el("div", {}, g.prompt || ""), g.answer ? el("div", { class: "comps" }, `answer: ${g.answer}`) : null,
      (g.videos || []).length ? el("div", { class: "comps" }, `videos: ${g.videos.join(", ")}`) : null));
  const trees = g.rows.some((r) => r.nodes) ? treeSvg(g) : null;
  return el("div", { class: "group", "data-step": step },
    groupHeader(step, g, g.id), prompt, trees,
    el("div", { class: "samples" }, g.rows.map((r) => sampleCard(r, g))));
}

function sampleCard(r, g) {
  const comps = Object.entries(r.components || {}).map(([k, v]) => `${k} ${fmt(v, 2)}`).join(" · ");
  return el("div", { class: "sample" + (r.guide ? " guide" : "") },
    el("div", { class: "head" }, el("span", {}, `reward ${fmt(r.reward, 3)}`),
      el("span", {}, `${r.length} tokens${r.truncated ? " · cut" : ""}${r.guide ? " · guide" : ""}`)),
    comps ? el("div", { class: "comps" }, comps) : null,
    r.turns ? turnStrip(r) : null,
    tokenView(r, g));
}

function turnStrip(r) {
  return el("div", { class: "turns" }, r.turns.map((t, i) => el("div", { class: "turn" },
    el("div", {}, `turn ${i + 1}: `, t.text),
    t.observation !== undefined ? el("div", { class: "obs" },
      (t.images || []).map((src) => el("img", { src, alt: "observation" })), t.observation) : null)),
    r.stop ? el("div", { class: "comps" }, `ended: ${r.stop}`) : null);
}

function tokenView(r, g) {
  const key = state.colour;
  const values = r[key] || [];
  const scale = Math.max(1e-9, ...g.rows.flatMap((x) => (x[key] || []).map(Math.abs)));
  const spans = (r.tokens || []).map((tok, i) => {
    const v = values[i];
    const inLoss = !r.mask || r.mask[i] === 1;
    const title = `adv ${fmt((r.adv || [])[i])} · logp ${fmt((r.logp || [])[i])}`;
    return el("span", { class: inLoss ? "tok" : "obs", title,
      style: inLoss && v !== undefined ? `background:${colour(v, key, scale)}` : null }, tok);
  });
  return el("div", { class: "tokens" }, spans);
}

function colour(v, key, scale) {
  if (key === "logp") return `rgba(40,90,220,${Math.min(0.8, -v / 5).toFixed(3)})`; // surprise
  const a = (0.1 + 0.7 * Math.abs(v) / scale).toFixed(3);
  if (v === 0) return "transparent";
  return v > 0 ? `rgba(0,160,60,${a})` : `rgba(220,30,30,${a})`;
}

// a tree group: each row's distinct nodes in order are its path from the root
function treeSvg(g) {
  const nodes = new Map();
  g.rows.forEach((r, row) => {
    let parent = 0;
    (r.nodes || []).forEach((id, i) => {
      if (id === 0 || id === parent) return;
      if (!nodes.has(id)) nodes.set(id, { id, parent, kids: [], rows: [], text: "" });
      const n = nodes.get(id);
      if (n.rows[n.rows.length - 1] !== row) n.rows.push(row);
      if (n.rows[0] === row) n.text += (r.tokens || [])[i] || "";
      parent = id;
    });
  });
  const mean = g.rows.reduce((s, r) => s + r.reward, 0) / g.rows.length; // leaves above: green
  const roots = [];
  for (const n of nodes.values()) (n.parent ? nodes.get(n.parent).kids : roots).push(n);
  let leaf = 0, depthMax = 0;
  const place = (n, depth) => {
    n.depth = depth; depthMax = Math.max(depthMax, depth);
    n.kids.forEach((k) => place(k, depth + 1));
    n.x = n.kids.length ? n.kids.reduce((s, k) => s + k.x, 0) / n.kids.length : leaf++;
  };
  roots.forEach((n) => place(n, 1));
  const W = 40, H = 40, w = Math.max(1, leaf) * W + 20, h = (depthMax + 1) * H + 20;
  const X = (n) => 10 + W / 2 + n.x * W, Y = (d) => 10 + d * H;
  const items = [];
  const rootX = roots.length ? roots.reduce((s, n) => s + X(n), 0) / roots.length : w / 2;
  for (const n of nodes.values()) {
    const px = n.parent ? X(nodes.get(n.parent)) : rootX, py = Y(n.parent ? n.depth - 1 : 0);
    items.push(el("line", { x1: px, y1: py, x2: X(n), y2: Y(n.depth), stroke: "#99a" }));
  }
  items.push(el("circle", { cx: rootX, cy: Y(0), r: 6, fill: "#446" }, el("title", {}, "prompt")));
  for (const n of nodes.values()) {
    const leafRow = n.kids.length ? null : g.rows[n.rows[0]];
    const fill = !leafRow ? "#88a" : leafRow.reward > mean ? "#2a5" : leafRow.reward < mean ? "#c33" : "#999";
    items.push(el("circle", { cx: X(n), cy: Y(n.depth), r: 5, fill, class: "node" },
      el("title", {}, `${n.rows.length} leaves · ${n.text.slice(0, 300)}`)));
    if (leafRow) items.push(el("text", { x: X(n), y: Y(n.depth) + 16, "font-size": 10,
      "text-anchor": "middle" }, fmt(leafRow.reward, 1)));
  }
  return el("div", { class: "tree" }, el("svg", { width: w, height: h, class: "tree-svg",
    "data-nodes": nodes.size }, items));
}

// ---------------------------------------------------------------- VLA episodes
function episodeGroup(step, g) {
  const label = [g.env, g.task_id !== undefined ? `task ${g.task_id}` : null].filter(Boolean).join(" · ");
  return el("div", { class: "group", "data-step": step }, groupHeader(step, g, label),
    el("div", { class: "samples" }, g.rows.map(episodeCard)));
}

function episodeCard(r) {
  const ret = r.rewards ? r.rewards.reduce((a, b) => a + b, 0) : r.reward;
  const series = [["reward", r.rewards, "#2a5"], ["value", r.values, "#36c"], ["advantage", r.adv, "#c63"]]
    .filter(([, v]) => v && v.length);
  return el("div", { class: "episode" },
    el("div", { class: "head" }, `return ${fmt(ret, 3)} · ${r.length} steps${r.end ? " · " + r.end : ""}`),
    r.frames && r.frames.length ? flipbook(r.frames) : el("div", { class: "empty" }, "no camera frames (state observations)"),
    series.length ? linePlot(series, 240, 90) : null,
    el("div", { class: "comps" }, series.map(([n, , c]) => el("span", { style: `color:${c}` }, `■ ${n} `))));
}

function flipbook(frames) {
  const img = el("img", { class: "frame", src: frames[0], alt: "episode frame" });
  const slider = el("input", { type: "range", min: 0, max: frames.length - 1, value: 0,
    oninput: (e) => { img.src = frames[+e.target.value]; } });
  let timer = null;
  const button = el("button", { onclick: () => {
    if (timer) { clearInterval(timer); timer = null; button.textContent = "play"; return; }
    timer = setInterval(() => {
      slider.value = (+slider.value + 1) % frames.length;
      img.src = frames[+slider.value];
    }, 150);
    timers.push(timer);
    button.textContent = "pause";
  } }, "play");
  return el("div", { class: "video" }, img, el("div", {}, button, slider));
}

function linePlot(series, w, h, xs) {
  const all = series.flatMap(([, v]) => v.filter((x) => x !== null));
  let lo = Math.min(...all), hi = Math.max(...all);
  if (!(hi > lo)) { lo -= 1; hi += 1; }
  const n = Math.max(...series.map(([, v]) => v.length));
  const xOf = xs ? (i) => (xs[i] - xs[0]) / Math.max(1, xs[xs.length - 1] - xs[0]) : (i) => i / Math.max(1, n - 1);
  const P = 24;
  const pt = (i, v) => `${(P + xOf(i) * (w - P - 4)).toFixed(1)},${(4 + (1 - (v - lo) / (hi - lo)) * (h - 16)).toFixed(1)}`;
  const lines = series.map(([, v, c]) => {
    const segs = [[]];
    v.forEach((x, i) => (x === null ? segs.push([]) : segs[segs.length - 1].push(pt(i, x))));
    return segs.filter((s) => s.length).map((s) => el("polyline", { points: s.join(" "), fill: "none",
      stroke: c, "stroke-width": 1.3 }));
  });
  return el("svg", { width: w, height: h, class: "plot" },
    el("text", { x: 0, y: 10, "font-size": 9 }, fmt(hi, 2)), el("text", { x: 0, y: h - 4, "font-size": 9 }, fmt(lo, 2)),
    lines);
}

// ---------------------------------------------------------------- metrics and doctor
function renderMetrics(main, controls) {
  const keys = Object.keys(DATA.metrics.series);
  controls.replaceChildren(el("label", {}, "Metrics matching", el("input", { name: "metric",
    type: "search", value: state.metric, placeholder: "e.g. eval/ or reward",
    onchange: (e) => { state.metric = e.target.value; render(); } })));
  const q = state.metric.toLowerCase();
  const shown = (q ? keys.filter((k) => k.toLowerCase().includes(q))
    : DEFAULT_CURVES.filter((k) => keys.includes(k))).slice(0, 36);
  const steps = DATA.metrics.steps;
  main.replaceChildren(el("p", { class: "count", id: "curve-count", "data-count": shown.length },
    `${shown.length} of ${keys.length} metrics`),
  el("div", { class: "curves" }, shown.map((k) => {
    const v = DATA.metrics.series[k];
    const last = [...v].reverse().find((x) => x !== null);
    return el("div", { class: "curve" }, el("h4", {}, `${k} (last ${fmt(last, 4)})`),
      linePlot([[k, v, "#36c"]], 300, 110, steps));
  })));
}

function renderDoctor(main, controls) {
  controls.replaceChildren(el("span", {}, "What `perceptrl doctor` finds in this run's metrics"));
  const f = DATA.findings;
  main.replaceChildren(f.length ? el("div", {}, f.map((x) => el("div", { class: `finding ${x.severity}` },
    el("h3", {}, `${x.name} (${x.severity}), steps ${x.steps[0]}-${x.steps[1]}`),
    el("div", {}, el("b", {}, "Evidence: "), x.evidence),
    el("div", {}, el("b", {}, "Why it matters: "), x.why),
    el("div", {}, el("b", {}, "What to change: "), x.fix),
    x.example ? el("div", {}, el("b", {}, "Example: "), x.example) : null))) :
    el("p", { class: "empty" }, "Nothing wrong found."));
}

document.getElementById("title").textContent = `perceptrl view · ${DATA.run}`;
if (!DATA.records.length) state.tab = "metrics";
render();
