// The fenced page: resources, holders, epochs and one timeline per resource, drawn from the
// server's event stream (/v1/events) and kept live. Plain JavaScript, no build step.
//
// The stream is read with fetch(), not EventSource, so that the API key (asked for when the
// server answers 401/403, kept in this tab's sessionStorage) travels in the Authorization
// header. After a dropped connection the page reconnects with Last-Event-ID: no change is lost.
"use strict";

(() => {
  const KEY = "fenced.key";
  const SVG = "http://www.w3.org/2000/svg";
  const prefix = new URLSearchParams(location.search).get("prefix") || "";
  const resources = new Map(); // name -> {name, epochs: [{epoch, holder, start, end, how}], rejected, seen}
  let lastId = null;
  let retry = 1000;
  let latest = 0; // the newest record time seen (server clock)
  let pending = false;

  const $ = (id) => document.getElementById(id);

  function status(state, text) {
    const el = $("status");
    el.dataset.state = state;
    el.textContent = text;
  }

  function resource(name, at) {
    let r = resources.get(name);
    if (!r) {
      r = { name, epochs: [], rejected: [], seen: new Set(), first: at };
      resources.set(name, r);
    }
    return r;
  }

  function end(r, epoch, at, how) {
    for (const e of r.epochs) {
      if (e.end === null && (epoch === null || e.epoch === epoch)) {
        e.end = at;
        e.how = how;
      }
    }
  }

  function apply(kind, d) {
    if (typeof d.resource !== "string") return;
    latest = Math.max(latest, d.at || 0);
    const r = resource(d.resource, d.at);
    switch (kind) {
      case "granted":
        end(r, null, d.at, "superseded");
        r.epochs.push({ epoch: d.epoch, holder: d.holder || "", start: d.at, end: null, how: null });
        break;
      case "released":
      case "expired":
        end(r, d.epoch, d.at, kind);
        break;
      case "restored":
        end(r, null, d.at, kind);
        break;
      case "rejected": {
        const id = `${d.store}/${d.seq}`;
        if (!r.seen.has(id)) {
          r.seen.add(id);
          r.rejected.push({ at: d.at, epoch: d.epoch, store: d.store, detail: d.detail || {} });
        }
        break;
      }
      default: // renewal-failed, lost, proclaimed: no change of owner
        break;
    }
    schedule();
  }

  function schedule() {
    if (!pending) {
      pending = true;
      setTimeout(render, 16);
    }
  }

  function now() {
    return Math.max(Date.now() / 1000, latest);
  }

  function el(name, attrs, text) {
    const node = document.createElementNS(SVG, name);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
    if (text !== undefined) {
      const title = document.createElementNS(SVG, "title");
      title.textContent = text;
      node.appendChild(title);
    }
    return node;
  }

  function colour(holder) {
    let h = 0;
    for (const c of holder) h = (h * 31 + c.charCodeAt(0)) >>> 0;
    return `hsl(${h % 360}, 55%, 45%)`;
  }

  function timeline(r, t0, t1) {
    const W = 1000;
    const H = 26;
    const x = (t) => ((t - t0) / Math.max(t1 - t0, 1e-3)) * W;
    const svg = el("svg", { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none", role: "img" });
    let free = r.first;
    for (const e of r.epochs) {
      if (e.start > free) {
        svg.appendChild(el("rect", { class: "gap", x: x(free), y: 4, width: Math.max(x(e.start) - x(free), 1), height: H - 8 },
          `no owner for ${(e.start - free).toFixed(2)} s`));
      }
      const stop = e.end === null ? t1 : e.end;
      svg.appendChild(el("rect", {
        class: "epoch", "data-epoch": e.epoch, "data-holder": e.holder, "data-live": e.end === null,
        x: x(e.start), y: 2, width: Math.max(x(stop) - x(e.start), 2), height: H - 4, fill: colour(e.holder),
      }, `epoch ${e.epoch}: ${e.holder} (${e.end === null ? "holds it" : e.how})`));
      free = Math.max(free, stop);
    }
    const last = r.epochs[r.epochs.length - 1];
    if (last && last.end !== null && t1 > free) {
      svg.appendChild(el("rect", { class: "gap", x: x(free), y: 4, width: Math.max(x(t1) - x(free), 1), height: H - 8 },
        `no owner since ${new Date(free * 1000).toLocaleTimeString()}`));
    }
    for (const m of r.rejected) {
      svg.appendChild(el("rect", { class: "rejected", "data-epoch": m.epoch, x: x(m.at) - 2, y: 0, width: 4, height: H },
        `rejected stale write at ${m.store}: epoch ${m.epoch}` +
        (m.detail.reason ? ` (${m.detail.reason}, floor ${m.detail.floor})` : "")));
    }
    return svg;
  }

  function render() {
    pending = false;
    const names = [...resources.keys()].sort();
    $("empty").hidden = names.length > 0;
    $("resources").hidden = names.length === 0;
    let t0 = Infinity;
    for (const r of resources.values()) t0 = Math.min(t0, r.first);
    const t1 = now();
    const body = $("resources").tBodies[0];
    const rows = [];
    for (const name of names) {
      const r = resources.get(name);
      const last = r.epochs[r.epochs.length - 1];
      const held = last !== undefined && last.end === null;
      const tr = document.createElement("tr");
      tr.dataset.resource = name;
      tr.dataset.state = held ? "held" : "free";
      tr.dataset.holder = held ? last.holder : "";
      tr.dataset.epoch = last ? String(last.epoch) : "";
      tr.dataset.rejected = String(r.rejected.length);
      const cells = [
        ["resource", name],
        ["holder", held ? last.holder : "—"],
        ["epoch", last ? String(last.epoch) : "—"],
        ["state", held ? "held" : last ? `free (${last.how})` : "free"],
      ];
      for (const [cls, text] of cells) {
        const td = document.createElement("td");
        td.className = cls;
        td.textContent = text;
        tr.appendChild(td);
      }
      const td = document.createElement("td");
      td.className = "timeline";
      td.appendChild(timeline(r, t0, t1));
      tr.appendChild(td);
      rows.push(tr);
    }
    body.replaceChildren(...rows);
  }

  function askKey(message) {
    status("key", "a key is needed");
    $("key-form").hidden = false;
    $("key-message").textContent = message;
    $("key").focus();
  }

  function dispatch(block) {
    let kind = "message";
    let data = "";
    for (const line of block.split("\n")) {
      if (line.startsWith(":")) continue;
      const i = line.indexOf(":");
      const field = i < 0 ? line : line.slice(0, i);
      const value = i < 0 ? "" : line.slice(i + 1).replace(/^ /, "");
      if (field === "event") kind = value;
      else if (field === "data") data += (data ? "\n" : "") + value;
      else if (field === "id") lastId = value;
      else if (field === "retry" && /^\d+$/.test(value)) retry = Number(value);
    }
    if (!data) return;
    if (kind === "ready") {
      status("live", "live");
      schedule();
      return;
    }
    apply(kind, JSON.parse(data));
  }

  async function connect() {
    const headers = { Accept: "text/event-stream" };
    const key = sessionStorage.getItem(KEY);
    if (key) headers.Authorization = `Bearer ${key}`;
    if (lastId !== null) headers["Last-Event-ID"] = lastId;
    try {
      const response = await fetch(`/v1/events?prefix=${encodeURIComponent(prefix)}`, { headers, cache: "no-store" });
      if (response.status === 401 || response.status === 403) {
        askKey(response.status === 401 ? "this server needs an API key (role read)" : "this key may not read these resources");
        return;
      }
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      $("key-form").hidden = true;
      const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += value.replace(/\r\n?/g, "\n");
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          dispatch(buffer.slice(0, cut));
          buffer = buffer.slice(cut + 2);
        }
      }
      status("error", "disconnected: reconnecting…");
    } catch (error) {
      status("error", `disconnected (${error.message}): reconnecting…`);
    }
    setTimeout(connect, retry);
  }

  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(KEY, $("key").value.trim());
    $("key").value = "";
    status("connecting", "connecting…");
    connect();
  });
  setInterval(schedule, 1000); // live bars grow with time
  connect();
})();
