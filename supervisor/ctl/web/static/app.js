// The sessiond console's page.  Everything a session produces (model output,
// tool arguments and results, session ids, error messages) reaches the
// document through textContent or setAttribute only, never as markup: a
// reply that contains <script> shows as that text.
"use strict";
(() => {
  const token = new URLSearchParams(location.search).get("token") || "";
  const tokenQuery = "?token=" + encodeURIComponent(token);
  const $ = (id) => document.getElementById(id);
  const NOTABLE_STATES = new Set(["crashed", "restarting", "failed", "stopped", "hibernated", "damaged", "deleted"]);

  function el(tag, cls, text) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  function bytes(n) {
    if (n === null || n === undefined) return "–";
    if (n < 1024 * 1024) return (n / 1024).toFixed(0) + " KiB";
    if (n < 1024 * 1024 * 1024) return (n / 1048576).toFixed(1) + " MiB";
    return (n / 1073741824).toFixed(2) + " GiB";
  }

  function count(n) {
    if (!n) return "0";
    return n >= 10000 ? (n / 1000).toFixed(0) + "k" : n >= 1000 ? (n / 1000).toFixed(1) + "k" : String(n);
  }

  function plural(n, word) { return n + " " + word + (n === 1 ? "" : "s"); }

  function tokens(usage) {
    if (!usage || (!usage.prompt_tokens && !usage.completion_tokens)) return "–";
    return "in " + count(usage.prompt_tokens) + " · out " + count(usage.completion_tokens);
  }

  function clock(at) {
    return at ? new Date(at * 1000).toLocaleTimeString() : "";
  }

  function json(value) {
    try { return JSON.stringify(value, null, 2); } catch (e) { return String(value); }
  }

  function oneLine(text, limit) {
    const line = String(text).replace(/\s+/g, " ").trim();
    return line.length > limit ? line.slice(0, limit - 1) + "…" : line;
  }

  async function post(sid, action, body) {
    const response = await fetch("/api/sessions/" + encodeURIComponent(sid) + "/" + action, {
      method: "POST",
      headers: {"Content-Type": "application/json", "X-Sessiond-Token": token},
      body: JSON.stringify(body || {}),
      cache: "no-store",
    });
    let data = {};
    try { data = await response.json(); } catch (e) { data = {ok: false, message: response.statusText}; }
    if (!response.ok || !data.ok) {
      const err = new Error(data.message || ("HTTP " + response.status));
      err.status = response.status;
      throw err;
    }
    return data;
  }

  // ------------------------------------------------------------ the banner

  let bannerTimer = null;
  function banner(text, kind, hideAfterMs) {
    const node = $("banner");
    clearTimeout(bannerTimer);
    node.textContent = text;
    node.className = "banner " + kind;
    node.hidden = false;
    if (hideAfterMs) bannerTimer = setTimeout(() => { node.hidden = true; }, hideAfterMs);
  }

  function onDaemon(ev) {
    if (ev.up) {
      $("daemon").textContent = "sessiond " + ev.version + " · pid " + ev.pid;
      $("daemon").className = "daemon up";
      if (ev.reconnected) banner("reconnected to sessiond (pid " + ev.pid + ")", "ok", 5000);
      else if (!$("banner").classList.contains("ok")) $("banner").hidden = true;
    } else {
      $("daemon").textContent = "sessiond unreachable";
      $("daemon").className = "daemon down";
      banner("cannot reach sessiond (" + ev.message + "): reconnecting…", "down");
    }
  }

  // ------------------------------------------------------------ the list

  let sessions = [];
  let selected = null;

  // Rows are kept and updated in place: the list changes several times a
  // second (memory figures), and a row replaced under the pointer would
  // swallow the click that was meant for it.
  const rowsById = new Map();

  function renderList() {
    const body = $("session-rows");
    const byId = new Map(sessions.map((s) => [s.id, s]));
    const order = [];
    const walk = (s, depth) => {
      order.push(rowFor(s, depth));
      for (const child of s.children || []) if (byId.has(child)) walk(byId.get(child), depth + 1);
    };
    for (const s of sessions) if (!s.parent || !byId.has(s.parent)) walk(s, 0);
    for (const id of [...rowsById.keys()]) if (!byId.has(id)) rowsById.delete(id);
    const current = [...body.children];
    if (current.length !== order.length || current.some((tr, i) => tr !== order[i])) body.replaceChildren(...order);
    $("no-sessions").hidden = sessions.length > 0;
    if (selected && byId.has(selected)) showFacts(byId.get(selected));
    // Sessions whose turn waits on a person: counted in the title, so that
    // a tab in the background says it too.
    const waiting = sessions.filter((s) => (s.waiting || []).length).length;
    document.title = (waiting ? "(" + waiting + " waiting) " : "") + "sessiond console";
  }

  function rowFor(s, depth) {
    let r = rowsById.get(s.id);
    if (!r) {
      const tr = el("tr");
      tr.setAttribute("data-session", s.id);
      tr.addEventListener("click", () => select(s.id));
      const name = el("td", "id");
      name.title = s.id;
      const tree = el("span", "tree");
      name.append(tree, el("span", "", s.id), el("span", "muted handler", " " + (s.handler || "")));
      const badge = el("span");
      const waits = el("span", "state state-waiting", "waiting");
      const state = el("td");
      state.append(badge, " ", waits);
      const memory = el("td", "num"), turns = el("td", "num"), used = el("td", "num"), restarts = el("td", "num");
      used.title = "tokens the session's turns used (prompt · completion)";
      tr.append(name, state, memory, turns, used, restarts);
      r = {tr, name, tree, badge, waits, state, memory, turns, used, restarts};
      rowsById.set(s.id, r);
    }
    r.tr.classList.toggle("selected", s.id === selected);
    r.name.style.paddingLeft = (0.5 + depth * 1.2) + "em";
    r.tree.textContent = depth ? "└ " : "";
    r.badge.textContent = s.state;
    r.badge.className = "state state-" + s.state;
    const waiting = s.waiting || [];
    r.waits.hidden = !waiting.length;
    r.tr.classList.toggle("waiting", waiting.length > 0);
    r.state.title = s.error || waiting.map((w) => "waiting on you since " + clock(w.since) + ": " + w.tool +
                                                    " (request " + w.request_id + ")").join("\n");
    r.memory.textContent = bytes(s.rss_bytes);
    r.turns.textContent = String(s.turns);
    r.used.textContent = tokens(s.usage);
    r.restarts.textContent = String(s.restarts);
    return r.tr;
  }

  function showFacts(s) {
    const state = $("view-state");
    state.textContent = s.state;
    state.className = "state state-" + s.state;
    const facts = [bytes(s.rss_bytes), plural(s.turns, "turn"), tokens(s.usage) + " tokens", plural(s.restarts, "restart")];
    if (s.parent) facts.push("sub-agent of " + s.parent);
    if (s.error) facts.push(s.error);
    $("view-facts").textContent = facts.join(" · ");
  }

  function openList() {
    const source = new EventSource("/api/events" + tokenQuery);
    source.onopen = () => { if ($("banner").classList.contains("console")) $("banner").hidden = true; };
    source.onmessage = (message) => {
      const ev = JSON.parse(message.data);
      if (ev.type === "sessions") { sessions = ev.sessions; renderList(); }
      else if (ev.type === "daemon") onDaemon(ev);
    };
    source.onerror = () => {
      if (source.readyState === EventSource.CLOSED) banner("the console refused this page (wrong token?)", "down console");
      else banner("the console (sessionctl web) is not answering: retrying…", "down console");
    };
  }

  // ------------------------------------------------------------ one session

  let view = null;  // {source, turns: Map<turn, {...}>}

  function select(sid) {
    if (view) view.source.close();
    selected = sid;
    for (const tr of document.querySelectorAll("#session-rows tr")) {
      tr.classList.toggle("selected", tr.getAttribute("data-session") === sid);
    }
    $("view").hidden = false;
    $("view-title").textContent = sid;
    $("action-error").textContent = "";
    $("conversation").replaceChildren();
    const s = sessions.find((x) => x.id === sid);
    if (s) showFacts(s);
    const source = new EventSource("/api/sessions/" + encodeURIComponent(sid) + "/events" + tokenQuery);
    view = {source, sid, turns: new Map(), asks: new Map()};
    showWaiting();
    const mine = view;
    source.onmessage = (message) => { if (view === mine) onViewEvent(JSON.parse(message.data)); };
  }

  function conversation() { return $("conversation"); }

  function stickToBottom(fn) {
    const box = conversation();
    const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
    fn();
    if (atBottom) box.scrollTop = box.scrollHeight;
  }

  function turnBox(turn, input) {
    let t = view.turns.get(turn);
    if (!t) {
      const node = el("div", "turn");
      node.setAttribute("data-turn", String(turn));
      const head = el("div", "input");
      head.append(el("span", "who", "turn " + turn));
      const text = el("div", "text");
      head.append(text);
      const reply = el("div", "reply");
      const end = el("div", "end");
      node.append(head, reply, end);
      t = {node, inputText: text, reply, end, say: null, streamed: "", asks: [], results: new Set()};
      view.turns.set(turn, t);
      conversation().append(node);
    }
    if (input !== undefined && input !== null) {
      t.inputText.textContent = input;
      t.inputText.classList.remove("muted");
    } else if (!t.inputText.textContent) {
      t.inputText.textContent = "(input sent by another client)";
      t.inputText.classList.add("muted");
    }
    return t;
  }

  function say(t, text) {
    t.streamed += text;
    if (!t.say) { t.say = el("div", "say"); t.reply.append(t.say); }
    // A paragraph starts with its text: the blank lines that part it from
    // the text before it (a tool call between) are the paragraph break.
    if (!t.say.textContent) text = text.replace(/^\n+/, "");
    t.say.textContent += text;
  }

  // The turn that is running now (its end not come): where a crash, a
  // restart or a limit hit is marked, in place, not after the turn.
  function openTurn() {
    let last = null;
    for (const t of view.turns.values()) last = t;
    return last && !last.node.classList.contains("ended") ? last : null;
  }

  function folded(summary, body, cls) {
    const details = el("details", cls);
    details.append(el("summary", "", summary), el("pre", "", body));
    return details;
  }

  function toolCall(t, data) {
    t.say = null;  // text after a tool call starts a new paragraph
    const args = typeof data.arguments === "string" ? data.arguments : json(data.arguments);
    const node = folded("⚙ " + data.name + " " + oneLine(args, 100), args, "tool call");
    t.reply.append(node);
  }

  function toolResult(t, data) {
    // A resumed turn sends again the results of tools that ran before its
    // worker died: shown once (a page that missed them shows them as they were).
    if (data.replayed && t.results.has(data.id)) return;
    t.results.add(data.id);
    t.say = null;
    const output = String(data.output === undefined ? "" : data.output);
    const first = oneLine(output.split("\n")[0] || "", 100);
    // No outcome said (a turn stored before outcomes were): unknown, never "ok".
    const status = data.ok === true ? "ok" : data.ok === false ? "failed" : "unknown";
    const node = folded("↳ " + (data.name || "result") + " " + (status === "unknown" ? "(outcome unknown)" : status) +
                        ": " + first + (data.truncated ? " (cut)" : ""), output, "tool result " + status);
    if (data.replayed) node.title = "ran before the turn's worker died";
    t.reply.append(node);
    // The request for this tool, if one was waiting, has been answered.
    const ask = t.asks.find((a) => a.pending && a.tool === data.name);
    if (ask) settle(ask, "answered");
  }

  // In turn `t` (where it happened) when given, else between turns.
  function marker(text, cls, t) {
    const node = el("div", "marker " + (cls || ""), text);
    if (t) { t.say = null; t.reply.append(node); } else conversation().append(node);
    return node;
  }

  function stateMarker(ev, at, t) {
    if (!NOTABLE_STATES.has(ev.new)) return;
    const text = (at ? clock(at) + "  " : "") + ev.old + " → " + ev.new + (ev.reason ? ": " + ev.reason : "");
    marker(text, ev.new === "restarting" || ev.new === "crashed" ? "restart" : "state", t);
  }

  // As sessionctl says it (ipc.contract.limit_text): past the limit, or at it.
  const UNITS = {memory: "MiB", memory_high: "MiB", disk: "MiB", turn_timeout: "s", heartbeat: "s",
                 restarts: "restarts", turns: "model calls", tool_calls: "tool calls", processes: "processes"};
  const COUNTED = new Set(["restarts", "turns", "tool_calls", "processes"]);
  const ONE = {restarts: "restart", "model calls": "model call", "tool calls": "tool call", processes: "process"};

  function limitText(ev) {
    if (ev.ceiling) return ev.ceiling + " = " + ev.limit + " " + ev.unit + ": " + ev.value + " " + ev.unit + " spent";
    const unit = UNITS[ev.kind] || "";
    const shown = COUNTED.has(ev.kind) ? ev.value.toFixed(0) : ev.value.toFixed(1);
    if (Number(shown) > ev.limit) return shown + (COUNTED.has(ev.kind) ? "" : " " + unit) + " > " + ev.limit + " " + unit;
    return ev.limit + " " + (ev.limit === 1 && ONE[unit] ? ONE[unit] : unit) + " reached";
  }

  function limitMarker(ev, at, t) {
    marker((at ? clock(at) + "  " : "") + "limit " + ev.kind + ": " + limitText(ev).trim(), "limit", t);
  }

  function permission(t, ev, live) {
    if (view.asks.has(ev.request_id)) return;  // (sent again to a client that attaches)
    const card = el("div", "ask");
    card.setAttribute("data-request", ev.request_id);
    const title = el("div", "ask-title", "permission request: ");
    title.append(el("code", "", ev.tool));
    const args = el("pre", "args", json(ev.arguments));
    const allow = el("button", "allow", "allow");
    const deny = el("button", "deny", "deny");
    allow.type = deny.type = "button";
    const status = el("span", "ask-status");
    const buttons = el("div", "ask-buttons");
    buttons.append(allow, deny, status);
    card.append(title, args, buttons);
    const ask = {card, tool: ev.tool, pending: true, status, buttons: [allow, deny], since: Date.now() / 1000};
    t.asks.push(ask);
    view.asks.set(ev.request_id, ask);
    t.reply.append(card);
    t.say = null;
    if (live) {
      showWaiting();
      card.scrollIntoView({block: "nearest"});  // a request nobody sees is an agent that looks hung
    }
    const answer = async (yes) => {
      for (const b of ask.buttons) b.disabled = true;
      status.textContent = yes ? "allowing…" : "denying…";
      try {
        await post(view.sid, "answer", {request_id: ev.request_id, allow: yes});
        settle(ask, yes ? "allowed" : "denied");
      } catch (err) {
        if (err.status === 404) settle(ask, "no longer pending: " + err.message);
        else { status.textContent = err.message; for (const b of ask.buttons) b.disabled = false; }
      }
    };
    allow.addEventListener("click", () => answer(true));
    deny.addEventListener("click", () => answer(false));
  }

  function settle(ask, text) {
    if (!ask.pending) return;
    ask.pending = false;
    for (const b of ask.buttons) b.disabled = true;
    ask.status.textContent = text;
    ask.card.classList.add("settled");
    if (view) showWaiting();
  }

  // Who answered, and when (a `permission_answered` notice): on this page
  // or elsewhere (sessionctl approve), live or read back.
  function answered(data) {
    const ask = view.asks.get(data.request_id);
    if (!ask) return;
    const text = (data.allowed ? "allowed" : "denied") + " by uid " + data.uid +
                 (data.client ? " (" + data.client + ")" : "") + (data.at ? " at " + clock(data.at) : "");
    settle(ask, text);
    ask.status.textContent = text;  // (also over this page's own "allowed")
  }

  // The requests this view waits on, above the conversation: in view
  // however far the conversation is scrolled.
  function showWaiting() {
    const bar = $("waiting");
    const pending = view ? [...view.asks.entries()].filter(([, a]) => a.pending) : [];
    bar.hidden = !pending.length;
    const items = pending.map(([rid, a]) => {
      const go = el("button", "link", a.tool + " (request " + rid + ")");
      go.type = "button";
      go.title = "show the request";
      go.addEventListener("click", () => a.card.scrollIntoView({block: "center"}));
      return go;
    });
    bar.replaceChildren(el("span", "", "waiting on you: "), ...items);
  }

  function endTurn(t, ev) {
    if (ev.type === "turn_done") {
      // The reply, unless the page has shown it (whitespace aside: stored
      // turns give each response's text apart).
      const reply = ev.reply || "";
      const squash = (x) => x.replace(/\s+/g, "");
      if (reply && !squash(t.streamed).startsWith(squash(reply))) {
        if (reply.startsWith(t.streamed)) say(t, reply.slice(t.streamed.length));
        else { t.say = null; say(t, reply); }
      }
      const how = [ev.interrupted ? "interrupted" : "done"];
      if (ev.stop_reason) how.push(ev.stop_reason + (ev.stop_detail ? " (" + ev.stop_detail + ")" : ""));
      if (ev.usage && (ev.usage.prompt_tokens || ev.usage.completion_tokens)) how.push(tokens(ev.usage) + " tokens");
      t.end.textContent = how.join(" · ");
      t.end.className = "end " + (ev.interrupted || ev.stop_reason ? "warn" : "ok");
    } else {
      t.end.textContent = "failed: " + ev.reason;
      t.end.className = "end failed";
    }
    t.node.classList.add("ended");
    for (const ask of t.asks) settle(ask, "no longer pending (the turn ended)");
  }

  function renderSnapshot(ev) {
    conversation().replaceChildren();
    view.turns = new Map();
    view.asks = new Map();
    const h = ev.history;
    const hidden = h.turns.length ? h.turns[0].turn - 1 : (h.earlier_turns || 0) + (h.omitted_turns || 0);
    if (hidden) marker(hidden + " earlier turn(s) not shown (sessionctl history " + ev.session + " has them)", "state");
    // The kept lifecycle events' times, by seq: a turn's own (a crash in
    // it) are among its events, in place; the others go between turns.
    const atBySeq = new Map(ev.logs.map((entry) => [entry.event.seq, entry.at]));
    const inTurns = new Set();
    for (const turn of h.turns) for (const e of turn.events || []) if (e.seq) inTurns.add(e.seq);
    // Turns and the other kept lifecycle events in time order.
    const items = [];
    let lastAt = 0;
    h.turns.forEach((turn, i) => { lastAt = turn.at || lastAt; items.push([lastAt, 1, i, () => historyTurn(turn, atBySeq)]); });
    ev.logs.forEach((entry, i) => {
      const e = entry.event;
      if (inTurns.has(e.seq)) return;
      if (e.type === "state") items.push([entry.at, 0, i, () => stateMarker(e, entry.at)]);
      else if (e.type === "limit") items.push([entry.at, 0, i, () => limitMarker(e, entry.at)]);
    });
    items.sort((a, b) => a[0] - b[0] || a[1] - b[1] || a[2] - b[2]);
    for (const item of items) item[3]();
    showWaiting();
    const box = conversation();
    box.scrollTop = box.scrollHeight;
  }

  // A stored turn: its events, as the daemon tells them (the same the page
  // got live), through the same code as live events.
  function historyTurn(turn, atBySeq) {
    const t = turnBox(turn.turn, turn.input);
    if (turn.at) t.node.title = "input at " + clock(turn.at);
    if (turn.outcome === "open") return;  // running: its events follow, live
    if (turn.events && turn.events.length) {
      for (const e of turn.events) show(e, atBySeq.get(e.seq), t, false);
    } else {  // (a daemon older than stored events)
      const results = turn.tool_results || [];
      (turn.tool_calls || []).forEach((call, i) => {
        toolCall(t, {name: call.name, arguments: call.arguments});
        if (results[i]) toolResult(t, {name: results[i].name || call.name, output: results[i].output, ok: results[i].ok});
      });
    }
    if (turn.outcome === "aborted") {
      if (turn.reply && !t.streamed) say(t, turn.reply);
      endTurn(t, {type: "turn_failed", reason: turn.reason || "aborted"});
    } else {
      endTurn(t, {type: "turn_done", reply: turn.reply, interrupted: turn.interrupted, usage: turn.usage});
    }
  }

  // One event of a session, live (`t` null: its turn by its number, a
  // marker in the running turn) or read back (`t`: the stored turn).
  function show(ev, at, t, live) {
    switch (ev.type) {
      case "text": say(t || turnBox(ev.turn), ev.text); break;
      case "notice": {
        const turn = t || turnBox(ev.turn);
        const d = ev.data || {};
        if (ev.kind === "tool_call") toolCall(turn, d);
        else if (ev.kind === "tool_result") toolResult(turn, d);
        else if (ev.kind === "permission_answered") answered(d);
        else if (ev.kind === "turn_resumed") {  // its worker died; the same turn goes on
          marker("turn resumed at step " + d.step + " after " + d.reason + ": " + d.cause, "restart", turn);
        } else { turn.say = null; turn.reply.append(folded("• " + ev.kind, json(ev.data), "notice")); }
        break;
      }
      case "permission_request": permission(t || turnBox(ev.turn), ev, live); break;
      case "turn_done": case "turn_failed": endTurn(t || turnBox(ev.turn), ev); break;
      case "state": stateMarker(ev, at, t || openTurn()); break;
      case "limit": limitMarker(ev, at, t || openTurn()); break;
      default: break;
    }
  }

  function onViewEvent(ev) {
    stickToBottom(() => {
      switch (ev.type) {
        case "snapshot": renderSnapshot(ev); break;
        case "state": {
          show(ev, Date.now() / 1000, null, true);
          const s = sessions.find((x) => x.id === view.sid);
          if (s) { s.state = ev.new; showFacts(s); }
          if (ev.new === "deleted") view.source.close();
          break;
        }
        case "gone": marker("session " + view.sid + ": " + ev.message, "limit"); view.source.close(); break;
        case "error": marker(ev.message, "limit"); view.source.close(); break;
        case "daemon": break;  // the list's feed says it
        default: show(ev, Date.now() / 1000, null, true);
      }
    });
  }

  // ------------------------------------------------------------ actions

  async function act(action, body) {
    if (!view) return null;
    $("action-error").textContent = "";
    try {
      return await post(view.sid, action, body);
    } catch (err) {
      $("action-error").textContent = action + ": " + err.message;
      return null;
    }
  }

  function wire() {
    for (const action of ["interrupt", "stop", "restart"]) {
      const button = $("btn-" + action);
      button.addEventListener("click", async () => {
        button.disabled = true;
        try { await act(action); } finally { button.disabled = false; }
      });
    }
    const input = $("input");
    $("input-form").addEventListener("submit", async (e) => {
      e.preventDefault();
      const text = input.value;
      if (!text.trim() || !view) return;
      $("btn-send").disabled = true;
      const sid = view.sid;
      try {
        const done = await act("send", {text});
        if (done && view && view.sid === sid) {
          input.value = "";
          stickToBottom(() => turnBox(done.turn, text));
        }
      } finally {
        $("btn-send").disabled = false;
      }
    });
    input.addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
        e.preventDefault();
        $("input-form").requestSubmit();
      }
    });
  }

  wire();
  openList();
})();
