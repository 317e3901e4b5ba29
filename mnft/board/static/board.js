// mnft board: the page. It reads /api/events (server-sent events: lab, runs, run) and draws what it receives.
// A sweep (many runs from one command) is one entry of the runs list, its points under it, and has a page of its
// own (#/sweep/ID): every point's curve of the sweep's metric on one chart, the table, the best point marked.
// Everything the server sends that came from a host, a record or a log is set as text (textContent, text nodes,
// title): nothing is ever parsed as HTML, so a job name or a log line with markup shows as what it is. The page
// has no form and no button: it cannot change anything, on this machine or on any host.
"use strict";

(function () {
  const $ = (id) => document.getElementById(id);
  const state = { lab: null, runs: null, run: null, runId: null, skew: 0, drawn: false, chart: null, chartKey: null };
  const COLORS = ["#1c7ed6", "#e8590c", "#2f9e44", "#ae3ec9", "#f08c00", "#0c8599", "#c2255c", "#5c940d"];
  const TIME_COLORS = { launch_s: "#868e96", kept_s: "#2f9e44", checkpoint_s: "#1c7ed6", lost_s: "#e03131", detection_s: "#f08c00",
    finish_s: "#74c0fc", restart_s: "#ae3ec9" };

  // ------------------------------------------------------------------------------------------ building the DOM

  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(props || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (key === "className") node.className = value;
      else if (key === "id") node.id = value;
      else if (key === "title") node.title = String(value);
      else if (key === "href") node.href = value; // only "#/…" fragments built below
      else if (key === "hidden") node.hidden = true;
      else if (key === "colSpan") node.colSpan = value;
      else if (key === "style") Object.assign(node.style, value); // CSSOM, not markup: allowed by the CSP
      else if (key.startsWith("data-")) node.setAttribute(key, String(value));
      else throw new Error("el: unknown property " + key);
    }
    for (const child of children.flat()) {
      if (child === null || child === undefined || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  // replaceChildren, without the nulls a section leaves out (replaceChildren itself would write "null")
  function fill(node, ...children) {
    node.replaceChildren(...children.flat().filter((c) => c !== null && c !== undefined && c !== false));
    return node;
  }

  const runLink = (id, text) => el("a", { href: "#/run/" + encodeURIComponent(id) }, text === undefined ? id : text);
  const sweepLink = (id, text) => el("a", { href: "#/sweep/" + encodeURIComponent(id) }, text === undefined ? id : text);
  const SWEEP_CHIPS = 24; // a sweep's points named under its row in the runs list, at most (all of them on its page)
  const badge = (word) => el("span", { className: "badge", "data-state": word || "?" }, word || "?");

  // ------------------------------------------------------------------------------------------ numbers as text

  const isNum = (v) => typeof v === "number" && isFinite(v);
  const fmtLoss = (v) => (isNum(v) ? v.toFixed(4) : v === null || v === undefined ? "-" : String(v));
  const fmtInt = (v) => (isNum(v) ? String(Math.round(v)) : "-");
  const fmtRate = (v) => (isNum(v) ? (v >= 1e4 ? (v / 1e3).toFixed(1) + "k" : v.toFixed(0)) : "-");
  const fmtPct = (v) => (isNum(v) ? Math.round(v * 100) + "%" : "-");
  const now = () => Date.now() / 1000 + state.skew; // the server's clock

  function fmtSeconds(s) {
    if (!isNum(s)) return "-";
    if (s < 60) return s.toFixed(1) + "s";
    const m = Math.floor(s / 60);
    if (m < 60) return m + "m" + String(Math.floor(s % 60)).padStart(2, "0") + "s";
    return Math.floor(m / 60) + "h" + String(m % 60).padStart(2, "0") + "m";
  }

  function fmtAgo(t) {
    if (!isNum(t)) return "never";
    const s = Math.max(0, now() - t);
    if (s < 90) return Math.round(s) + "s ago";
    if (s < 5400) return Math.round(s / 60) + "m ago";
    if (s < 172800) return Math.round(s / 3600) + "h ago";
    return Math.round(s / 86400) + "d ago";
  }

  function fmtWhen(t) {
    if (!isNum(t)) return "-";
    const d = new Date(t * 1000);
    const hm = d.toTimeString().slice(0, 5);
    return d.toDateString() === new Date().toDateString() ? hm : d.toISOString().slice(5, 10) + " " + hm;
  }

  // ------------------------------------------------------------------------------------------ the lab

  function deviceName(row) {
    if (row.device === "cpu") return "CPUs";
    if (row.device === "-") return "host";
    return "GPU " + row.device;
  }

  function meter(kind, fraction, label) {
    const pct = isNum(fraction) ? Math.max(0, Math.min(100, fraction * 100)) : 0;
    return el("div", { className: "meter " + kind, title: label }, el("span", { style: { width: pct.toFixed(1) + "%" } }));
  }

  function isSession(row) {
    return typeof row.command === "string" && (row.command === "shell" || row.command.startsWith("shell: "));
  }

  // "shell by alice since 10:02" (a session), else who holds it and for how long
  function holderWords(row) {
    if (isSession(row)) return "shell by " + (row.user || "?") + (isNum(row.since) ? " since " + fmtWhen(row.since) : "");
    return (row.user || "?") + (row.since_text ? " · " + row.since_text : "");
  }

  function tile(row) {
    const words = [deviceName(row) + ": " + (row.state === "outside" ? "in use outside mnft" : row.state)];
    if (isSession(row)) words.push(holderWords(row));
    if (row.user) words.push("user " + row.user);
    if (row.run) words.push("run " + row.run);
    if (row.command) words.push(row.command);
    if (row.since_text) words.push("since " + row.since_text);
    if (row.model) words.push(row.model);
    if (row.memory) words.push("memory " + row.memory);
    if (isNum(row.utilization)) words.push("utilisation " + row.utilization + "%");
    if (row.health) words.push("health: " + row.health);
    if (row.detail) words.push(row.detail);
    else if (row.drain) words.push(row.drain);
    const who = row.state === "held" ? holderWords(row)
      : row.state === "outside" ? "outside: " + (row.user || "?")
      : (row.state === "drained" || row.state === "unhealthy") && row.detail ? row.detail : row.state;  // why it is out of service
    const notes = [];
    if (isSession(row) && row.command !== "shell") notes.push(el("div", { className: "tile-note session-command" }, row.command.slice(7)));
    if (isNum(row.idle)) notes.push(el("div", { className: "tile-note idle" }, "idle " + fmtSeconds(row.idle)));
    if (row.also) notes.push(el("div", { className: "tile-note collision" }, row.also));
    if (row.detail && row.detail.startsWith("reserved")) notes.push(el("div", { className: "tile-note reserved" }, row.detail));
    const memory = isNum(row.memory_total_mib) && row.memory_total_mib > 0 && isNum(row.memory_used_mib)
      ? meter("mem", row.memory_used_mib / row.memory_total_mib, "memory " + Math.round(row.memory_used_mib / 1024) + "/" + Math.round(row.memory_total_mib / 1024) + " GiB") : null;
    const util = isNum(row.utilization) ? meter("util", row.utilization / 100, "utilisation " + row.utilization + "%") : null;
    return el("div", { className: "tile", "data-host": row.host, "data-device": row.device, "data-state": row.state, "data-user": row.user || "",
      "data-run": row.run || "", "data-session": isSession(row) ? "1" : "", "data-collision": row.also ? "1" : "", title: words.join("\n") },
      el("div", { className: "tile-line" }, el("b", null, row.device === "cpu" ? "CPU" : row.device),
        el("span", { className: "who" }, row.run ? runLink(row.run, who) : who),
        el("span", { className: "pct" }, isNum(row.utilization) ? row.utilization + "%" : "")),
      memory || util ? el("div", { className: "meters" }, memory, util) : null, ...notes);
  }

  function renderLab() {
    const lab = state.lab;
    if (!lab) return;
    $("inventory").textContent = lab.inventory;
    const byHost = new Map();
    const line = [];
    for (const row of lab.devices) {
      if (row.state === "waiting") { line.push(row); continue; }
      if (!byHost.has(row.host)) byHost.set(row.host, []);
      byHost.get(row.host).push(row);
    }
    const devices = lab.devices.filter((r) => ["free", "held", "outside", "drained", "unhealthy"].includes(r.state));
    const free = devices.filter((r) => r.state === "free").length;
    const down = lab.hosts.filter((h) => !["ok", "asking"].includes(h.state)).length;
    const asking = lab.hosts.every((h) => h.state === "asking");
    $("lab-summary").textContent = asking ? "asking " + lab.hosts.length + " host(s)…"
      : free + " of " + devices.length + " device(s) free on " + lab.hosts.length + " host(s)" + (down ? ", " + down + " not answering" : "")
        + (isNum(lab.asked_s) ? " · asked in " + lab.asked_s.toFixed(2) + "s" : "");
    const cards = lab.hosts.map((host) => {
      const rows = (byHost.get(host.name) || []).filter((r) => r.device !== "-");
      const okay = host.state === "ok" || host.state === "slow";
      return el("article", { className: "host", "data-host": host.name, "data-state": host.state },
        el("header", null,
          el("b", { className: "host-name", title: host.name }, host.name),
          host.state === "ok" ? el("span", { className: "free" }, host.free + "/" + host.devices + " free")
            : host.state === "slow" ? el("span", { className: "badge", "data-state": "slow", title: isNum(host.answered) ? "its last answer is shown" : "it has not answered yet" }, "not answering")
            : badge(host.state),
          el("span", { className: "ago muted", "data-answered": isNum(host.answered) ? host.answered : "" }, "answered " + fmtAgo(host.answered))),
        host.whole_host ? el("p", { className: "note" }, "whole host: " + host.whole_host) : null,
        !okay && host.error ? el("p", { className: "error" }, host.error) : null,
        el("div", { className: "tiles" }, rows.map(tile)));
    });
    fill($("hosts"), ...cards);
    const crowded = lab.devices.filter((r) => r.state === "held" && r.also);
    fill($("collisions"), ...(crowded.length ? [el("h3", null, "Collisions"), el("ul", { className: "collisions" }, crowded.map((r) =>
      el("li", { "data-host": r.host, "data-device": r.device }, el("b", null, r.host + " " + deviceName(r)), ": held by " + (r.user || "?") + "'s "
        + (isSession(r) ? "session " : "run "), r.run ? runLink(r.run) : "?", "; " + r.also)))] : []));
    fill($("line"), ...(line.length ? [el("h3", null, "Waiting in line"), el("ol", { className: "waiting" }, line.map((r) =>
      el("li", { "data-host": r.host, "data-state": "waiting" }, el("b", null, r.host + " " + r.device), " ", r.user || "?",
        r.run ? [" · run ", runLink(r.run)] : null, r.command ? " · " + r.command : "", " · " + (r.detail || ""),
        r.since_text ? " · " + r.since_text : "")))] : []));
    fill($("legend"), ...["free", "held", "outside", "drained", "unhealthy", "unreachable"].map((s) => el("span", { className: "key", "data-state": s },
      s === "outside" ? "in use outside mnft" : s === "drained" ? "drained by an admin" : s === "unhealthy" ? "unhealthy (never leased)" : s)));
  }

  // ------------------------------------------------------------------------------------------ usage

  function renderUsage() {
    const data = state.usage;
    if (!data) return;
    const errors = Object.entries(data.errors || {});
    $("usage-summary").textContent = "GPU-hours per user, the last " + data.days + " days" + (errors.length ? " · not counted: " + errors.map((e) => e[0]).join(", ") : "");
    fill($("usage-body"), ...(data.users.length ? data.users.map((u) => el("tr", { "data-user": u.user },
      el("td", null, u.user), el("td", { className: "num" }, u.gpu_hours.toFixed(2)), el("td", { className: "num" }, fmtPct(u.idle_share)),
      el("td", { className: "num" }, String(u.leases)))) : [el("tr", null, el("td", { className: "muted" }, "no GPU use recorded"))]));
  }

  // ------------------------------------------------------------------------------------------ the runs

  const GOING = ["running", "starting", "checking", "syncing", "waiting"];

  function renderRuns() {
    const data = state.runs;
    if (!data) return;
    const sweeps = data.runs.filter((r) => r.kind === "sweep");
    const every = data.runs.filter((r) => r.kind !== "sweep").concat(...sweeps.map((s) => s.points || []));
    const going = every.filter((r) => GOING.includes(r.state)).length;
    $("runs-summary").textContent = every.length + " run(s), " + going + " going on" + (sweeps.length ? " · " + sweeps.length + " sweep(s)" : "") + " · " + data.root;
    fill($("runs-body"), ...data.runs.flatMap((r) => (r.kind === "sweep" ? sweepRows(r) : [runRow(r)])));
  }

  // a point of a sweep whose own record is not here: a row of its own, saying whose point it is
  function pointOf(r) {
    return r.sweep ? el("span", { className: "point-of muted" }, "point " + (isNum(r.sweep.index) ? r.sweep.index : "?") + " of sweep " + r.sweep.id + " · ") : null;
  }

  function sweepRows(s) {
    const best = s.best ? " · best " + s.best.label + " (" + s.metric + " " + fmtLoss(s.best.value) + ")" : "";
    const main = el("tr", { "data-run": s.id, "data-state": s.state, "data-mine": "1", "data-kind": "sweep" },
      el("td", { className: "id" }, sweepLink(s.id), " ", el("span", { className: "kind" }, "sweep")),
      el("td", null, badge(s.state)),
      el("td", { className: "job sweep-summary", title: (s.command || s.job || "") + "\n" + (s.summary || "") + best }, (s.summary || "") + best),
      el("td", null, s.user || "-"),
      el("td", { className: "hosts-cell", title: (s.hosts || []).join(", ") }, (s.hosts || []).length > 3 ? s.hosts.slice(0, 3).join(", ") + " +" + (s.hosts.length - 3) : (s.hosts || []).join(", ")),
      el("td", { className: "num step" }, "-"), el("td", { className: "num loss" }, "-"), el("td", { className: "num" }, "-"),
      el("td", { className: "num" }, "-"), el("td", { className: "num" }, "-"),
      el("td", { title: isNum(s.created) ? new Date(s.created * 1000).toString() : "" }, fmtWhen(s.created)));
    const points = s.points || [];
    if (!points.length) return [main];
    const chip = (p) => el("a", { href: "#/run/" + encodeURIComponent(p.id), className: "chip", "data-run": p.id, "data-state": p.state,
      "data-best": s.best && s.best.run_id === p.id ? "1" : null, title: p.id + ": " + p.state + (isNum(p.step) ? ", step " + p.step : "") },
      (s.best && s.best.run_id === p.id ? "★ " : "") + "#" + (p.sweep && isNum(p.sweep.index) ? p.sweep.index : "?") + " " + (p.sweep ? p.sweep.label : ""));
    const more = points.length - SWEEP_CHIPS;
    return [main, el("tr", { className: "sweep-points", "data-sweep": s.id },
      el("td", { colSpan: 11 }, el("span", { className: "muted" }, "points: "), points.slice(0, SWEEP_CHIPS).map(chip),
        more > 0 ? sweepLink(s.id, "+" + more + " more on the sweep's page") : null))];
  }

  function runRow(r) {
    return el("tr", { "data-run": r.id, "data-state": r.state, "data-mine": r.mine ? "1" : "0" },
      el("td", { className: "id" }, runLink(r.id)),
      el("td", null, badge(r.state)),
      el("td", { className: "job", title: r.command || r.job || "" }, pointOf(r), r.command_short || r.job || "-"),
      el("td", null, r.user || "-"),
      el("td", { className: "hosts-cell", title: (r.hosts || []).join(", ") }, (r.hosts || []).length > 3 ? r.hosts.slice(0, 3).join(", ") + " +" + (r.hosts.length - 3) : (r.hosts || []).join(", ")),
      el("td", { className: "num step" }, isNum(r.step) ? (r.step_about ? "~" : "") + r.step : "-"),
      el("td", { className: "num loss" }, fmtLoss(r.loss)),
      el("td", { className: "num" }, fmtRate(r.tokens_per_s)),
      el("td", { className: "num" }, isNum(r.restarts) ? String(r.restarts) : "-"),
      el("td", { className: "num" }, fmtPct(r.goodput)),
      el("td", { title: isNum(r.created) ? new Date(r.created * 1000).toString() : "" }, fmtWhen(r.created)));
  }

  // ------------------------------------------------------------------------------------------ a run's page

  function runSkeleton(id, kind) {
    const page = $("run");
    state.chart && state.chart.destroy();
    state.chart = null;
    state.chartKey = null;
    page.setAttribute("data-kind", kind);
    if (kind === "sweep") {
      fill(page,
        el("nav", { className: "crumbs" }, el("a", { href: "#/" }, "← lab and runs")),
        el("div", { id: "run-head", className: "panel" }, el("h2", null, "sweep " + id), el("p", { className: "muted" }, "reading…")),
        el("section", { id: "sweep-curve", className: "panel", hidden: true }, el("h3", { id: "sweep-curve-title" }), el("p", { id: "curve-note", className: "muted" }),
          el("div", { id: "chart", className: "chart" })),
        el("section", { id: "sweep-points", className: "panel", hidden: true }));
      return;
    }
    fill(page, 
      el("nav", { className: "crumbs" }, el("a", { href: "#/" }, "← lab and runs")),
      el("div", { id: "run-head", className: "panel" }, el("h2", null, "run " + id), el("p", { className: "muted" }, "reading…")),
      el("div", { id: "run-failure" }),
      el("section", { id: "run-curve", className: "panel", hidden: true }, el("h3", null, "Loss"), el("p", { id: "curve-note", className: "muted" }),
        el("div", { id: "chart", className: "chart" }), el("p", { id: "curve-marks", className: "marks" })),
      el("section", { id: "run-time", className: "panel", hidden: true }),
      el("section", { id: "run-hosts", className: "panel", hidden: true }),
      el("section", { id: "run-logs", className: "panel", hidden: true }));
  }

  function stat(label, value) {
    return el("div", { className: "stat" }, el("span", { className: "muted" }, label), el("b", null, value));
  }

  function renderRun() {
    const r = state.run;
    if (!r || r.id !== state.runId) return;
    const kind = r.kind === "sweep" ? "sweep" : "run";
    if ($("run").getAttribute("data-kind") !== kind) runSkeleton(r.id, kind); // #/sweep/ID of a run, or #/run/ID of a sweep
    document.title = kind + " " + r.id + " · mnft board";
    if (kind === "sweep") {
      renderSweep(r);
      return;
    }
    const head = $("run-head");
    if (r.missing) {
      fill(head, el("h2", null, "run " + r.id), el("p", null, "No such run here, and no host of the lab holds anything for it now."));
      return;
    }
    const hosts = r.hosts || [];
    fill(head, 
      el("h2", null, "run ", el("span", { className: "mono" }, r.id), " ", badge(r.state)),
      r.command ? el("p", { className: "command mono" }, r.command) : null,
      el("p", { className: "meta" }, el("span", { className: "job" }, r.job || "-"), " · ", r.user || "?", " · ", hosts.length + " host(s): " + hosts.join(", "),
        " · started " + fmtWhen(r.created), isNum(r.ended) ? " · ended " + fmtWhen(r.ended) + " (" + fmtSeconds(r.ended - r.created) + ")" : "",
        r.attempt > 1 ? " · attempt " + r.attempt : "", r.live && r.live.state ? " · supervisor: " + r.live.state : "",
        r.detached ? " · detached" : "", r.slurm ? " · on Slurm" : "",
        r.sweep ? [" · point " + (isNum(r.sweep.index) ? r.sweep.index : "?") + " (" + r.sweep.label + ") of sweep ", sweepLink(r.sweep.id)] : null,
        r.supervisor ? " · supervisor on " + r.supervisor.host + " pid " + r.supervisor.pid + " since " + fmtWhen(r.supervisor.since) + ": "
          + (r.supervisor.alive === true ? "alive" : r.supervisor.alive === false ? (r.state === "supervisor-lost" ? "gone" : "ended") : "not reached") : ""),
      el("div", { className: "stats" }, stat("step", isNum(r.step) ? (r.step_about ? "~" : "") + r.step : "-"), stat("loss", fmtLoss(r.loss)),
        stat("tokens/s", fmtRate(r.tokens_per_s)), stat("restarts", isNum(r.restarts) ? String(r.restarts) : "-"), stat("goodput", fmtPct(r.goodput))),
      r.reason && !r.failure ? el("p", { className: "reason" }, r.reason) : null,
      r.live && r.live.note ? el("p", { className: "note" }, r.live.note) : null,
      ...(r.live && r.live.stragglers || []).map((s) => el("p", { className: "note" }, "straggler: " + s)));
    if (!r.mine) {
      renderTheirs(r);
      return;
    }
    renderFailure(r);
    renderCurve(r.curve);
    renderTime(r.time);
    renderHosts(r);
    renderLogs(r);
  }

  function renderTheirs(r) {
    const leases = r.leases || [];
    const section = $("run-hosts");
    section.hidden = false;
    fill(section, el("h3", null, "Where it runs"),
      el("p", { className: "muted" }, "Started from another controller" + (r.user ? " by " + r.user : "") + ": as its leases on the hosts show it (its curve and logs are on its controller; `mnft status " + r.id + "` there)."),
      el("table", { className: "hosts-table" }, el("thead", null, el("tr", null, ["host", "device", "state", "user", "command", "since", "detail"].map((h) => el("th", null, h)))),
        el("tbody", null, leases.map((l) => el("tr", { "data-host": l.host }, [l.host, l.device, l.state, l.user, l.command, l.since_text, l.detail].map((v) => el("td", null, v || "-")))))));
  }

  function renderFailure(r) {
    const box = $("run-failure");
    const f = r.failure;
    const warnings = r.warnings || [];
    fill(box, 
      f ? el("section", { className: "panel failure", "data-kind": f.kind || "" },
        el("h3", null, f.attempt ? "First failure (attempt " + f.attempt + ")" : "Failure", f.host ? " on " + f.host : ""),
        f.cause ? el("p", { className: "cause" }, el("b", null, "cause: "), f.cause) : null,
        f.fix ? el("p", { className: "fix" }, el("b", null, "fix: "), f.fix) : null,
        f.reason ? el("p", { className: "reason muted" }, f.reason) : null) : null,
      ...warnings.map((w) => el("section", { className: "panel warning" }, el("p", null, el("b", null, "warning: "), w.cause || ""), el("p", null, el("b", null, "fix: "), w.fix || ""))));
  }

  function curveData(curve) {
    const tables = new Map();
    curve.x.forEach((x, i) => {
      const attempt = curve.attempt[i] || 1;
      if (!tables.has(attempt)) tables.set(attempt, []);
      tables.get(attempt).push([x, curve.loss[i]]);
    });
    const attempts = [...tables.keys()].sort((a, b) => a - b);
    const aligned = attempts.map((a) => {
      const pairs = tables.get(a).sort((p, q) => p[0] - q[0]);
      return [pairs.map((p) => p[0]), pairs.map((p) => p[1])];
    });
    const data = aligned.length === 1 ? aligned[0] : uPlot.join(aligned);
    let points = 0;
    for (const series of data.slice(1)) for (const y of series) if (y !== null && y !== undefined) points += 1;
    return { attempts, data, points };
  }

  function drawMarks(u, curve) {
    if (!curve.by_step) return;
    const ctx = u.ctx;
    const { left, top, width, height } = u.bbox;
    const px = window.devicePixelRatio || 1;
    const clamp = (x) => Math.max(left, Math.min(left + width, x));
    ctx.save();
    ctx.font = 11 * px + "px sans-serif";
    ctx.textAlign = "left";
    ctx.textBaseline = "alphabetic";
    for (const band of curve.lost) {
      const x0 = clamp(u.valToPos(band.from, "x", true));
      const x1 = clamp(u.valToPos(band.to, "x", true));
      ctx.fillStyle = "rgba(224, 49, 49, 0.13)";
      ctx.fillRect(x0, top, Math.max(1, x1 - x0), height);
      ctx.fillStyle = "#c92a2a";
      ctx.fillText(band.steps + " steps lost", x0 + 3 * px, top + height - 6 * px);
    }
    ctx.strokeStyle = "#e03131";
    ctx.fillStyle = "#c92a2a";
    ctx.setLineDash([5 * px, 4 * px]);
    ctx.lineWidth = px;
    for (const mark of curve.restarts) {
      const x = u.valToPos(mark.step, "x", true);
      if (x < left || x > left + width) continue;
      ctx.beginPath();
      ctx.moveTo(x, top);
      ctx.lineTo(x, top + height);
      ctx.stroke();
      ctx.fillText(mark.label || "restart", x + 3 * px, top + 12 * px);
    }
    ctx.restore();
  }

  function renderCurve(curve) {
    const section = $("run-curve");
    if (!curve || !curve.points) {
      section.hidden = !curve;
      if (curve) {
        $("curve-note").textContent = "no step records yet";
        fill($("chart"), );
        $("chart").setAttribute("data-points", "0");
        state.chart && state.chart.destroy();
        state.chart = null;
        state.chartKey = null;
      }
      return;
    }
    section.hidden = false;
    const { attempts, data, points } = curveData(curve);
    const source = curve.source === "metrics" ? "metrics.jsonl (the run's collected metrics)" : "step records as the supervisor received them (live)";
    $("curve-note").textContent = curve.points + " point(s) from " + source + (curve.by_step ? "" : "; the format gives no step: x is the logged point");
    const marks = [...curve.restarts.map((m) => (m.label || "restart") + " resumed at step " + m.step),
      ...curve.lost.map((l) => "attempt " + l.attempt + ": steps " + (l.from + 1) + "–" + l.to + " lost (trained again)")];
    fill($("curve-marks"), ...marks.map((m) => el("span", { className: "mark" }, m)));
    const box = $("chart");
    box.setAttribute("data-points", String(points));
    box.setAttribute("data-attempts", String(attempts.length));
    const key = state.runId + "|" + attempts.join(",") + "|" + curve.by_step;
    state.curve = curve;
    drawChart(box, key, data, [{ label: curve.by_step ? "step" : "logged point" }, { label: "loss", size: 60 }],
      () => [{ label: curve.by_step ? "step" : "point" },
        ...attempts.map((a, i) => ({ label: (curve.labels && curve.labels[a]) || (attempts.length > 1 ? "attempt " + a : "loss"), stroke: COLORS[i % COLORS.length], width: 1.5,
          spanGaps: true, points: { show: points <= 120 }, value: (u, v) => fmtLoss(v) }))],
      (u) => drawMarks(u, state.curve));
  }

  // The page's one chart: new data for the same series only redraws it; other series (another run, attempt or
  // point set) build it anew.
  function drawChart(box, key, data, axes, series, draw) {
    if (state.chart && state.chartKey === key) {
      state.chart.setData(data);
      return;
    }
    state.chart && state.chart.destroy();
    const opts = { width: Math.max(320, box.clientWidth || 800), height: 300, scales: { x: { time: false } }, axes, series: series(), hooks: { draw: [draw] } };
    state.chart = new uPlot(opts, data, box);
    state.chartKey = key;
  }

  // ------------------------------------------------------------------------------------------ a sweep's page

  // a point's colour, the same on the chart and in the table: by its index, so a point keeps it as others start
  function pointColor(index, count) {
    const i = (isNum(index) ? index : 1) - 1;
    return count <= COLORS.length ? COLORS[i % COLORS.length] : "hsl(" + Math.round((i * 137.508) % 360) + ", 68%, 42%)";
  }

  const isBest = (best, p) => Boolean(best) && best.run_id === p.run_id && best.index === p.index;

  function renderSweep(s) {
    const rows = s.rows || [];
    const goal = s.goal === "max" ? "higher is better" : "lower is better";
    const best = s.best;
    fill($("run-head"),
      el("h2", null, "sweep ", el("span", { className: "mono" }, s.id), " ", badge(s.state)),
      s.command ? el("p", { className: "command mono" }, s.command) : null,
      el("p", { className: "meta" }, el("span", { className: "job" }, s.job || "-"), " · ", s.user || "?",
        " · " + rows.length + " point(s) over " + ((s.keys || []).join(", ") || "-"), " · metric " + s.metric + " (" + goal + ")",
        isNum(s.max_parallel) ? " · at most " + s.max_parallel + " at once" : "", s.after ? " · after " + s.after : "",
        " · started " + fmtWhen(s.created), isNum(s.ended) ? " · ended " + fmtWhen(s.ended) + " (" + fmtSeconds(s.ended - s.created) + ")" : "",
        s.supervisor ? " · supervisor on " + s.supervisor.host + " pid " + s.supervisor.pid + ": "
          + (s.supervisor.alive === true ? "alive" : s.supervisor.alive === false ? "ended" : "not reached") : ""),
      el("p", { className: "sweep-summary" }, s.summary || ""),
      best ? el("p", { className: "best-line" }, el("b", null, "★ best: "), "point " + best.index + " (" + best.label + "), ", runLink(best.run_id),
        ": " + s.metric + " " + fmtLoss(best.value) + (isNum(best.step) ? " at step " + best.step : ""))
        : el("p", { className: "best-line muted" }, "no point has logged " + s.metric + " yet"),
      s.reason && ["failed", "stopped"].includes(s.state) ? el("p", { className: "reason" }, s.reason) : null);
    renderSweepTable(s);
    renderSweepCurve(s);
  }

  function renderSweepTable(s) {
    const section = $("sweep-points");
    const rows = s.rows || [];
    section.hidden = false;
    const keys = s.keys || [];
    const drawn = new Set(((s.curves || {}).series || []).map((c) => c.run_id));
    const head = ["point", "run", ...keys, "state", "where", "step", "last " + s.metric, "best " + s.metric, "time", "note"];
    const cell = (col, value, extra) => el("td", Object.assign({ "data-col": col }, extra || {}), value);
    fill(section,
      el("h3", null, "Points"),
      el("div", { className: "table-wrap" }, el("table", { className: "sweep-table" },
        el("thead", null, el("tr", null, head.map((h, i) => el("th", { className: i >= keys.length + 4 && i < keys.length + 8 ? "num" : null }, h)))),
        el("tbody", null, rows.map((p) => {
          const top = isBest(s.best, p);
          return el("tr", { "data-run": p.run_id || "", "data-index": p.index, "data-state": p.state, "data-best": top ? "1" : null, className: top ? "best" : null },
            cell("point", [drawn.has(p.run_id) ? el("i", { className: "swatch", style: { background: pointColor(p.index, rows.length) } }) : null,
              top ? el("span", { className: "star", title: "the best point by " + s.metric }, "★ ") : null, "#" + (isNum(p.index) ? p.index : "?")]),
            cell("run", p.recorded && p.run_id ? runLink(p.run_id) : p.run_id || "-", { className: "mono" }),
            keys.map((k) => cell("value", (p.values || {})[k] === undefined ? "-" : p.values[k], { "data-key": k })),
            cell("state", badge(p.state)), cell("where", p.where || "-"),
            cell("step", isNum(p.step) ? String(p.step) : "-", { className: "num" }),
            cell("last", fmtLoss(p.last), { className: "num" }), cell("best", fmtLoss(p.best), { className: "num" }),
            cell("time", fmtSeconds(p.seconds), { className: "num" }),
            cell("note", p.reason || "", { className: "note-cell" }));
        })))));
  }

  function drawBest(u) {
    const b = state.sweepBest;
    if (!b || !isNum(b.step) || !isNum(b.value)) return;
    const x = u.valToPos(b.step, "x", true);
    const y = u.valToPos(b.value, "y", true);
    const { left, top, width, height } = u.bbox;
    if (x < left || x > left + width || y < top || y > top + height) return;
    const px = window.devicePixelRatio || 1;
    const ctx = u.ctx;
    ctx.save();
    ctx.beginPath();
    for (let i = 0; i < 10; i++) { // a five-pointed star
      const r = (i % 2 ? 4 : 10) * px;
      const a = -Math.PI / 2 + (i * Math.PI) / 5;
      ctx[i ? "lineTo" : "moveTo"](x + r * Math.cos(a), y + r * Math.sin(a));
    }
    ctx.closePath();
    ctx.fillStyle = "#f59f00";
    ctx.strokeStyle = "#7a4a00";
    ctx.lineWidth = px;
    ctx.fill();
    ctx.stroke();
    ctx.font = "bold " + 11 * px + "px sans-serif";
    ctx.textAlign = "left";
    ctx.textBaseline = "alphabetic";
    const words = "best: " + b.label;
    const w = ctx.measureText(words).width;
    const tx = x > left + width * 0.7 ? x - 12 * px - w : x + 12 * px;
    const ty = y > top + 30 * px ? y - 14 * px : y + 22 * px; // above the star, else below it
    ctx.fillStyle = "rgba(255, 244, 230, 0.92)";
    ctx.fillRect(tx - 3 * px, ty - 11 * px, w + 6 * px, 15 * px);
    ctx.fillStyle = "#7a4a00";
    ctx.fillText(words, tx, ty);
    ctx.restore();
  }

  function renderSweepCurve(s) {
    const curves = s.curves || { series: [] };
    const series = curves.series || [];
    const section = $("sweep-curve");
    const box = $("chart");
    section.hidden = false;
    $("sweep-curve-title").textContent = s.metric + " of every point (" + (s.goal === "max" ? "higher" : "lower") + " is better)";
    const drawnPoints = series.reduce((n, c) => n + c.x.length, 0);
    box.setAttribute("data-series", String(series.length));
    box.setAttribute("data-points", String(drawnPoints));
    box.setAttribute("data-best", s.best ? s.best.run_id || "" : "");
    if (!series.length) {
      $("curve-note").textContent = "no point has logged " + s.metric + " yet";
      state.chart && state.chart.destroy();
      state.chart = null;
      state.chartKey = null;
      fill(box);
      return;
    }
    $("curve-note").textContent = series.length + " of " + (s.rows || []).length + " point(s) drawn, " + curves.points + " step record(s) of " + s.metric
      + (drawnPoints < curves.points ? " (" + drawnPoints + " sent)" : "") + "; x is the step";
    const data = series.length === 1 ? [series[0].x, series[0].y] : uPlot.join(series.map((c) => [c.x, c.y]));
    state.sweepBest = s.best;
    const count = (s.rows || []).length;
    const key = "sweep|" + state.runId + "|" + series.map((c) => c.run_id).join(",") + "|" + (s.best ? s.best.run_id : "");
    drawChart(box, key, data, [{ label: "step" }, { label: s.metric, size: 60 }],
      () => [{ label: "step" }, ...series.map((c) => {
        const top = isBest(s.best, c);
        return { label: (top ? "★ " : "") + "#" + c.index + " " + c.label, stroke: pointColor(c.index, count), width: top ? 3 : 1.25,
          spanGaps: true, points: { show: drawnPoints <= 120 }, value: (u, v) => fmtLoss(v) };
      })],
      drawBest);
  }

  function renderTime(spent) {
    const section = $("run-time");
    if (!spent || !isNum(spent.wall_s) || spent.wall_s <= 0) {
      section.hidden = true;
      return;
    }
    section.hidden = false;
    const columns = spent.columns || [];
    const keys = ["launch_s", "kept_s", "checkpoint_s", "lost_s", "detection_s", "finish_s", "restart_s"];
    const names = Object.fromEntries(columns.map(([name, key]) => [key, name]));
    names.kept_s = "training (kept)";
    names.other = spent.unknown ? "not known" : "other";
    const total = (key) => spent.attempts.reduce((sum, a) => sum + (isNum(a[key]) ? a[key] : 0), 0);
    const parts = keys.map((k) => [k, total(k)]).filter(([, v]) => v > 0);
    const counted = parts.reduce((s, [, v]) => s + v, 0);
    if (spent.wall_s - counted > spent.wall_s * 0.01) parts.push(["other", spent.wall_s - counted]);
    const segment = ([k, v]) => el("span", { className: "seg", "data-part": k, title: (names[k] || k) + ": " + fmtSeconds(v),
      style: { width: (100 * v / Math.max(spent.wall_s, counted)).toFixed(2) + "%", background: TIME_COLORS[k] || "#dee2e6" } });
    const head = ["attempt", ...columns.map(([name]) => name), "steps lost"];
    fill(section, 
      el("h3", null, "Where the time went: " + fmtSeconds(spent.wall_s) + " wall" + (isNum(spent.goodput) ? ", goodput " + fmtPct(spent.goodput) : "")),
      el("div", { className: "timebar" }, parts.map(segment)),
      el("div", { className: "timekeys" }, parts.map(([k, v]) => el("span", { className: "key" }, el("i", { style: { background: TIME_COLORS[k] || "#dee2e6" } }),
        (names[k] || k) + " " + fmtSeconds(v)))),
      el("table", { className: "time-table" }, el("thead", null, el("tr", null, head.map((h) => el("th", null, h)))),
        el("tbody", null, spent.attempts.map((a) => el("tr", null, el("td", null, a.number + " (" + (a.state || "?") + ")"),
          columns.map(([, key]) => el("td", { className: "num", "data-key": key }, fmtSeconds(a[key]) + (key === "checkpoint_s" && a.saved ? " " + a.saved : ""))),
          el("td", { className: "num" }, isNum(a.steps_lost) ? String(a.steps_lost) : "-"))))),
      spent.unknown ? el("p", { className: "muted time-unknown" }, spent.unknown) : null);
  }

  function renderHosts(r) {
    const section = $("run-hosts");
    const hosts = r.host_states || [];
    section.hidden = !hosts.length;
    const head = ["host", "node rank", "state", "exit code", "processes", "step", "loss", "since", "note"];
    fill(section, 
      el("h3", null, "Hosts", isNum(r.asked) ? el("span", { className: "muted ago", "data-answered": r.asked }, " answered " + fmtAgo(r.asked)) : el("span", { className: "muted" }, " as recorded")),
      el("table", { className: "hosts-table" }, el("thead", null, el("tr", null, head.map((h) => el("th", null, h)))),
        el("tbody", null, hosts.map((h) => el("tr", { "data-host": h.name, "data-state": h.state || "" },
          el("td", null, h.name), el("td", null, isNum(h.node_rank) ? String(h.node_rank) : "-"), el("td", null, badge(h.state)),
          el("td", { className: "num" }, h.exit_code === null || h.exit_code === undefined ? "-" : String(h.exit_code)),
          el("td", { className: "num" }, isNum(h.processes) ? String(h.processes) : "-"),
          el("td", { className: "num" }, isNum(h.step) ? String(h.step) : "-"), el("td", { className: "num" }, fmtLoss(h.loss)),
          el("td", null, isNum(h.since) ? fmtAgo(h.since) : "-"),
          el("td", { className: "note-cell" }, [h.error, h.meaning, h.straggler ? "straggler: " + h.straggler : null].filter(Boolean).join("; ") || ""))))));
  }

  function renderLogs(r) {
    const section = $("run-logs");
    const hosts = (r.host_states || []).filter((h) => h.lines && h.lines.length);
    section.hidden = !hosts.length;
    if (!hosts.length) return;
    const from = { host: "from the host, following", collected: "as `mnft logs` collected them", record: "as the record kept them" };
    const old = new Map([...section.querySelectorAll("pre[data-host]")].map((p) => [p.getAttribute("data-host"), p]));
    const blocks = hosts.map((h) => {
      const previous = old.get(h.name);
      const atEnd = !previous || previous.scrollTop + previous.clientHeight >= previous.scrollHeight - 24;
      const pre = el("pre", { className: "log", "data-host": h.name },
        h.lines.map(([rank, text]) => el("span", { className: "line" }, el("span", { className: "rank" }, h.name + (rank === null ? "" : " r" + rank) + "| "), text, "\n")));
      return [el("h4", null, h.name, el("span", { className: "muted" }, " · last " + h.lines.length + " line(s), " + (from[h.lines_from] || ""))), pre, atEnd, previous];
    });
    fill(section, el("h3", null, "Last lines"), ...blocks.flatMap(([h4, pre]) => [h4, pre]));
    for (const [, pre, atEnd, previous] of blocks) pre.scrollTop = atEnd ? pre.scrollHeight : previous.scrollTop;
  }

  // ------------------------------------------------------------------------------------------ events and routes

  let source = null;

  function connect(runId) {
    if (source && source.runId === runId && source.readyState !== EventSource.CLOSED) return;
    if (source) source.close();
    source = new EventSource("/api/events" + (runId ? "?run=" + encodeURIComponent(runId) : ""));
    source.runId = runId;
    const conn = $("conn");
    source.onopen = () => { conn.textContent = "live"; conn.setAttribute("data-state", "live"); };
    source.onerror = () => { conn.textContent = "reconnecting…"; conn.setAttribute("data-state", "down"); };
    const take = (name, render) => source.addEventListener(name, (event) => {
      const data = JSON.parse(event.data);
      if (data && isNum(data.now)) state.skew = data.now - Date.now() / 1000;
      state[name] = data;
      if (name !== "run" || !$("run").hidden) render();
      firstPaint();
    });
    take("lab", renderLab);
    take("runs", renderRuns);
    take("usage", renderUsage);
    take("run", renderRun);
  }

  function firstPaint() {
    if (state.drawn || !state.lab || !state.runs) return;
    state.drawn = true;
    requestAnimationFrame(() => {
      performance.mark("board-drawn");
      document.documentElement.setAttribute("data-drawn", "1");
    });
  }

  function route() {
    const match = /^#\/(run|sweep)\/(.+)$/.exec(location.hash);
    const section = /^#\/(lab|runs)$/.exec(location.hash);
    let runId = null;
    try {
      runId = match ? decodeURIComponent(match[2]) : null;
    } catch (e) {
      runId = null;
    }
    const kind = match && match[1] === "sweep" ? "sweep" : "run";
    $("overview").hidden = Boolean(runId);
    $("run").hidden = !runId;
    if (runId !== state.runId) {
      state.runId = runId;
      state.run = null;
      if (runId) runSkeleton(runId, kind);
      else if (state.chart) { state.chart.destroy(); state.chart = null; state.chartKey = null; }
    }
    document.title = runId ? kind + " " + runId + " · mnft board" : "mnft board";
    connect(runId);
    if (section) $(section[1]).scrollIntoView();
    else window.scrollTo(0, 0);
  }

  function tick() {
    for (const node of document.querySelectorAll("[data-answered]")) {
      const t = parseFloat(node.getAttribute("data-answered"));
      node.textContent = (node.closest("h3") ? " " : "") + "answered " + fmtAgo(isFinite(t) ? t : null);
    }
  }

  let resizing = null;
  window.addEventListener("resize", () => {
    clearTimeout(resizing);
    resizing = setTimeout(() => {
      const box = $("chart");
      if (state.chart && box) state.chart.setSize({ width: Math.max(320, box.clientWidth), height: 300 });
    }, 150);
  });
  window.addEventListener("hashchange", route);
  setInterval(tick, 1000);
  route();
})();
