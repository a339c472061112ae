// The demo chat page (dev mode): a sidebar fed by the live conversation feed, a chat view
// with streaming replies, the goal strip, turn latencies and a connection indicator; the
// conversation as a tree: the active path only, retry on the last answer, edit on each
// message, undo (the text back in the composer) and "‹ 2/3 ›" at every fork, every move
// followed live by every tab. Everything it knows comes from the gateway: GET
// /v1/conversations, GET .../events (the active path and its forks), and the WebSocket
// through gateway-client.js (which keeps each chat's tree).

import { GatewayClient, newClientMsgId } from "./gateway-client.js";

const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);
const token = params.get("token");

const conversations = new Map(); // chat_id -> {chat_id, title, status, updated_at, preview, goal_state, seq}
const models = new Map(); // chat_id -> the chat's messages and state (see model())
let active = null; // chat_id on screen
let client = null;
let everConnected = false;
let noticeTimer = null;

// --- HTTP ----------------------------------------------------------------------------

async function api(method, path, body) {
  const headers = { Authorization: `Bearer ${token}` };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const res = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  if (!res.ok) {
    let detail = null;
    try { detail = (await res.json()).error; } catch { /* not JSON */ }
    const err = new Error(detail?.message ?? `HTTP ${res.status}`);
    err.status = res.status;
    err.code = detail?.code;
    throw err;
  }
  return res.status === 204 ? null : res.json();
}

// --- state ---------------------------------------------------------------------------

function model(chatId) {
  let m = models.get(chatId);
  if (!m) {
    m = {
      chatId,
      loaded: false, // history fetched over HTTP
      loading: null, // the fetch in progress
      since: null, // resume point of that history, for the first subscribe
      subscribed: false,
      seqs: new Set(), // durable seqs applied: nothing is shown twice
      items: [], // durable items, ascending seq
      nodes: new Map(), // item key -> element
      streaming: "", // the reply being written: its stream's whole text so far
      deltas: 0,
      pending: new Map(), // client_msg_id -> {text, state, error}: sent, not yet seen back
      editing: null, // {msgId, text}: the user message being edited inline
      reloading: null, // a reload of the active path in progress (see ensurePath)
      reloadedAt: -1, // the head seq the last reload was for
      status: "idle",
      statusSeq: -1,
      turnId: null,
      goal: null,
      goalSeq: -1,
      error: null,
      lastSubscribe: null, // {mode, buffered, overflowed, replayed, recovered} of the last `subscribed`
    };
    models.set(chatId, m);
  }
  return m;
}

function resetModel(m) {
  m.loaded = false;
  m.loading = null;
  m.seqs = new Set();
  m.items = [];
  m.nodes = new Map();
  m.streaming = "";
  m.deltas = 0;
  m.editing = null;
}

function insertItem(m, item, frame) {
  item.key = `s${item.seq}`;
  item.node = frame.node ?? null; // the tree node it belongs to: shown when on the active path
  let i = m.items.length;
  while (i > 0 && m.items[i - 1].seq > item.seq) i--;
  m.items.splice(i, 0, item);
}

function setGoal(m, goal, seq) {
  if (seq != null && seq < m.goalSeq) return;
  m.goal = goal ?? null;
  if (seq != null) m.goalSeq = seq;
}

function setStatus(m, status, turnId, seq) {
  if (seq != null && seq < m.statusSeq) return;
  m.status = status;
  m.turnId = turnId ?? null;
  if (seq != null) m.statusSeq = seq;
}

/** Apply one event frame (from history or live) to its chat's model. */
function applyEvent(f) {
  const m = model(f.chat_id);
  if (f.seq != null) {
    if (m.seqs.has(f.seq)) return;
    m.seqs.add(f.seq);
  }
  const d = f.data ?? {};
  switch (f.type) {
    case "user_message":
      insertItem(m, { seq: f.seq, kind: "user", text: String(d.text ?? ""), ts: f.ts }, f);
      if (d.client_msg_id) m.pending.delete(d.client_msg_id);
      break;
    case "turn_start":
      setStatus(m, "running", d.turn_id, f.seq);
      m.streaming = "";
      m.deltas = 0;
      break;
    case "delta":
      if (!f.stream) { // a plain ephemeral delta (no turn running): shown as it comes
        m.streaming += String(d.text ?? "");
        m.deltas++;
      } // a streamed one: the client's "stream" event gives the whole text
      break;
    case "message":
      insertItem(m, {
        seq: f.seq, kind: "assistant", text: String(d.text ?? ""), cancelled: !!d.cancelled,
        streamed: m.deltas, ts: f.ts,
      }, f);
      m.streaming = "";
      m.deltas = 0;
      break;
    case "tool_call":
      insertItem(m, { seq: f.seq, kind: "note", text: `tool: ${d.name ?? "?"}` }, f);
      break;
    case "cancel_requested":
      insertItem(m, { seq: f.seq, kind: "note", text: "stop requested" }, f);
      break;
    case "goal_state":
      setGoal(m, d, f.seq);
      break;
    case "title":
      setTitle(f.chat_id, d.title, f.seq);
      break;
    case "turn_end":
      insertItem(m, {
        seq: f.seq, kind: "turn_end", turnId: d.turn_id, latency: d.latency_ms, reason: d.reason ?? "complete",
      }, f);
      setStatus(m, "idle", null, f.seq);
      if ("goal_state" in d) setGoal(m, d.goal_state, f.seq);
      m.streaming = "";
      m.deltas = 0;
      break;
    case "deleted":
      removeConversation(f.chat_id);
      break;
    default:
      break; // reasoning_delta, tool_result, custom events: not shown by this demo
  }
  if (f.chat_id === active) scheduleRender();
}

function setTitle(chatId, title, seq) {
  const c = conversations.get(chatId);
  if (!c) return;
  if (seq != null && seq <= (c.seq ?? -1)) return; // the feed already told us (or newer)
  c.title = title;
  if (seq != null) c.seq = seq;
  scheduleRender();
}

function upsertConversation(c) {
  const old = conversations.get(c.chat_id);
  const seq = c.last_seq ?? 0;
  if (old && !c.created && seq < (old.seq ?? -1)) return; // stale
  conversations.set(c.chat_id, {
    chat_id: c.chat_id,
    title: c.title ?? null,
    status: c.status ?? "idle",
    updated_at: c.updated_at ?? 0,
    preview: c.preview ?? null,
    goal_state: c.goal_state ?? null,
    seq,
  });
  const m = models.get(c.chat_id);
  if (m) setGoal(m, c.goal_state ?? null, seq);
}

function removeConversation(chatId) {
  conversations.delete(chatId);
  models.delete(chatId);
  if (active === chatId) {
    active = null;
    setUrlChat(null);
  }
  scheduleRender();
}

async function loadConversations() {
  const page = await api("GET", "/v1/conversations?limit=100");
  const seen = new Set();
  for (const c of page.conversations) {
    seen.add(c.chat_id);
    upsertConversation(c);
  }
  if (page.next_cursor == null) {
    for (const id of [...conversations.keys()]) if (!seen.has(id) && id !== active) conversations.delete(id);
  }
  scheduleRender();
}

/**
 * Fetch a chat's active path over HTTP (its events, and its forks for the tree); returns
 * its resume point.
 */
async function fetchPath(m) {
  let after = 0;
  let since = null;
  for (;;) {
    const page = await api("GET", `/v1/conversations/${encodeURIComponent(m.chatId)}/events?after=${after}&limit=1000`);
    client.loadHistory(m.chatId, page);
    for (const f of page.events) applyEvent(f);
    since = { seq: page.last_seq, epoch: page.epoch };
    if (page.next_after == null) break;
    after = page.next_after;
  }
  return since;
}

/** Fetch the history of a chat (its active path) over HTTP; returns its resume point. */
function loadHistory(m) {
  if (m.loading) return m.loading;
  m.loading = (async () => {
    let since = null;
    try {
      since = await fetchPath(m);
    } catch (err) {
      if (err.status !== 404) {
        m.loading = null;
        throw err;
      }
      since = null; // not created yet: the subscribe creates it
    }
    m.loaded = true;
    m.error = null;
    return since;
  })();
  return m.loading;
}

/**
 * The head moved to a branch whose events this page never loaded (another version at a
 * fork, chosen here or on another device): load the active path again. Only once every
 * event up to the head's move arrived (the seq the tree knows its head at), so that nodes
 * still on their way are not taken for missing ones.
 */
function ensurePath(m) {
  const tree = client.tree(m.chatId);
  const pos = client.position(m.chatId);
  if (!m.loaded || m.reloading || !tree?.headKnown || !pos) return;
  if (pos.seq < tree.headSeq || m.reloadedAt === tree.headSeq || !tree.missing().length) return;
  m.reloadedAt = tree.headSeq;
  m.reloading = fetchPath(m)
    .catch((err) => notice(`Could not load that version: ${err.message}`))
    .finally(() => {
      m.reloading = null;
      ensurePath(m); // the head may have moved again meanwhile
      if (m.chatId === active) scheduleRender();
    });
}

// --- chats ---------------------------------------------------------------------------

function setUrlChat(chatId) {
  const q = new URLSearchParams(location.search);
  if (chatId) q.set("chat", chatId);
  else q.delete("chat");
  history.replaceState(null, "", `${location.pathname}?${q}`);
}

async function selectChat(chatId) {
  if (active === chatId) return;
  const previous = active;
  active = chatId;
  // Unsubscribe (not leave): the gateway buffers the old chat's frames on this connection,
  // so a turn that streams off-screen is complete when we come back.
  if (previous) {
    const pm = models.get(previous);
    if (pm) pm.subscribed = false;
    client.unsubscribe(previous);
  }
  setUrlChat(chatId);
  scheduleRender();
  await openChat(model(chatId));
}

async function openChat(m) {
  let since = m.since;
  if (!m.loaded) {
    try {
      since = await loadHistory(m);
    } catch (err) {
      m.error = `Could not load the history: ${err.message}. Retrying when reconnected.`;
      scheduleRender();
      return;
    }
    m.since = since;
  }
  if (active !== m.chatId) return;
  m.since = null; // used once: later subscribes resume from the client's own position
  client.subscribe(m.chatId, since ? { since } : {}).catch((err) => notice(describe(err)));
  scheduleRender();
}

async function newChat() {
  try {
    const c = await api("POST", "/v1/conversations", {});
    upsertConversation({ ...c, created: true });
    const m = model(c.chat_id);
    m.loaded = true;
    m.since = { seq: c.last_seq, epoch: c.epoch };
    await selectChat(c.chat_id);
    $("input").focus();
  } catch (err) {
    notice(`Could not create a conversation: ${err.message}`);
  }
}

function send() {
  const input = $("input");
  const text = input.value.trim();
  if (!text || !active) return;
  const m = model(active);
  if (m.status === "running") return;
  const clientMsgId = newClientMsgId();
  m.pending.set(clientMsgId, { text, state: "sending", error: null });
  input.value = "";
  autosize();
  client.sendMessage(active, text, { clientMsgId }).then(
    () => {
      const p = m.pending.get(clientMsgId);
      if (p) p.state = "sent";
      scheduleRender();
    },
    (err) => {
      const p = m.pending.get(clientMsgId);
      if (p) {
        p.state = "failed";
        p.error = describe(err);
      }
      scheduleRender();
    },
  );
  scheduleRender();
}

function stop() {
  if (!active) return;
  const m = model(active);
  client.cancel(active, m.turnId ?? undefined).catch((err) => notice(describe(err)));
}

// --- the conversation tree: retry, edit, undo, switch ------------------------------------
// Each sends the head this page knows as expected_head (gateway-client.js does): when
// another device moved it meanwhile, the gateway answers `conflict` and nothing changes.

function retry() {
  if (!active) return;
  client.retry(active).catch((err) => notice(describe(err)));
}

function startEdit(m, msgId, text) {
  m.nodes.delete(`edit:${msgId}`); // a fresh editor, with the message's text
  m.editing = { msgId, text };
  scheduleRender();
}

function saveEdit(m, text) {
  const editing = m.editing;
  if (!editing) return;
  const value = text.trim();
  if (!value) return;
  m.editing = null;
  scheduleRender();
  client.edit(m.chatId, editing.msgId, value).catch((err) => notice(describe(err)));
}

function undo() {
  if (!active) return;
  const chatId = active;
  client.undo(chatId).then((ack) => {
    // The message is taken back: its text goes back in the composer, to edit and resend.
    const input = $("input");
    if (active === chatId && typeof ack.text === "string" && !input.value.trim()) {
      input.value = ack.text;
      autosize();
      input.focus();
    }
  }, (err) => notice(describe(err)));
}

function switchTo(m, nodeId) {
  client.switch(m.chatId, nodeId).catch((err) => notice(describe(err)));
}

function describe(err) {
  const text = {
    turn_in_progress: "The agent is still answering: wait, or press Stop.",
    text_too_long: "That message is too long.",
    forbidden: "That conversation belongs to someone else.",
    no_active_turn: "Nothing to stop.",
    conflict: "This conversation changed on another device meanwhile: nothing was done.",
    not_on_path: "That message is not on the conversation shown any more.",
    nothing_to_retry: "There is no answer to retry.",
    nothing_to_undo: "There is nothing to undo.",
  }[err?.code];
  return text ?? err?.message ?? String(err);
}

function notice(text) {
  const box = $("notice");
  box.textContent = text;
  box.hidden = false;
  clearTimeout(noticeTimer);
  noticeTimer = setTimeout(() => { box.hidden = true; }, 6000);
}

// --- rendering -------------------------------------------------------------------------

let renderQueued = false;

function scheduleRender() {
  if (renderQueued) return;
  renderQueued = true;
  let done = false;
  const run = () => {
    if (done) return;
    done = true;
    renderQueued = false;
    render();
  };
  requestAnimationFrame(run);
  setTimeout(run, 100); // rAF does not run in a hidden tab
}

function h(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v == null || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const child of children) if (child != null) node.append(child);
  return node;
}

function conversationTitle(c) {
  return c?.title || "New chat";
}

function render() {
  renderSidebar();
  renderChat();
}

const sidebarNodes = new Map();

function renderSidebar() {
  const list = $("conversations");
  const sorted = [...conversations.values()].sort((a, b) => (b.updated_at - a.updated_at) || a.chat_id.localeCompare(b.chat_id));
  const nodes = sorted.map((c) => {
    let li = sidebarNodes.get(c.chat_id);
    if (!li) {
      li = h("li", { class: "conversation", "data-testid": "conversation", "data-chat-id": c.chat_id });
      const button = h("button", { type: "button" },
        h("span", { class: "title", "data-testid": "conversation-title" }),
        h("span", { class: "badge", "data-testid": "conversation-status" }),
        h("span", { class: "preview", "data-testid": "conversation-preview" }));
      button.addEventListener("click", () => selectChat(c.chat_id));
      li.append(button);
      sidebarNodes.set(c.chat_id, li);
    }
    li.dataset.status = c.status;
    li.classList.toggle("active", c.chat_id === active);
    if (c.chat_id === active) li.setAttribute("aria-current", "true");
    else li.removeAttribute("aria-current");
    const title = li.querySelector(".title");
    const hasGoal = !!c.goal_state?.active;
    title.textContent = conversationTitle(c);
    if (hasGoal) title.prepend(h("span", { class: "goal-dot", title: "active goal", text: "◎" }));
    li.querySelector(".badge").textContent = c.status === "running" ? "running" : "";
    li.querySelector(".preview").textContent = c.preview ?? "";
    return li;
  });
  for (const id of [...sidebarNodes.keys()]) if (!conversations.has(id)) sidebarNodes.delete(id);
  if (nodes.length !== list.children.length || nodes.some((n, i) => list.children[i] !== n)) {
    list.replaceChildren(...nodes);
  }
}

function formatLatency(ms) {
  if (ms == null) return "";
  return ms < 1000 ? `${ms} ms` : `${(ms / 1000).toFixed(ms < 10000 ? 2 : 1)} s`;
}

function itemNode(m, it) {
  let node = m.nodes.get(it.key);
  if (node) return node;
  if (it.kind === "user" || it.kind === "assistant") {
    node = h("div", {
      class: `msg ${it.kind}${it.cancelled ? " cancelled" : ""}`, "data-testid": "message",
      "data-role": it.kind, "data-seq": it.seq, "data-node": it.node,
      "data-streamed": it.kind === "assistant" ? it.streamed : null,
    }, h("div", { class: "bubble", "data-testid": "message-text", text: it.text }));
    if (it.cancelled) node.append(h("div", { class: "meta", text: "stopped" }));
  } else if (it.kind === "turn_end") {
    node = h("div", {
      class: "turn-meta", "data-testid": "turn-latency", "data-seq": it.seq,
      "data-turn-id": it.turnId, "data-reason": it.reason, "data-latency-ms": it.latency,
      title: "turn latency, measured by the gateway",
    }, h("span", { class: "latency", text: `${it.reason === "complete" ? "replied in" : "ended after"} ${formatLatency(it.latency)}` }), h("span", { class: "reason", text: it.reason }));
  } else {
    node = h("div", { class: "note", "data-testid": "note", "data-seq": it.seq, text: it.text });
  }
  m.nodes.set(it.key, node);
  return node;
}

function pendingNode(m, id, p) {
  const key = `p${id}:${p.state}`;
  let node = m.nodes.get(key);
  if (!node) {
    for (const k of [...m.nodes.keys()]) if (k.startsWith(`p${id}:`)) m.nodes.delete(k);
    const failed = p.state === "failed";
    node = h("div", {
      class: `msg user pending${failed ? " failed" : ""}`, "data-testid": "pending-message",
      "data-state": p.state, "data-client-msg-id": id,
    }, h("div", { class: "bubble", text: p.text }), h("div", { class: "meta", "data-role": "meta" }));
    if (failed) {
      node.title = "click to dismiss";
      node.addEventListener("click", () => { m.pending.delete(id); scheduleRender(); });
    }
    m.nodes.set(key, node);
  }
  const meta = node.querySelector('[data-role="meta"]');
  meta.textContent = p.state === "failed" ? `${p.error} (click to dismiss)`
    : p.state === "sent" ? "sent" : client.connected ? "sending…" : "queued: sent when reconnected";
  return node;
}

/** A button with an accessible name (its label, or `label` when the text is a symbol). */
function button(text, testId, label, onClick, disabled = false) {
  const b = h("button", { type: "button", class: "tool", "data-testid": testId, "aria-label": label, title: label, text, disabled });
  b.addEventListener("click", onClick);
  return b;
}

/** "‹ 2/3 ›": the versions of a node at a fork; the arrows switch the head to a sibling. */
function forkNav(m, nodeId, sib, what, busy) {
  const n = sib.ids.length;
  return h("span", {
    class: "fork", "data-testid": "fork", "data-node-id": nodeId, "data-index": sib.index,
    "data-count": n, role: "group", "aria-label": `${what}: version ${sib.index + 1} of ${n}`,
  },
  button("‹", "fork-prev", `Previous version of this ${what}`, () => switchTo(m, sib.ids[sib.index - 1]), busy || sib.index === 0),
  h("span", { class: "fork-position", "data-testid": "fork-position", text: `${sib.index + 1}/${n}` }),
  button("›", "fork-next", `Next version of this ${what}`, () => switchTo(m, sib.ids[sib.index + 1]), busy || sib.index === n - 1));
}

/**
 * The controls under a node of the active path: for a user message, its versions and Edit;
 * for a turn, its versions and (the last answer) Retry. Rebuilt when their state changes.
 */
function barNode(m, tree, nodeId, kind, busy) {
  const sib = tree.siblings(nodeId);
  const isHead = tree.head === nodeId;
  const editing = m.editing?.msgId === nodeId;
  const key = `bar:${nodeId}:${sib.index}/${sib.ids.length}:${isHead}:${busy}:${editing}`;
  let node = m.nodes.get(key);
  if (node) return node;
  for (const k of [...m.nodes.keys()]) if (k.startsWith(`bar:${nodeId}:`)) m.nodes.delete(k);
  const parts = [];
  if (sib.ids.length > 1) parts.push(forkNav(m, nodeId, sib, kind === "user" ? "message" : "answer", busy));
  if (kind === "user" && !editing) {
    parts.push(button("Edit", "edit", "Edit this message", () => {
      const it = m.items.find((i) => i.kind === "user" && i.node === nodeId);
      startEdit(m, nodeId, it?.text ?? "");
    }, busy));
  }
  if (kind === "turn" && isHead) parts.push(button("Retry", "retry", "Retry: answer this message again", retry, busy));
  if (!parts.length) return null;
  node = h("div", { class: `node-bar ${kind}`, "data-testid": `${kind}-bar`, "data-node-id": nodeId }, ...parts);
  m.nodes.set(key, node);
  return node;
}

/** A user message being edited in place: the text, then Send (a new version) or Cancel. */
function editorNode(m, it) {
  const key = `edit:${it.node}`;
  let node = m.nodes.get(key);
  if (node) return node;
  const input = h("textarea", { class: "edit-input", "data-testid": "edit-input", "aria-label": "Edited message", rows: 2 });
  input.value = m.editing?.text ?? it.text;
  const cancel = () => { m.editing = null; m.nodes.delete(key); scheduleRender(); };
  const save = () => { m.nodes.delete(key); saveEdit(m, input.value); };
  input.addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) { ev.preventDefault(); save(); }
    else if (ev.key === "Escape") cancel();
  });
  node = h("div", { class: "msg user editing", "data-testid": "message-editor", "data-node": it.node }, input,
    h("div", { class: "edit-actions" },
      button("Cancel", "edit-cancel", "Cancel the edit", cancel),
      button("Send", "edit-save", "Send the edited message", save)));
  m.nodes.set(key, node);
  queueMicrotask(() => input.focus());
  return node;
}

/**
 * The chat's items on its active path, in order, each node's controls after its last item.
 * Until the head is known (a gateway without trees), every item.
 */
function pathNodes(m) {
  const tree = client?.tree(m.chatId);
  if (!tree?.headKnown) return m.items.map((it) => itemNode(m, it));
  const busy = m.status === "running";
  const shown = m.items.filter((it) => tree.visible(it));
  const path = tree.path();
  const lastOf = new Map(); // node -> index of its last item shown
  shown.forEach((it, i) => { if (it.node) lastOf.set(it.node, i); });
  const nodes = [];
  shown.forEach((it, i) => {
    nodes.push(it.kind === "user" && m.editing?.msgId === it.node ? editorNode(m, it) : itemNode(m, it));
    if (!it.node || lastOf.get(it.node) !== i) return;
    if (it.kind !== "user") {
      nodes.push(barNode(m, tree, it.node, "turn", busy));
      return;
    }
    nodes.push(barNode(m, tree, it.node, "user", busy));
    // Its answer has nothing to show yet (just started): its controls go here.
    const turn = path[path.indexOf(it.node) + 1];
    if (turn && !lastOf.has(turn)) nodes.push(barNode(m, tree, turn, "turn", busy));
  });
  return nodes.filter((n) => n != null);
}

function streamingNode(m) {
  let node = m.nodes.get("streaming");
  if (!node) {
    node = h("div", { class: "msg assistant streaming", "data-testid": "streaming" },
      h("div", { class: "bubble", "data-testid": "streaming-text" }));
    m.nodes.set("streaming", node);
  }
  node.firstChild.textContent = m.streaming;
  node.dataset.deltas = String(m.deltas);
  return node;
}

function renderChat() {
  const chat = $("chat");
  const m = active ? model(active) : null;
  const c = active ? conversations.get(active) : null;
  chat.dataset.chatId = active ?? "";
  chat.dataset.synced = String(!!m?.subscribed);
  // The head this page shows ("none": before the first message), for tests and debugging.
  const tree = m ? client?.tree(m.chatId) : null;
  chat.dataset.head = tree?.headKnown ? tree.head ?? "none" : "";
  // How the last subscribe went (since | buffer | again | fresh): handy when debugging.
  chat.dataset.subscribeMode = m?.lastSubscribe?.mode ?? "";
  chat.dataset.buffered = String(m?.lastSubscribe?.buffered ?? "");
  chat.dataset.overflowed = String(m?.lastSubscribe?.overflowed ?? "");
  chat.dataset.replayed = String(m?.lastSubscribe?.replayed ?? "");
  $("empty").hidden = !!active;
  $("chat-title").textContent = active ? conversationTitle(c) : "No conversation";
  document.title = active ? `${conversationTitle(c)} · gateway demo` : "gateway · demo chat";
  const status = $("chat-status");
  status.dataset.status = m?.status ?? "idle";
  status.textContent = m?.status === "running" ? "agent is answering…" : "";

  const goal = m?.goal;
  const strip = $("goal");
  if (goal && (goal.active || goal.status)) {
    strip.hidden = false;
    strip.dataset.status = goal.status ?? "";
    strip.dataset.active = String(!!goal.active);
    $("goal-summary").textContent = goal.ui_summary || goal.objective || "goal";
    $("goal-summary").title = goal.objective ?? "";
    $("goal-status").textContent = goal.status ?? (goal.active ? "active" : "");
  } else {
    strip.hidden = true;
    strip.dataset.status = "";
  }

  const box = $("messages");
  const nodes = [];
  if (m) {
    nodes.push(...pathNodes(m));
    for (const [id, p] of m.pending) nodes.push(pendingNode(m, id, p));
    if (m.streaming) nodes.push(streamingNode(m));
    if (m.error) nodes.push(h("div", { class: "note", "data-testid": "chat-error", text: m.error }));
  }
  const switched = box.dataset.chatId !== (active ?? "");
  const nearBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 80;
  if (switched || nodes.length !== box.children.length || nodes.some((n, i) => box.children[i] !== n)) {
    box.replaceChildren(...nodes);
    box.dataset.chatId = active ?? "";
  }
  if (switched || nearBottom) box.scrollTop = box.scrollHeight;

  const running = m?.status === "running";
  $("composer").dataset.disabled = String(!active);
  $("send").disabled = !active || running;
  $("stop").hidden = !running;
  // Undo takes back the active path's last user message (there is one unless it is empty).
  $("undo").disabled = !active || running || !tree?.headKnown || tree.head == null;
}

let countdown = null;

function renderConnection(s) {
  clearInterval(countdown);
  if (s.state === "reconnecting" && s.retryAt) {
    // Count down to the next attempt.
    countdown = setInterval(() => renderConnection({ ...s, delay: s.retryAt - Date.now() }), 1000);
  }
  const box = $("connection");
  box.dataset.state = s.state;
  const reasons = {
    1012: "server restarting", 1013: "backend unavailable", 4008: "too slow", 4011: "token expired",
    4029: "too many requests", 4001: "invalid token", 4003: "origin not allowed", 4004: "protocol error",
  };
  let label;
  const offline = s.state !== "open" && (s.reason === "offline" || globalThis.navigator?.onLine === false);
  switch (offline ? "offline" : s.state) {
    case "offline": label = "Offline: waiting for the network"; box.dataset.state = "offline"; break;
    case "open": label = "Connected"; break;
    case "connecting": label = everConnected ? "Reconnecting…" : "Connecting…"; break;
    case "reconnecting": {
      const why = reasons[s.code] ? ` (${reasons[s.code]})` : "";
      const left = Math.ceil((s.delay ?? 0) / 1000);
      label = left > 0 ? `Reconnecting in ${left} s${why}` : `Reconnecting…${why}`;
      break;
    }
    case "closed": label = `Disconnected${reasons[s.code] ? `: ${reasons[s.code]}` : ""}`; break;
    default: label = "Starting…";
  }
  $("connection-label").textContent = label;
  box.title = s.reason ? `${s.code ?? ""} ${s.reason}` : "";
}

function autosize() {
  const input = $("input");
  input.style.height = "auto";
  input.style.height = `${Math.min(160, input.scrollHeight + 2)}px`;
}

// --- boot ------------------------------------------------------------------------------

async function boot() {
  $("new-chat").addEventListener("click", newChat);
  $("composer").addEventListener("submit", (ev) => { ev.preventDefault(); send(); });
  $("stop").addEventListener("click", stop);
  $("undo").addEventListener("click", undo);
  $("input").addEventListener("input", autosize);
  $("input").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
      ev.preventDefault();
      send();
    }
  });

  if (!token) {
    $("empty").hidden = true;
    notice("No token. Open the page URL printed by `gateway serve --dev` (it ends in ?token=…).");
    clearTimeout(noticeTimer);
    $("composer").dataset.disabled = "true";
    renderConnection({ state: "closed" });
    $("app").dataset.ready = "true";
    return;
  }

  client = new GatewayClient({ token, maxDelay: 8000 });
  window.demo = { client, conversations, models };
  client.on("state", (s) => {
    console.info(`[gateway] ${s.state}`, s.code ?? "", s.reason ?? "", s.delay != null ? `retry in ${s.delay} ms` : "");
    renderConnection(s);
    if (s.state !== "open") for (const m of models.values()) m.subscribed = false;
    scheduleRender(); // pending bubbles say "queued" while offline
  });
  client.on("hello", (hello) => {
    $("whoami").textContent = `signed in as ${hello.user_id}`;
    if (everConnected) {
      // The feed is not replayed: catch up on what changed while we were away.
      loadConversations().catch(() => {});
      if (active && !model(active).loaded) openChat(model(active));
    }
    everConnected = true;
  });
  client.on("conversation", (f) => {
    if (f.deleted) removeConversation(f.chat_id);
    else upsertConversation(f);
    scheduleRender();
  });
  client.on("subscribed", ({ chatId, frame, mode }) => {
    const m = model(chatId);
    m.subscribed = chatId === active;
    m.lastSubscribe = {
      mode, buffered: frame.buffered, overflowed: frame.overflowed, replayed: frame.replayed,
      recovered: frame.recovered,
    };
    const snap = frame.snapshot ?? {};
    setStatus(m, snap.status ?? "idle", snap.turn_id, frame.seq);
    ensurePath(m); // after a replay of nothing, the head is known in full now
    setGoal(m, snap.goal_state ?? null, frame.seq); // the goal survives a reload
    if (snap.title) setTitle(chatId, snap.title, frame.seq);
    scheduleRender();
  });
  client.on("event", (f) => {
    applyEvent(f);
    if (f.seq != null && models.has(f.chat_id)) ensurePath(model(f.chat_id));
  });
  client.on("head", ({ chatId }) => {
    // Another version, an undo, a retry (here or on another device): show the new path.
    const m = models.get(chatId);
    if (!m) return;
    if (m.editing && !client.tree(chatId)?.onPath(m.editing.msgId)) m.editing = null;
    ensurePath(m);
    if (chatId === active) scheduleRender();
  });
  client.on("stream", ({ chatId, stream, ended }) => {
    // The answer being written, whole: after a reload, a dropped network or on a second
    // device it is shown at once, then grows word by word, never a word twice.
    const m = model(chatId);
    if (stream && stream.type === "delta") {
      m.streaming = stream.text;
      m.deltas = stream.pos;
    } else if (!stream && ended !== "committed") {
      m.streaming = ""; // discarded (the agent starts over) or gone while we were away
      m.deltas = 0;
    }
    if (chatId === active) scheduleRender();
  });
  client.on("offline", () => renderConnection({ state: "reconnecting", reason: "offline" }));
  client.on("recovery", ({ chatId }) => {
    // The gateway could not replay what we missed: start over from the HTTP history.
    const m = model(chatId);
    resetModel(m);
    loadHistory(m).catch((err) => { m.error = `Could not reload: ${err.message}`; }).finally(scheduleRender);
  });
  client.on("error", (f) => {
    if (f.code === "rate_limited") notice("Slow down: the gateway is rate limiting this page.");
  });
  client.connect();

  try {
    await loadConversations();
  } catch (err) {
    notice(`Could not load conversations: ${err.message}`);
  }
  const wanted = params.get("chat");
  const first = wanted ?? [...conversations.values()].sort((a, b) => b.updated_at - a.updated_at)[0]?.chat_id;
  if (first) await selectChat(first);
  scheduleRender();
  $("app").dataset.ready = "true";
}

boot();
