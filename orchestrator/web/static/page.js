// A run's page: polls /api/state every second, /api/curves when they changed, the selected
// task's log every two seconds. No library, no outside request (the server's CSP forbids them).
//
// The run's token comes in the address once (?token=): kept in this tab's sessionStorage, which the
// browser keeps per origin (scheme, host, port), taken out of the address bar, and sent as
// `Authorization: Bearer`. Never a cookie: a browser sends cookies to every port of a host.
// What a job reports is data, never markup or keys: text goes in with textContent, values are looked
// up in Maps or as own properties (a metric may be named `__proto__`).
"use strict";

const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"];
const NOTABLE_RUN = new Set(["STOPPING", "RESTARTING", "FAILED", "INTERRUPTED", "SUCCEEDED"]);
const NOTABLE_TASK = new Set(["FAILED", "LOST"]);
const NOTES = new Set(["task_restart", "warning", "unconfirmed", "port", "hosts", "results", "resume", "error", "degraded"]);
const ENDED = new Set(["SUCCEEDED", "FAILED", "INTERRUPTED"]);
const NONFINITE = new Map([["NaN", NaN], ["Infinity", Infinity], ["-Infinity", -Infinity]]);
const MAX_ROWS = 50; // as the server sends
const MAX_PLOTS = 12;
const TOKEN_KEY = "orchestrate-token";

const token = takeToken();
const pageId = Array.from(crypto.getRandomValues(new Uint8Array(8)), (b) => b.toString(16).padStart(2, "0")).join("");
let eventCount = 0;
let curvesVersion = -1;
let curvesAt = 0;
let selected = null;
let lastStatus = null;
let clockSkew = 0; // server time - browser time
let ended = false; // the page has shown the run's end
let gone = false; // ...and its server has gone with the run: nothing more to ask
const events = [];
let stacksShown = null; // the task whose full stacks are open
let stacksKey = "";

function takeToken() {
  const url = new URL(window.location.href);
  const given = url.searchParams.get("token");
  if (given) {
    sessionStorage.setItem(TOKEN_KEY, given);
    url.searchParams.delete("token");
    history.replaceState(null, "", url.pathname + url.search + url.hash); // out of the address bar
  }
  return sessionStorage.getItem(TOKEN_KEY);
}

function el(tag, attrs, ...children) {
  const node = tag.startsWith("svg:")
    ? document.createElementNS("http://www.w3.org/2000/svg", tag.slice(4))
    : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  for (const c of children) node.append(c);
  return node;
}

function age(seconds) {
  if (seconds === null || seconds === undefined) return "";
  if (seconds < 60) return `${Math.max(0, Math.floor(seconds))} s`;
  if (seconds < 3600) return `${Math.floor(seconds / 60)} min`;
  return `${Math.floor(seconds / 3600)} h`;
}

function duration(seconds) {
  const s = Math.max(0, Math.round(seconds));
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), r = s % 60;
  const mm = h ? String(m).padStart(2, "0") : String(m);
  return `${h ? h + ":" : ""}${mm}:${String(r).padStart(2, "0")}`;
}

// A reported value: a JSON number, or NaN and ±inf as the strings the server writes for them.
function value(v) {
  if (typeof v === "number") return v;
  return typeof v === "string" && NONFINITE.has(v) ? NONFINITE.get(v) : null;
}

function num(v) {
  const x = value(v);
  if (x === null) return "";
  if (Number.isNaN(x)) return "NaN";
  if (!Number.isFinite(x)) return x > 0 ? "inf" : "-inf";
  return Number(x.toPrecision(4)).toString();
}

function own(object, key) {
  return object && Object.hasOwn(object, key) ? object[key] : undefined;
}

function when(iso) {
  const t = Date.parse(iso || "");
  return Number.isNaN(t) ? null : t / 1000;
}

function now() {
  return Date.now() / 1000 + clockSkew;
}

class Refused extends Error {}
class Unreachable extends Error {} // no answer at all: the server is not there

async function getJSON(path) {
  if (!token) throw new Refused("this page needs its run's token: open the page address the run printed (status.json: urls.page)");
  let response;
  try {
    response = await fetch(path, { credentials: "omit", cache: "no-store", headers: { Authorization: `Bearer ${token}` } });
  } catch (err) {
    throw new Unreachable(err.message);
  }
  if (response.status === 401) throw new Refused("the run's token was refused: open the page address the run printed (status.json: urls.page)");
  if (!response.ok) throw new Error(`${path}: ${response.status}`);
  return response.json();
}

function metricNames(tasks) {
  const names = [];
  for (const t of tasks) for (const n of Object.keys(t.metrics || {})) if (!names.includes(n)) names.push(n);
  const rank = (n) => (n === "loss" ? 0 : n.startsWith("eval_") ? 2 : 1);
  return names.sort((a, b) => rank(a) - rank(b) || names.indexOf(a) - names.indexOf(b));
}

function renderHead(status, progress, stale, recordedAt) {
  const shown = stale ? `${status.state}?` : status.state;
  document.title = `${status.name} ${shown} — orchestrate`;
  document.getElementById("name").textContent = status.name;
  const state = document.getElementById("state");
  state.textContent = shown;
  state.className = `state ${stale ? "STALE" : status.state}`;
  const over = stale || ENDED.has(status.state);
  const start = when(status.started_at);
  // an ended run's clock stops at its end; one whose coordinator is gone, at its last record
  const end = when(status.ended_at) || (stale && recordedAt) || now();
  const took = start ? ` · ${duration(end - start)}` : "";
  document.getElementById("head").textContent =
    `attempt ${status.attempt} · restarts ${status.restarts}${took} · run ${status.run_id}`;
  document.getElementById("reason").textContent = stale
    ? "its coordinator is gone: this is the run's last record, not a live run (`orchestrate down` with its run directory stops anything it left)"
    : (status.reason || "").split("\n")[0];
  // the server's progress, of every task (the page gets the first rows only)
  const text = [];
  let fraction = 0;
  if (progress && progress.step !== null) {
    if (progress.total) {
      fraction = Math.min(1, progress.step / progress.total);
      text.push(`step ${progress.step}/${progress.total} (${Math.round(fraction * 100)}%)`);
      if (progress.eta_s !== null && !over) text.push(`ETA ${duration(progress.eta_s)}`);
    } else {
      text.push(`step ${progress.step}`);
    }
    if (progress.steps_per_s !== null && !over) {
      text.push(`${num(progress.steps_per_s)} steps/s`);
      if (progress.examples_per_s !== null) text.push(`${Math.round(progress.examples_per_s)} examples/s`);
    }
  }
  document.getElementById("done").style.width = `${fraction * 100}%`;
  document.getElementById("progress-text").textContent = text.join(" · ");
}

function renderTasks(status, count, states) {
  const tasks = status.tasks.slice(0, MAX_ROWS);
  const names = metricNames(tasks);
  const head = ["task", "state", "step", ...names, "heartbeat", "steps/s", "restarts", "RSS", "host"];
  const thead = document.querySelector("#tasks thead");
  // a long name is cut (the cell's title has it whole): the table stays within the window
  const cut = (h) => (h.length > 16 ? `${h.slice(0, 15)}…` : h);
  thead.replaceChildren(el("tr", {}, ...head.map((h) => el("th", { title: h, ...(h === "state" || h === "host" ? { class: "left" } : {}) }, cut(h)))));
  const rows = tasks.map((t) => {
    const taskEnded = ["SUCCEEDED", "FAILED", "LOST", "STOPPED"].includes(t.state);
    const beat = when(t.last_heartbeat_at);
    const shownState = t.busy && t.state === "RUNNING" ? t.busy : t.state;
    const cells = [
      t.task,
      el("span", { class: `state ${t.state}` }, shownState),
      t.last_step === null ? "" : String(t.last_step),
      ...names.map((n) => num(own(t.metrics, n))),
      beat && !taskEnded ? age(now() - beat) : "",
      (t.role === "chief" || t.role === "worker") && !taskEnded ? num(t.steps_per_s) : "",
      t.restarts ? String(t.restarts) : "",
      t.rss_bytes ? `${Math.round(t.rss_bytes / 1048576)} MiB` : "",
      t.host,
    ];
    const row = el("tr", { "data-task": t.task, "data-state": t.state },
      ...cells.map((c, i) => el("td", head[i] === "state" || head[i] === "host" ? { class: "left" } : {}, c)));
    if (t.task === selected) row.classList.add("selected");
    row.addEventListener("click", () => selectTask(t.task));
    return row;
  });
  document.querySelector("#tasks tbody").replaceChildren(...rows);
  const more = count - tasks.length;
  const byState = Object.entries(states || {}).map(([s, n]) => `${n} ${s}`).join(", ");
  document.getElementById("tasks-more").textContent =
    more > 0 ? `${count} tasks (${byState}); the first ${tasks.length} shown, status.json has them all` : "";
  const select = document.getElementById("log-task");
  const current = [...select.options].map((o) => o.value).join(",");
  if (current !== status.tasks.map((t) => t.task).join(",")) {
    select.replaceChildren(...status.tasks.map((t) => el("option", { value: t.task }, t.task)));
    if (selected) select.value = selected;
  }
  if (!selected && status.tasks.length) selectTask(status.tasks[0].task);
}

function notable(e) {
  if (e.kind === "run") return NOTABLE_RUN.has(e.new);
  if (e.kind === "task") return NOTABLE_TASK.has(e.new);
  return NOTES.has(e.kind);
}

function eventText(e) {
  const reason = String(e.reason || "").split("\n")[0];
  if (e.kind === "run" || e.kind === "task") return `${e.kind === "task" ? e.task + " " : ""}${e.new}: ${reason}`;
  if (e.kind === "task_restart") return `${e.task} restarting alone: ${reason}`;
  return reason;
}

function renderEvents() {
  const shown = events.filter(notable).slice(-30).reverse();
  document.getElementById("events").replaceChildren(
    ...(shown.length ? shown.map((e) => el("li", { "data-kind": e.kind }, el("span", { class: "dim" }, `${String(e.time).slice(11, 19)} `), eventText(e)))
      : [el("li", { class: "dim" }, "nothing notable yet")]));
}

// What runs degraded (a fallback, with its fix) and the metric names dropped: in sight while it lasts.
function renderNotices(notices) {
  document.getElementById("notices").replaceChildren(...(notices || []).map((n) => el("li", {}, String(n))));
}

function renderFailures(status) {
  const items = [
    ...(status.failures || []).flatMap((f) => [
      `attempt ${f.attempt} ended: ${f.reason}`,
      // the restart that followed: the hosts it ran on anew (a spare, fewer workers), its timeline
      ...(status.attempts || []).filter((a) => a.attempt === f.attempt + 1).flatMap((a) => a.changes),
      ...(status.recoveries || []).filter((r) => r.attempt === f.attempt + 1).map((r) => r.line),
    ]),
    ...(status.task_restarts || []).map((f) => `restarted alone: ${f.reason}`),
  ];
  document.getElementById("failures").replaceChildren(
    ...(items.length ? items.map((t) => el("li", {}, t.split("\n")[0])) : [el("li", { class: "dim" }, "none")]));
}

// Where each task was, by its last read stacks; a line opens the task's full stacks below it.
function renderStacks(stacks) {
  const entries = Object.entries(stacks || {});
  const key = JSON.stringify(entries);
  if (key === stacksKey) return;
  stacksKey = key;
  document.getElementById("stacks-section").hidden = entries.length === 0;
  if (!entries.length) return;
  const [, first] = entries[0];
  document.getElementById("stacks-when").textContent =
    `read ${String(first.captured_at).slice(0, 19).replace("T", " ")} UTC (${first.why}); click a task for its full stacks`;
  document.getElementById("stacks").replaceChildren(...entries.map(([task, s]) => {
    const item = el("li", { "data-task": task, class: s.culprit ? "culprit" : "" }, s.line);
    item.addEventListener("click", () => showStacks(task));
    return item;
  }));
  if (stacksShown) showStacks(stacksShown, true);
}

async function showStacks(task, again = false) {
  const pre = document.getElementById("stacks-full");
  if (stacksShown === task && !again) {
    stacksShown = null;
    pre.hidden = true;
    return;
  }
  stacksShown = task;
  try {
    const data = await getJSON(`/api/stacks/${encodeURIComponent(task)}`);
    pre.textContent = data.lines.join("\n");
  } catch (err) {
    pre.textContent = String(err);
  }
  pre.hidden = false;
}

function plot(name, byTask) {
  const W = 420, H = 190, L = 46, R = 8, T = 8, B = 22;
  const all = [...byTask.values()].flat().map(([x, y, a]) => [x, value(y), a]);
  const xs = all.map((p) => p[0]), ys = all.map((p) => p[1]).filter(Number.isFinite);
  let [x0, x1] = [Math.min(...xs), Math.max(...xs)];
  let [y0, y1] = ys.length ? [Math.min(...ys), Math.max(...ys)] : [0, 1];
  if (x0 === x1) x1 = x0 + 1;
  if (y0 === y1) { y0 -= 0.5; y1 += 0.5; }
  const sx = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const sy = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  const svg = el("svg:svg", { viewBox: `0 0 ${W} ${H}`, width: W, height: H, "data-metric": name });
  svg.append(el("svg:rect", { x: L, y: T, width: W - L - R, height: H - T - B, fill: "none", stroke: "#ddd" }));
  for (const [y, label] of [[y0, num(y0)], [y1, num(y1)]]) {
    svg.append(el("svg:text", { x: L - 4, y: sy(y) + 3, "text-anchor": "end" }, label));
  }
  svg.append(el("svg:text", { x: L, y: H - 6 }, `step ${x0}`));
  svg.append(el("svg:text", { x: W - R, y: H - 6, "text-anchor": "end" }, `${x1}`));
  const legend = el("div", { class: "legend" });
  [...byTask.entries()].forEach(([task, points], i) => {
    const color = COLORS[i % COLORS.length];
    let d = "", attempt = null, gap = true, firstOdd = null;
    for (const [x, raw, a] of points) {
      const y = value(raw);
      if (!Number.isFinite(y)) {
        // NaN or ±inf: a mark on the edge it points to (NaN: the top), the line broken there
        const top = !(y === -Infinity);
        const mark = el("svg:text", { x: sx(x), y: top ? T + 9 : H - B - 2, "text-anchor": "middle", class: "nonfinite", "data-task": task }, "×");
        mark.append(el("svg:title", {}, `${task} step ${x}: ${num(y)}`));
        mark.style.fill = color;
        svg.append(mark);
        if (firstOdd === null) firstOdd = `${num(y)} at step ${x}`;
        gap = true;
        continue;
      }
      d += `${gap || a !== attempt ? "M" : "L"}${sx(x).toFixed(1)},${sy(y).toFixed(1)} `;
      attempt = a;
      gap = false;
    }
    svg.append(el("svg:path", { d, fill: "none", stroke: color, "stroke-width": 1.5, "data-task": task, "data-points": points.length }));
    const key = el("span", {}, `━ ${task}${firstOdd ? ` (${firstOdd})` : ""}`);
    key.style.color = color; // CSSOM, not a style attribute: the page's CSP allows no inline style
    legend.append(key);
  });
  return el("figure", {}, el("figcaption", { title: name }, name), svg, legend);
}

function renderCurves(curves) {
  const byName = new Map(); // a name is data: never an object's key (`__proto__`, `constructor`)
  for (const [task, metrics] of Object.entries(curves)) {
    for (const [name, points] of Object.entries(metrics)) {
      if (!byName.has(name)) byName.set(name, new Map());
      byName.get(name).set(task, points);
    }
  }
  const names = [...byName.keys()].sort((a, b) => (a === "loss" ? -1 : b === "loss" ? 1 : a.localeCompare(b)));
  if (!names.length) return;
  document.getElementById("plots").replaceChildren(...names.slice(0, MAX_PLOTS).map((n) => plot(n, byName.get(n))));
  const left = names.slice(MAX_PLOTS);
  document.getElementById("plots-more").textContent = left.length
    ? `${MAX_PLOTS} of ${names.length} values drawn (loss first, then by name); not drawn: ${left.join(", ")} — metrics.jsonl has every point`
    : "";
}

function renderFooter(tb) {
  const footer = document.getElementById("footer");
  if (!tb || footer.dataset.shown) return;
  footer.dataset.shown = "1";
  const parts = ["TensorBoard: ", el("code", {}, tb.command)];
  if (tb.url) parts.push(" — then ", el("a", { href: tb.url, target: "_blank", rel: "noopener" }, tb.url));
  footer.replaceChildren(...parts);
}

async function selectTask(task) {
  selected = task;
  document.getElementById("log-task").value = task;
  for (const row of document.querySelectorAll("#tasks tbody tr")) row.classList.toggle("selected", row.dataset.task === task);
  await refreshLog();
}

async function refreshLog() {
  if (!selected || gone) return;
  try {
    const data = await getJSON(`/api/logs/${encodeURIComponent(selected)}?lines=60`);
    const pre = document.getElementById("log");
    const atBottom = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
    pre.textContent = data.lines.join("\n");
    if (atBottom) pre.scrollTop = pre.scrollHeight;
  } catch (err) {
    if (!ended) document.getElementById("log").textContent = String(err); // at the end: the last tail stays
  }
}

async function tick() {
  try {
    const data = await getJSON(`/api/state?events=${eventCount}&page=${pageId}`);
    clockSkew = data.now - Date.now() / 1000;
    eventCount = data.event_count;
    events.push(...data.events);
    if (events.length > 2000) events.splice(0, events.length - 2000);
    lastStatus = data.status;
    if (lastStatus && lastStatus.tasks) {
      renderHead(lastStatus, data.progress, data.stale, data.recorded_at);
      renderTasks(lastStatus, data.task_count, data.task_states);
      renderFailures(lastStatus);
      renderNotices(data.notices);
      renderStacks(data.stacks);
      ended = ENDED.has(lastStatus.state);
    }
    renderEvents();
    renderFooter(data.tensorboard);
    if (data.curves_version !== curvesVersion && Date.now() - curvesAt > 1500) {
      curvesVersion = data.curves_version;
      curvesAt = Date.now();
      renderCurves(await getJSON("/api/curves"));
    }
    document.getElementById("note").textContent = "";
  } catch (err) {
    const note = document.getElementById("note");
    if (ended && err instanceof Unreachable) {
      // the run ended and its coordinator went with it: what is shown is its end
      note.textContent = "the run has ended and its coordinator no longer serves this page; `orchestrate show` with its run directory serves it again";
      gone = true;
      return;
    }
    note.textContent = err instanceof Refused ? err.message : `cannot reach the coordinator: ${err.message}`;
  }
  setTimeout(tick, 1000);
}

document.getElementById("log-task").addEventListener("change", (e) => selectTask(e.target.value));
setInterval(refreshLog, 2000);
tick();
