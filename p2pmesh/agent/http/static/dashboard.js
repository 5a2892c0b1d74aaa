// The p2pmesh dashboard (docs/dashboard.md). Reads the agent's live feed (GET /v1/events:
// server-sent events of its status and watch events) with fetch(), so the token can travel
// in the Authorization header as for the rest of the API; draws the cluster, the placement,
// the serving head's load and the event log; chats through /v1/chat/completions (stream).
// No framework and nothing from the network but this agent.
"use strict";

(() => {
  const TOKEN_KEY = "p2pmesh.http-token";
  const LOG_MAX = 200;          // event log lines kept
  const SPARK_POINTS = 60;      // tokens/s samples (one a second)
  const RETRY_MAX_MS = 5000;    // the feed reconnects with backoff up to this
  const SILENCE_MS = 40000;     // no message (not even a heartbeat, every 15 s) for this long: reconnect
  const CHAT_MAX_TOKENS = 256;
  const SVG_NS = "http://www.w3.org/2000/svg";
  const $ = (id) => document.getElementById(id);

  let current = null;           // the last status
  const tps = [];
  const chat = [];              // the conversation: {role, content}

  // ---------------------------------------------------------------------------------
  // Small helpers

  const short = (id) => (id ? String(id).slice(0, 8) : "–");
  const authHeaders = () => {
    const t = sessionStorage.getItem(TOKEN_KEY);
    return t ? { Authorization: "Bearer " + t } : {};
  };
  const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

  function gib(n) {
    if (n == null) return "?";
    if (n >= 2 ** 30) return (n / 2 ** 30).toFixed(n >= 10 * 2 ** 30 ? 0 : 1) + " GiB";
    if (n >= 2 ** 20) return (n / 2 ** 20).toFixed(n >= 10 * 2 ** 20 ? 0 : 1) + " MiB";
    return Math.max(0, Math.round(n / 2 ** 10)) + " KiB";
  }

  function h(tag, attrs = {}, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs)) {
      if (k === "class") e.className = v;
      else if (k === "style") e.style.cssText = v;
      else e.setAttribute(k, v);
    }
    for (const c of children) if (c != null) e.append(c);
    return e;
  }

  function s(tag, attrs = {}, ...children) {
    const e = document.createElementNS(SVG_NS, tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    for (const c of children) if (c != null) e.append(c);
    return e;
  }

  // Server-sent events from a fetch() response: each event's data, as text.
  async function* events(response, signal) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) return;
        buffer += decoder.decode(value, { stream: true });
        let end;
        while ((end = buffer.search(/\r?\n\r?\n/)) >= 0) {
          const block = buffer.slice(0, end);
          buffer = buffer.slice(end).replace(/^\r?\n\r?\n/, "");
          const data = block.split(/\r?\n/).filter((l) => l.startsWith("data:")).map((l) => l.slice(5).replace(/^ /, ""));
          if (data.length) yield data.join("\n");
        }
        if (signal && signal.aborted) return;
      }
    } finally {
      reader.cancel().catch(() => {});
    }
  }

  // ---------------------------------------------------------------------------------
  // The token (only when the agent asks for one)

  function askToken(why) {
    const form = $("token-form");
    form.hidden = false;
    form.querySelector("label").textContent = why;
    $("token").focus();
  }

  $("token-form").addEventListener("submit", (e) => {
    e.preventDefault();
    sessionStorage.setItem(TOKEN_KEY, $("token").value.trim());
    $("token").value = "";
    $("token-form").hidden = true;
    follow();
  });

  // ---------------------------------------------------------------------------------
  // The live feed

  let following = false;

  function setLink(text, kind) {
    const l = $("link");
    l.textContent = text;
    l.className = "pill " + (kind || "");
  }

  async function follow() {
    if (following) return;
    following = true;
    let delay = 500;
    try {
      for (;;) {
        const abort = new AbortController();
        let watchdog = setTimeout(() => abort.abort(), SILENCE_MS);
        try {
          const r = await fetch("/v1/events", { headers: authHeaders(), cache: "no-store", signal: abort.signal });
          if (r.status === 401) {
            setLink("token needed", "bad");
            askToken(sessionStorage.getItem(TOKEN_KEY) ? "Wrong token: this agent's API token" : "This agent wants its API token");
            return;
          }
          if (!r.ok) throw new Error("HTTP " + r.status);
          setLink("live", "ok");
          delay = 500;
          for await (const data of events(r, abort.signal)) {
            clearTimeout(watchdog);
            watchdog = setTimeout(() => abort.abort(), SILENCE_MS);
            handle(JSON.parse(data));
          }
        } catch (err) {
          // offline, the agent restarting, or silence: try again below
        } finally {
          clearTimeout(watchdog);
        }
        setLink("offline", "bad");
        await sleep(delay);
        delay = Math.min(delay * 2, RETRY_MAX_MS);
      }
    } finally {
      following = false;
    }
  }

  function handle(msg) {
    if (msg.type === "status") {
      if (current === null) log({ kind: "connected", detail: `connected to ${short(msg.status.node_id)} (${msg.status.role})` });
      current = msg.status;
      render(current);
    } else if (msg.type === "event") {
      log(msg);
    }
  }

  function log(ev) {
    const list = $("log");
    const t = new Date().toLocaleTimeString([], { hour12: false });
    list.prepend(h("li", { class: ev.kind, "data-kind": ev.kind }, h("time", {}, t), h("span", {}, ev.detail)));
    while (list.children.length > LOG_MAX) list.lastChild.remove();
  }

  // ---------------------------------------------------------------------------------
  // Drawing

  function render(st) {
    const cluster = st.cluster_id ? `cluster ${short(st.cluster_id)} · ` : "";
    $("cluster").textContent = `${cluster}this Mac ${short(st.node_id)} (${st.role}, term ${st.term})`;
    const health = $("health");
    health.textContent = st.healthy ? "healthy" : "no leader";
    health.className = "pill " + (st.healthy ? "ok" : "bad");
    drawTopology(st);
    drawPlacement(st);
    drawLoad(st);
  }

  function cablesBetween(members) {
    // Two ports cabled to each other: one's peer domain is the other's domain (Thunderbolt).
    const byDomain = new Map();
    for (const m of members) for (const p of m.ports || []) if (p.domain_uuid) byDomain.set(p.domain_uuid, [m.node_id, p]);
    const out = [];
    for (const m of members) {
      for (const p of m.ports || []) {
        const other = p.peer_domain_uuid && byDomain.get(p.peer_domain_uuid);
        if (other && m.node_id < other[0]) out.push({ a: m.node_id, b: other[0], kind: p.kind, gbps: p.gbps });
      }
    }
    return out;
  }

  function drawTopology(st) {
    const svg = $("topology");
    svg.replaceChildren();
    const members = st.members || [];
    const ring = st.ring || { order: [], hops: [] };
    $("ring-info").textContent = ring.epoch
      ? `ring epoch ${ring.epoch}` + (ring.bottleneck_gbps != null ? ` · bottleneck ${ring.bottleneck_gbps} Gb/s` : "")
      : "";
    if (!members.length) {
      svg.append(s("text", { x: 320, y: 210, "text-anchor": "middle", class: "empty" }, "not in a cluster yet"));
      return;
    }
    const inRing = new Set(ring.order);
    const order = [...ring.order.filter((n) => members.some((m) => m.node_id === n)),
      ...members.map((m) => m.node_id).filter((n) => !inRing.has(n)).sort()];
    const pos = new Map();
    const cx = 320, cy = 205, rx = members.length > 2 ? 215 : 170, ry = members.length > 2 ? 145 : 0;
    order.forEach((n, i) => {
      const a = -Math.PI / 2 + (2 * Math.PI * i) / order.length + (order.length === 2 ? Math.PI / 2 : 0);
      pos.set(n, order.length === 1 ? [cx, cy] : [cx + rx * Math.cos(a), cy + ry * Math.sin(a)]);
    });
    const up = new Map(members.map((m) => [m.node_id, m.up]));
    const edges = s("g", { class: "edges" });
    const labels = s("g", { class: "labels" });
    const ringPairs = new Set();
    for (const hop of ring.hops || []) {
      ringPairs.add([hop.from, hop.to].sort().join());
      edge(edges, labels, pos, hop.from, hop.to, "ring", up, hopLabel(hop), ring.order.length === 2 ? 20 : 0);
    }
    for (const c of cablesBetween(members)) {
      if (!ringPairs.has([c.a, c.b].sort().join())) edge(edges, labels, pos, c.a, c.b, "cable", up, hopLabel(c), 0);
    }
    svg.append(edges, labels);
    for (const m of members) svg.append(node(m, pos.get(m.node_id), st, inRing.has(m.node_id)));
  }

  function hopLabel(hop) {
    let t = hop.kind || "link";
    if (hop.gbps) t += ` · ${+Number(hop.gbps).toFixed(1)} Gb/s`;
    if (hop.rtt_ms != null) t += ` · ${Number(hop.rtt_ms).toFixed(2)} ms`;
    return t;
  }

  function edge(edges, labels, pos, a, b, kind, up, label, bend) {
    const p = pos.get(a), q = pos.get(b);
    if (!p || !q || a === b) return;
    const down = up.get(a) === false || up.get(b) === false;
    // Bend sideways (the two hops of a two-Mac ring, one each way, stay apart).
    const mx = (p[0] + q[0]) / 2, my = (p[1] + q[1]) / 2, dx = q[0] - p[0], dy = q[1] - p[1];
    const len = Math.hypot(dx, dy) || 1;
    const kx = mx - (dy / len) * bend * 2, ky = my + (dx / len) * bend * 2;
    edges.append(s("path", { d: `M${p[0]},${p[1]} Q${kx},${ky} ${q[0]},${q[1]}`, class: `edge ${kind}${down ? " down" : ""}`,
      "data-from": a, "data-to": b }));
    const lx = (p[0] + 2 * kx + q[0]) / 4, ly = (p[1] + 2 * ky + q[1]) / 4;
    labels.append(s("text", { x: lx, y: ly - 4, "text-anchor": "middle", class: "edge-label" }, label));
  }

  function node(m, at, st, inRing) {
    const leader = st.leader === m.node_id;
    const classes = ["node", m.up ? "up" : "down", inRing ? "in-ring" : "", leader ? "leader" : ""].join(" ");
    const g = s("g", { class: classes, transform: `translate(${at[0] - 80},${at[1] - 34})`, "data-node-id": m.node_id,
      "data-up": String(m.up), "data-in-ring": String(inRing) });
    const role = !m.up ? "down" : leader ? "★ leader" : m.voter ? "follower" : "learner";
    g.append(s("title", {}, `${m.node_id}\n${(m.addresses || []).join(", ")}`));
    g.append(s("rect", { width: 160, height: 68, rx: 10 }));
    g.append(s("text", { x: 12, y: 20, class: "name" }, short(m.node_id)));
    if (m.node_id === st.node_id) g.append(s("text", { x: 148, y: 20, "text-anchor": "end", class: "badge" }, "this Mac"));
    g.append(s("text", { x: 12, y: 39, class: "sub" }, `${m.chip || "?"} · ${gib(m.memory_bytes)}`));
    g.append(s("text", { x: 12, y: 58, class: leader ? "badge role" : "role" }, role));
    return g;
  }

  function drawPlacement(st) {
    const p = st.placement;
    const stagesBox = $("stages"), pendingBox = $("pending"), problem = $("problem");
    stagesBox.replaceChildren();
    pendingBox.replaceChildren();
    problem.hidden = true;
    if (!p || !p.model) {
      $("model").textContent = "no model (p2pmesh model set NAME)";
      return;
    }
    const serving = p.serving ? "serving" : "not serving";
    $("model").textContent = `${p.model} · epoch ${p.epoch} · ${serving} · batch ${p.batch}`;
    const members = new Map((st.members || []).map((m) => [m.node_id, m]));
    stagesBox.append(...stageRows(p.stages, members, p.layer_bytes));
    if (p.pending) {
      const pe = p.pending, holders = [...new Set(pe.stages.map((x) => x.node_id))];
      const fetched = holders.filter((n) => pe.fetched.includes(n)).length;
      const ready = holders.filter((n) => pe.ready.includes(n)).length;
      const done = (fetched + ready) / (2 * holders.length || 1);
      // Each Mac's copy or download of its files (status transfers: its latest report).
      const moving = new Map((st.transfers || []).map((t) => [t.node_id, t]));
      const files = (n) => {
        const t = moving.get(n);
        if (pe.fetched.includes(n)) return "✓ files";
        if (!t) return "… files";
        const left = t.eta_s === null ? "" : ` · ${Math.round(t.eta_s)} s left`;
        return `… files ${mb(t.bytes_done)}/${mb(t.bytes_total)} MB from ${t.source === "hub" ? "the hub" : "peers"}` +
          ` · ${t.mb_s} MB/s${left}`;
      };
      pendingBox.append(h("div", { class: "group-title" },
        `moving to epoch ${pe.epoch}: ${fetched}/${holders.length} fetched, ${ready}/${holders.length} ready`),
        h("div", { class: "bar-track" }, h("div", { class: "bar-fill", style: `left:0;width:${(done * 100).toFixed(1)}%` })),
        h("div", { class: "progress" }, h("ul", {}, ...holders.map((n) => h("li", {},
          h("span", { class: "mono" }, short(n)), " ",
          h("span", { class: pe.fetched.includes(n) ? "tick" : "wait" }, files(n)), " ",
          h("span", { class: pe.ready.includes(n) ? "tick" : "wait" }, pe.ready.includes(n) ? "✓ loaded" : "… loading"))))),
        ...stageRows(pe.stages, members, p.layer_bytes));
    }
    if (p.problem) {
      problem.hidden = false;
      problem.textContent = p.problem.message;
    }
  }

  function mb(bytes) {
    return (bytes / 1e6).toFixed(1);
  }

  function stageRows(stages, members, layerBytes) {
    const total = Math.max(1, ...stages.map((x) => x.layers[1]));
    // Stages over the same layers are one tensor group (its members split each layer).
    const groups = [];
    for (const x of stages) {
      const last = groups[groups.length - 1];
      if (last && last.layers[0] === x.layers[0] && last.layers[1] === x.layers[1]) last.members.push(x.node_id);
      else groups.push({ layers: x.layers, members: [x.node_id] });
    }
    return groups.map((g) => {
      const [a, b] = g.layers, n = b - a;
      const box = h("div", { class: g.members.length > 1 ? "group" : "" });
      if (g.members.length > 1) box.append(h("div", { class: "group-title" }, `tensor group of ${g.members.length}`));
      for (const id of g.members) {
        const m = members.get(id) || {};
        // The layers' weights (a tensor group's members each hold their share) against what
        // the Mac offers the model (its measurement; its whole memory before it measured).
        const used = layerBytes != null ? (n * layerBytes) / g.members.length : null;
        const room = m.offer_bytes != null ? m.offer_bytes : m.memory_bytes;
        const frac = used != null && room ? Math.min(1, used / room) : null;
        const row = h("div", { class: "stage" + (m.up === false ? " down" : ""), "data-node-id": id },
          h("span", { class: "who" }, short(id)),
          h("span", { class: "what" }, `layers ${a}–${b - 1} (${n})` + (m.chip ? ` · ${m.chip}` : "")),
          h("span", { class: "what" }, "layers"),
          h("div", { class: "bar-track" }, h("div", { class: "bar-fill", style: `left:${(a / total) * 100}%;width:${(n / total) * 100}%` })));
        if (frac != null) {
          row.append(h("span", { class: "what" }, "memory"),
            h("div", { class: "bar-track", title: `weights ${gib(used)} of ${gib(room)} offered` },
              h("div", { class: "bar-fill mem" + (frac > 0.9 ? " full" : ""), style: `left:0;width:${(frac * 100).toFixed(1)}%` })),
            h("span", {}), h("span", { class: "what" }, `${gib(used)} weights, ${gib(room - used)} free`));
        }
        box.append(row);
      }
      return box;
    });
  }

  function drawLoad(st) {
    const r = st.requests;
    $("tps").textContent = r ? (+r.tokens_per_s).toFixed(1) : "–";
    $("active").textContent = r ? r.active : "–";
    $("queued").textContent = r ? r.queued : "–";
    const p = st.placement;
    $("load-info").textContent = r
      ? `head ${short(r.head)} · epoch ${r.epoch}` + (p ? ` · batch ${p.batch} of ${p.batch_asked} asked · ${p.restarts} restarts` : "")
      : "nothing serving (or the head has not reported yet)";
  }

  function sample() {
    const r = current && current.requests;
    tps.push(r ? +r.tokens_per_s : 0);
    while (tps.length > SPARK_POINTS) tps.shift();
    const max = Math.max(1, ...tps), step = 300 / (SPARK_POINTS - 1), x0 = 300 - step * (tps.length - 1);
    const pts = tps.map((v, i) => `${(x0 + i * step).toFixed(1)},${(46 - (v / max) * 42).toFixed(1)}`);
    const spark = $("spark");
    spark.replaceChildren();
    if (pts.length > 1) {
      spark.append(s("polygon", { class: "area", points: `${x0},48 ${pts.join(" ")} 300,48` }));
      spark.append(s("polyline", { points: pts.join(" ") }));
    }
  }

  // ---------------------------------------------------------------------------------
  // Chat: the agent's own /v1/chat/completions, streamed

  let chatAbort = null;

  function bubble(role, text) {
    const b = h("div", { class: "msg " + role }, text);
    $("chat-log").append(b);
    $("chat-log").scrollTop = $("chat-log").scrollHeight;
    return b;
  }

  async function send(text) {
    chat.push({ role: "user", content: text });
    bubble("user", text);
    const out = bubble("assistant", "");
    out.classList.add("streaming");
    chatAbort = new AbortController();
    $("chat-send").disabled = true;
    $("chat-stop").hidden = false;
    $("chat-state").textContent = "generating…";
    let reply = "";
    try {
      const r = await fetch("/v1/chat/completions", {
        method: "POST", signal: chatAbort.signal,
        headers: { "Content-Type": "application/json", ...authHeaders() },
        body: JSON.stringify({ model: (current && current.placement && current.placement.model) || "any",
          messages: chat, stream: true, max_tokens: CHAT_MAX_TOKENS }),
      });
      if (!r.ok) {
        const body = await r.json().catch(() => ({}));
        if (r.status === 401) askToken("This agent wants its API token");
        throw new Error((body.error && body.error.message) || "HTTP " + r.status);
      }
      for await (const data of events(r)) {
        if (data === "[DONE]") break;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
        if (delta && delta.content) {
          reply += delta.content;
          out.textContent = reply;
          $("chat-log").scrollTop = $("chat-log").scrollHeight;
        }
      }
      chat.push({ role: "assistant", content: reply });
      out.dataset.done = "true";
    } catch (err) {
      if (reply) chat.push({ role: "assistant", content: reply });
      else chat.pop(); // the question got no answer: it is not part of the conversation
      if (err.name !== "AbortError") bubble("error", String(err.message || err));
      out.dataset.done = "true";
    } finally {
      out.classList.remove("streaming");
      chatAbort = null;
      $("chat-send").disabled = false;
      $("chat-stop").hidden = true;
      $("chat-state").textContent = "";
    }
  }

  $("chat-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("chat-input").value.trim();
    if (!text || chatAbort) return;
    $("chat-input").value = "";
    send(text);
  });
  $("chat-input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) {
      e.preventDefault();
      $("chat-form").requestSubmit();
    }
  });
  $("chat-stop").addEventListener("click", () => chatAbort && chatAbort.abort());

  setInterval(sample, 1000);
  follow();
})();
