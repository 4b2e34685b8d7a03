"use strict";
(function () {
  const SERIES = ["executed", "replayed", "in_flight", "conflict", "failed"];
  const LABELS = {
    executed: "executed", replayed: "replayed", in_flight: "in flight (409)",
    conflict: "conflict (422)", failed: "failed", lease_takeover: "lease takeovers",
    stale_refused: "stale refused", invalid_key: "invalid keys",
    store_unavailable: "store unavailable", unrecorded: "unrecorded outcomes",
    unscoped: "run unrecorded (anonymous)", principal_refused: "refused (credentials)",
  };
  const $ = (id) => document.getElementById(id);
  // Set by the token page (kept in memory only); absent when the browser sent the header.
  const token = window.retrysafeAdminToken;
  const headers = token ? { Authorization: "Bearer " + token } : {};
  // Absolute URLs under the dashboard's own mount point, whatever the address bar says.
  const base = document.querySelector('meta[name="retrysafe-base"]').content;

  function el(tag, text, cls) {
    const e = document.createElement(tag);
    if (text !== undefined && text !== null) e.textContent = String(text);
    if (cls) e.className = cls;
    return e;
  }
  function pct(x) { return x === null || x === undefined ? "–" : (100 * x).toFixed(1) + " %"; }
  function num(x) { return x === null || x === undefined ? "–" : Math.round(x).toLocaleString(); }
  function secs(x) {
    if (x === null || x === undefined) return "–";
    if (x < 0.001) return (x * 1e6).toFixed(0) + " µs";
    if (x < 1) return (x * 1000).toFixed(1) + " ms";
    if (x < 120) return x.toFixed(1) + " s";
    return (x / 60).toFixed(1) + " min";
  }
  function when(t) { return new Date(t * 1000).toLocaleTimeString(); }
  function rows(tbody, list, cells, empty, columns) {
    tbody.replaceChildren();
    if (!list.length) {
      const tr = el("tr"); const td = el("td", empty, "empty"); td.colSpan = columns;
      tr.append(td); tbody.append(tr); return;
    }
    for (const item of list) {
      const tr = el("tr");
      for (const [text, cls] of cells(item)) tr.append(el("td", text, cls));
      tbody.append(tr);
    }
  }

  // -- charts: plain SVG, no library ---------------------------------------------------
  const NS = "http://www.w3.org/2000/svg";
  function svg(tag, attrs) {
    const e = document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    return e;
  }
  function chart(node, times, lines, maxY, format) {
    const w = node.clientWidth || 600, h = node.clientHeight || 170;
    const left = 44, right = 8, top = 8, bottom = 18;
    node.setAttribute("viewBox", `0 0 ${w} ${h}`);
    node.replaceChildren();
    const span = times.length > 1 ? times[times.length - 1] - times[0] : 1;
    const x = (t) => left + (w - left - right) * (times.length > 1 ? (t - times[0]) / span : 1);
    const y = (v) => top + (h - top - bottom) * (1 - v / maxY);
    for (const f of [0, 0.5, 1]) {
      node.append(svg("line", { x1: left, x2: w - right, y1: y(maxY * f), y2: y(maxY * f),
        stroke: "#dde1e8" }));
      const label = svg("text", { x: 2, y: y(maxY * f) + 3 });
      label.textContent = format(maxY * f);
      node.append(label);
    }
    if (times.length) {
      const first = svg("text", { x: left, y: h - 4 });
      first.textContent = when(times[0]);
      const last = svg("text", { x: w - right, y: h - 4, "text-anchor": "end" });
      last.textContent = when(times[times.length - 1]);
      node.append(first, last);
    }
    for (const line of lines) {
      let d = "", pen = false;
      line.values.forEach((v, i) => {
        if (v === null || v === undefined) { pen = false; return; }
        d += (pen ? "L" : "M") + x(times[i]).toFixed(1) + "," + y(v).toFixed(1);
        pen = true;
      });
      if (d) node.append(svg("path", { d, fill: "none", stroke: line.color, "stroke-width": 2,
        "data-series": line.name }));
    }
  }
  function color(name) {
    return getComputedStyle(document.documentElement).getPropertyValue("--c-" + name).trim();
  }

  // -- the page --------------------------------------------------------------------------
  function render(s) {
    const store = s.store;
    $("store-url").textContent = store ? "store " + store.url : "no store";
    const health = $("store-health");
    if (!store) { health.textContent = "no store"; health.className = "badge"; }
    else if (store.up) {
      health.textContent = "store up" + (store.probe_seconds !== null ? " · " + secs(store.probe_seconds) : "");
      health.className = "badge ok";
    } else { health.textContent = "store down"; health.className = "badge bad"; health.title = store.error || ""; }
    $("updated").textContent = "updated " + when(s.now) + (s.multiprocess ? " · all workers" : "");
    $("loopback-note").hidden = !!(s.admin && s.admin.token);

    const rate = s.duplicate_rate;
    $("rate-window").textContent = pct(rate.window);
    $("rate-window-label").textContent = "last " + rate.window_seconds + " s";
    $("rate-lifetime").textContent = "lifetime " + pct(rate.lifetime);

    const counts = $("counts");
    counts.replaceChildren();
    for (const [name, label] of Object.entries(LABELS)) {
      const box = el("div", null, "count");
      box.dataset.outcome = name;
      box.append(el("b", num(s.totals[name])), el("span", label));
      counts.append(box);
    }
    const alerts = Object.values(s.alerts || {}).reduce((a, b) => a + b, 0);
    const box = el("div", null, "count"); box.dataset.outcome = "alerts";
    box.append(el("b", num(alerts)), el("span", "alerts"));
    counts.append(box);

    const series = s.series;
    chart($("chart-rate"), series.t, [{ name: "duplicate_rate", values: series.duplicate_rate,
      color: color("rate") }], 1, (v) => (100 * v).toFixed(0) + "%");
    let max = 1;
    for (const name of SERIES) for (const v of series[name]) if (v > max) max = v;
    chart($("chart-outcomes"), series.t, SERIES.map((name) => ({ name, values: series[name],
      color: color(name) })), Math.ceil(max * 1.1), (v) => v.toFixed(0) + "/s");
    const legend = $("legend-outcomes");
    if (!legend.childElementCount) {
      for (const name of SERIES) {
        const item = el("span"); const swatch = el("i"); swatch.style.background = color(name);
        item.append(swatch, document.createTextNode(LABELS[name])); legend.append(item);
      }
    }

    rows($("in-flight").tBodies[0], s.in_flight, (r) => [
      [r.key, "key"], [r.operation], [secs(r.age)],
      [r.lease_left < 0 ? "expired " + secs(-r.lease_left) + " ago" : secs(r.lease_left), "opt"],
      [r.attempts, "opt"],
    ], "nothing in flight", 5);
    rows($("recent").tBodies[0], s.recent, (e) => [
      [when(e.at)], [e.kind.replace("alert:", "alert: ") + (e.operation ? " · " + e.operation : "")],
      [e.key, "key"], [e.detail, "opt"],
    ], "nothing yet", 4);

    const st = $("store").tBodies[0];
    const facts = store ? (store.up ? [
      ["processing", num(store.by_status.processing)],
      ["completed", num(store.by_status.completed)],
      ["failed", num(store.by_status.failed)],
      ["expired, not swept", num(store.expired)],
      ["archive", store.archived === null ? "none" : num(store.archived)],
      ["oldest processing", secs(store.oldest_processing_age)],
      ["read", store.checked_at ? when(store.checked_at) : "–"],
    ] : [["error", store.error || "unavailable"]]) : [["store", "none"]];
    rows(st, facts, (f) => [[f[0]], [f[1], "mono"]], "", 2);

    const lat = Object.entries(s.latency.store).map(([k, v]) => ["store " + k, v]);
    lat.push(["handler", s.latency.handler]);
    rows($("latency").tBodies[0], lat, ([k, v]) => [[k], [secs(v.p50)], [secs(v.p99)], [num(v.count)],
      [v.over === "window" ? "last " + rate.window_seconds + " s" : "lifetime", "opt"]], "", 5);
  }

  async function refresh() {
    try {
      const r = await fetch(base + "api/stats", { headers, cache: "no-store" });
      if (r.status === 401 || r.status === 403) { location.reload(); return; }
      if (!r.ok) throw new Error("HTTP " + r.status);
      render(await r.json());
      $("offline-note").hidden = true;
    } catch (e) {
      const note = $("offline-note");
      note.textContent = "Cannot reach the server (" + e.message + "); retrying.";
      note.hidden = false;
    }
  }

  // -- the key inspector --------------------------------------------------------------------
  function showRecord(parent, r) {
    const dl = el("dl", null, "record");
    const fields = [["key", r.key], ["operation", r.operation], ["scope", r.scope || "(none)"],
      ["status", r.status + (r.final ? " (final)" : "")], ["attempts", r.attempts],
      ["fingerprint", r.fingerprint], ["request id", r.request_id || "–"],
      ["created", r.created_at], ["updated", r.updated_at], ["completed", r.completed_at || "–"],
      ["lease until", r.lease_until], ["expires", r.expires_at], ["retention", r.retention]];
    for (const [k, v] of fields) dl.append(el("dt", k), el("dd", v));
    parent.append(dl);
    if (r.answer) {
      parent.append(el("div", "stored answer: " + (r.answer.status || "") + " " +
        (r.answer.media_type || "") + ", " + r.answer.bytes + " bytes", "sub"));
      if (r.answer.headers && r.answer.headers.length)
        parent.append(el("pre", r.answer.headers.map((h) => h[0] + ": " + h[1]).join("\n")));
      parent.append(el("pre", r.answer.body === null ? "(binary: " + r.answer.bytes + " bytes)" : r.answer.body));
    } else {
      parent.append(el("div", "no stored answer", "sub"));
    }
  }
  $("inspect").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const out = $("inspect-result");
    out.replaceChildren(el("div", "searching…", "sub"));
    const q = new URLSearchParams({ key: $("inspect-key").value });
    if ($("inspect-operation").value) q.set("operation", $("inspect-operation").value);
    if ($("inspect-scope").value) q.set("scope", $("inspect-scope").value);
    try {
      const r = await fetch(base + "api/records?" + q, { headers, cache: "no-store" });
      const doc = await r.json();
      out.replaceChildren();
      if (!r.ok) { out.append(el("div", doc.detail || ("HTTP " + r.status), "error")); return; }
      if (!doc.records.length) { out.append(el("div", "no record for this key", "empty")); return; }
      for (const rec of doc.records) { const box = el("div"); box.dataset.record = rec.key_hash; showRecord(box, rec); out.append(box); }
    } catch (e) {
      out.replaceChildren(el("div", "search failed: " + e.message, "error"));
    }
  });

  refresh();
  setInterval(refresh, 1000);
})();
