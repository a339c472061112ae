// The demo chat page (dev mode): a reference chat client on gateway-client.js.
//
// A sidebar fed by the live conversation feed (rename and delete there), a chat view with
// streaming replies, the goal strip, turn latencies and a connection indicator; the
// conversation as a tree: the active path only, retry on the last answer, edit on each
// message, undo (the text back in the composer) and "‹ 2/3 ›" at every fork, every move
// followed live by every tab. An agent's tool calls are rows that open on their arguments
// and result, a step it runs is a "searching…" line under the answer, and its state a panel
// under the header. A client tool it calls to ask the person is a prompt on every device (its
// arguments, and a form built from the tool's `result` schema); the first answer wins
// everywhere. "New chat" offers the live agents (GET /v1/agents) when there are
// several; the header names the conversation's, and who is here now (each person with
// their devices, the agent while it answers), live; "alice is typing…" shows above the
// message box (this person's own other devices too: "You are typing on another device…").
// A shared conversation (protocol.md, "Shared conversations") says who shares it in the
// header, labels each person's message with its author ("You" for oneself) and an answer to
// the agent with who gave it; a viewer reads it, with the composer, the tree's controls and
// the answers disabled ("You can read this conversation"); a person removed from it sees it
// close ("You were removed from this conversation") and leave the list.
// Everything it knows comes from the gateway:
// GET /v1/conversations, GET .../events (the active path and its forks), and the WebSocket
// through gateway-client.js (which keeps each chat's tree).
//
// The message box is live on load: the first message starts a conversation (nothing is
// created before it, and opening a link never creates one). Below 700 px the conversation
// list is a drawer. The token leaves the address bar on load (sessionStorage keeps it for
// reloads of this tab); the socket authenticates with a one-time ticket (gateway-client.js).
// The client asks for the token through a callback (currentToken()) before every ticket and
// HTTP call, and before the token expires on an open socket, to refresh it in band: a newer
// sign-in kept for this tab keeps the socket as it is, past the old token's expiry. With the
// one token of a `gateway serve --dev` link there is nothing fresher: nothing is sent, and
// at its expiry the page says the sign-in expired.

import { GatewayClient, newClientMsgId } from "./gateway-client.js";

const $ = (id) => document.getElementById(id);
const TOKEN_KEY = "gateway-demo-token";
const phone = matchMedia("(max-width: 699px)");
const token = takeToken();
const params = new URLSearchParams(location.search);

const conversations = new Map(); // chat_id -> {chat_id, title, status, updated_at, preview, goal_state, seq}
const models = new Map(); // chat_id -> the chat's messages and state (see model())
const sharing = new Map(); // chat_id -> {owner, members: {user_id: role}}: who shares it
let active = null; // chat_id on screen; null: a new chat, created by its first message
let client = null;
let everConnected = false;
let blocked = false; // the token was refused: nothing that needs the gateway can work
let editingTitle = null; // chat_id whose title is being edited in the sidebar
let confirmingDelete = null; // chat_id whose deletion awaits a confirmation
let liveAgents = []; // [{name, kind, workers}]: the agents with a live worker (GET /v1/agents)
let chosenAgent = null; // the agent picked for the next new chat (null: none picked)
let me = null; // the signed-in user's id (hello.user_id)
// The longest message text the gateway takes, in UTF-8 bytes (hello's limits say; this is
// its default until the first hello).
let maxTextBytes = 32768;

/**
 * The token from `?token=` (kept in sessionStorage for reloads of this tab, then taken out
 * of the address bar, so that it lands in no history, bookmark, screenshot or Referer), or
 * the one kept earlier.
 */
function takeToken() {
  const q = new URLSearchParams(location.search);
  const fromUrl = q.get("token");
  if (fromUrl) {
    try { sessionStorage.setItem(TOKEN_KEY, fromUrl); } catch { /* storage off: memory only */ }
    q.delete("token");
    history.replaceState(null, "", `${location.pathname}${q.size ? `?${q}` : ""}${location.hash}`);
    return fromUrl;
  }
  try { return sessionStorage.getItem(TOKEN_KEY); } catch { return null; }
}

/**
 * The token callback of the client: the newest sign-in kept for this tab (a sign-in may put
 * a fresher token there), else the page's own. Asked before every connection ticket and HTTP
 * call, and on `token_expiring` for the in-band refresh; the same token as the socket's
 * sends no refresh (gateway-client.js).
 */
function currentToken() {
  let kept = null;
  try { kept = sessionStorage.getItem(TOKEN_KEY); } catch { /* storage off: memory only */ }
  return kept || token;
}

// --- HTTP ----------------------------------------------------------------------------

/** An error whose message is for people: never a parser's or a server's internals. */
class PageError extends Error {
  constructor(message, { status = 0, code = null, expired = false } = {}) {
    super(message);
    this.status = status;
    this.code = code;
    this.expired = expired;
  }
}

function httpMessage(status, code) {
  if (status === 401) return "Your sign-in is not valid.";
  if (status === 403) return "That conversation belongs to someone else.";
  if (status === 404) return "That conversation does not exist.";
  if (status === 409) return "That conversation changed meanwhile: nothing was done.";
  if (status === 413 || code === "text_too_long") return "That is too long.";
  if (status === 400 || status === 422) return "The gateway did not accept that.";
  if (status === 429) return "Too many requests: wait a moment and try again.";
  return "The gateway is not available right now: try again in a moment.";
}

/** An HTTP API call through the client (its token, its timeout), failing with a PageError. */
async function api(method, path, body) {
  try {
    return await client.request(method, path, body === undefined ? {} : { body });
  } catch (err) {
    throw plainError(err);
  }
}

/** A GatewayError from an HTTP call, in words for people (a 401 also signs the page out). */
function plainError(err) {
  if (err instanceof PageError) return err;
  const status = err?.status ?? 0;
  const code = err?.code ?? null;
  let text;
  if (code === "timeout") text = "The gateway did not answer in time.";
  else if (code === "network") text = "Could not reach the gateway.";
  else text = httpMessage(status, code);
  const expired = status === 401 && /expired/i.test(err?.message ?? "");
  if (status === 401) signedOut(expired);
  return new PageError(text, { status, code, expired });
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
      discarded: "", // an attempt the agent started over from: shown dimmed until passed
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
      state: null, // the agent's state (snapshot.state, `state` events); null: none
      stateSeq: -1,
      calls: new Map(), // call_id -> the tool call's item (its result goes on it)
      tools: new Map(), // name -> the conversation's client tool {name, description, parameters, result}
      toolsSeq: -1, // the seq `tools` is known at
      awaitingHttp: null, // {call_id: name} from GET /v1/conversations/{id}, until a snapshot tells
      answers: new Map(), // call_id -> {state, error}: an answer given on this page
      steps: new Map(), // step name -> started: the steps the agent runs now (ephemeral)
      error: null,
      lastSubscribe: null, // {mode, buffered, overflowed, replayed, recovered} of the last `subscribed`
      roots: [], // {id, preview}: the first messages, shown when every message was undone
      rootsAt: null, // the head seq `roots` were fetched for
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
  m.calls = new Map();
  m.streaming = "";
  m.discarded = "";
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

/** The conversation's client tools, as of `seq` (a `client_tools` event's, or a GET's). */
function setTools(m, tools, seq) {
  if (!Array.isArray(tools) || (seq != null && seq < m.toolsSeq)) return;
  m.tools = new Map(tools.filter((t) => t && typeof t.name === "string").map((t) => [t.name, t]));
  if (seq != null) m.toolsSeq = seq;
}

/**
 * The client tools and the questions waiting for an answer (GET /v1/conversations/{id}): the
 * prompts can be built before the first `client_tools` event, even when history was trimmed.
 */
function loadClientTools(m) {
  api("GET", `/v1/conversations/${encodeURIComponent(m.chatId)}`).then((c) => {
    setTools(m, c.client_tools ?? [], c.last_seq);
    setSharing(m.chatId, c.owner, c.members);
    m.awaitingHttp = c.awaiting ?? {};
    if (m.chatId === active) scheduleRender();
  }, () => {}); // not fatal: the history's client_tools events and the snapshot tell it too
}

/** The agent's state, as of `seq` (a `state` event's, or a snapshot's): null for none. */
function setAgentState(m, state, seq) {
  if (seq != null && seq < m.stateSeq) return;
  m.state = state ?? null;
  if (seq != null) m.stateSeq = seq;
}

function setStatus(m, status, turnId, seq) {
  if (seq != null && seq < m.statusSeq) return;
  if (status === "running" && m.status !== "running" && m.chatId === active && m.subscribed) {
    announce("The agent is answering.");
  }
  m.status = status;
  m.turnId = turnId ?? null;
  if (seq != null) m.statusSeq = seq;
}

function endStream(m) {
  m.streaming = "";
  m.discarded = "";
  m.deltas = 0;
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
      insertItem(m, { seq: f.seq, kind: "user", text: String(d.text ?? ""), ts: f.ts, by: d.user_id ?? null }, f);
      if (d.client_msg_id) m.pending.delete(d.client_msg_id);
      break;
    case "turn_start":
      setStatus(m, "running", d.turn_id, f.seq);
      endStream(m);
      m.steps.clear();
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
      endStream(m);
      break;
    case "client_tools":
      setTools(m, d.tools, f.seq);
      break;
    case "tool_call": {
      const call = { seq: f.seq, kind: "tool", callId: d.call_id ?? null, name: String(d.name ?? "tool"), args: d.args, result: undefined, awaiting: d.awaiting === true };
      insertItem(m, call, f);
      if (call.callId != null) m.calls.set(call.callId, call);
      break;
    }
    case "tool_result": {
      // On its call's row; a result whose call this page does not hold gets a row of its own.
      const call = m.calls.get(d.call_id);
      if (call) {
        call.result = d.result;
        call.by = d.by ?? null;
      }
      if (call && d.msg_id) announceAnswer(m, call);
      if (!call) insertItem(m, { seq: f.seq, kind: "tool", callId: d.call_id ?? null, name: null, args: undefined, result: d.result, by: d.by ?? null }, f);
      break;
    }
    case "step": { // ephemeral: "searching…" while it runs
      const name = String(d.name ?? "").trim();
      if (!name) break;
      m.steps.delete(name); // started again: the latest again
      if (d.status === "started") m.steps.set(name, f.ts);
      break;
    }
    case "state":
      setAgentState(m, d.snapshot, f.seq);
      break;
    case "cancel_requested":
      insertItem(m, { seq: f.seq, kind: "note", text: "stop requested", late: true }, f);
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
        error: typeof d.error === "string" && d.error.trim() ? d.error.trim() : null,
      }, f);
      if (m.status === "running" && m.chatId === active && m.subscribed && FAILED[d.reason]) {
        announce(failureText(m.items.find((it) => it.seq === f.seq)));
      }
      setStatus(m, "idle", null, f.seq);
      if ("goal_state" in d) setGoal(m, d.goal_state, f.seq);
      endStream(m);
      m.steps.clear();
      break;
    case "deleted":
      removeConversation(f.chat_id, true);
      break;
    default:
      break; // reasoning_delta, custom events: not shown by this demo
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

// --- who shares a conversation ------------------------------------------------------------

/** Who shares a chat, as heard last (the list, the feed, `members` frames, GET it). */
function setSharing(chatId, owner, members) {
  if (typeof owner !== "string") return;
  sharing.set(chatId, { owner, members: { ...(members ?? {}) } });
  if (chatId === active) scheduleRender();
}

/** Shared with anyone, or someone else's: its messages are labelled with their authors. */
function isShared(chatId) {
  const s = chatId ? sharing.get(chatId) : null;
  return !!s && (Object.keys(s.members).length > 0 || (me != null && s.owner !== me));
}

/** This person's role in a chat: "owner", "member", "viewer"; null when not known. */
function myRole(chatId) {
  const s = chatId ? sharing.get(chatId) : null;
  if (!s || me == null) return null;
  return s.owner === me ? "owner" : s.members[me] ?? null;
}

/** A viewer reads it and writes nothing in it. */
function readOnly(chatId) {
  return myRole(chatId) === "viewer";
}

function personName(userId) {
  return userId === me ? "You" : userId;
}

/** This person was removed from a chat: it closes, with a word, and leaves the list. */
function removedFrom(chatId) {
  const title = conversationTitle(conversations.get(chatId));
  const shown = active === chatId;
  removeConversation(chatId);
  if (shown) gone(`You were removed from this conversation (“${title}”).`);
}

/**
 * What the open chat cost, short: tokens on the path shown (and billed over every version,
 * when a retry or an edit made them differ), and cost if the agent reports one. `detail`
 * lists every reported number, for the tooltip.
 */
function usageText(usage) {
  if (!usage || !Object.keys(usage.billed ?? {}).length) return { text: "", detail: "" };
  const tokens = (totals) => Object.entries(totals ?? {})
    .filter(([name]) => name.endsWith("_tokens")).reduce((sum, [, n]) => sum + n, 0);
  const number = (n) => n.toLocaleString(undefined, { maximumFractionDigits: 4 });
  const shown = tokens(usage.active), billed = tokens(usage.billed);
  let text = `${number(shown)} tokens`;
  if (billed !== shown) text += ` (${number(billed)} billed)`;
  if (usage.billed.cost != null) text += ` · cost ${number(usage.billed.cost)}`;
  // The usual counts first (input, output, cached), the rest by name, the cost last.
  const rank = (name) => (name === "cost" ? 9 : USUAL.indexOf(name) >= 0 ? USUAL.indexOf(name) : 5);
  const list = (totals) => Object.entries(totals ?? {})
    .sort(([a], [b]) => rank(a) - rank(b) || a.localeCompare(b))
    .map(([k, n]) => usageWords(k, number(n))).join(", ") || "nothing";
  return { text, detail: `This version: ${list(usage.active)}. Billed: ${list(usage.billed)}.` };
}

const USUAL = ["input_tokens", "output_tokens", "cached_tokens"];

/**
 * One usage count in words: "32 output tokens", "cost 0.0042", and a nested count (a
 * provider's `prompt_tokens_details.cached_tokens`) as "3 cached tokens (prompt tokens details)".
 */
function usageWords(name, shown) {
  if (name === "cost") return `cost ${shown}`;
  const parts = name.split(".").map((part) => part.replace(/[_-]+/g, " ").trim());
  const what = parts.pop();
  return `${shown} ${what}${parts.length ? ` (${parts.join(", ")})` : ""}`;
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
    usage: c.usage ?? old?.usage ?? null,
    agent: c.agent ?? old?.agent ?? null,
    seq,
  });
  setSharing(c.chat_id, c.owner, c.members);
  const m = models.get(c.chat_id);
  if (m) setGoal(m, c.goal_state ?? null, seq);
  if (m && Array.isArray(c.client_tools)) setTools(m, c.client_tools, seq);
}

/** A conversation is gone (deleted here, on another device, or through the API). */
function removeConversation(chatId, elsewhere = false) {
  if (!conversations.has(chatId) && !models.has(chatId)) return;
  const title = conversationTitle(conversations.get(chatId));
  conversations.delete(chatId);
  models.delete(chatId);
  sharing.delete(chatId);
  if (editingTitle === chatId) editingTitle = null;
  if (confirmingDelete === chatId) confirmingDelete = null;
  if (active === chatId) {
    active = null;
    setUrlChat(null);
    if (elsewhere) gone(`“${title}” was deleted on another device.`);
  }
  scheduleRender();
}

let listing = null;

/**
 * The conversation list (GET /v1/conversations through the client: each attempt with a
 * timeout, retried until it succeeds). On load and on every `feed_gap` (a reconnect: the
 * feed frames sent meanwhile are not replayed).
 */
function loadConversations() {
  if (listing) return listing;
  listing = client.listConversations({ limit: 100 }).then((page) => {
    const seen = new Set();
    for (const c of page.conversations) {
      seen.add(c.chat_id);
      upsertConversation(c);
    }
    if (page.next_cursor == null) {
      for (const id of [...conversations.keys()]) if (!seen.has(id) && id !== active) conversations.delete(id);
    }
    scheduleRender();
  }, (err) => { throw plainError(err); }).finally(() => { listing = null; });
  return listing;
}

let askingAgents = null;

/**
 * The agents with a live worker (GET /v1/agents), for "New chat": asked on load, on every
 * "New chat" and after a reconnect. A failure keeps the last list.
 */
function loadAgents() {
  if (askingAgents || blocked || !client) return askingAgents;
  askingAgents = client.listAgents().then((reply) => {
    const agents = (reply?.agents ?? []).filter((a) => typeof a?.name === "string");
    agents.sort((a, b) => a.name.localeCompare(b.name));
    liveAgents = agents;
    scheduleRender();
  }, () => { /* kept as it was: offered again at the next ask */ }).finally(() => { askingAgents = null; });
  return askingAgents;
}

/**
 * The agent a new chat names: the one picked, when several are live (the picker is shown);
 * else none, and the gateway's default answers it.
 */
function agentForNewChat() {
  if (liveAgents.length < 2) return undefined;
  const value = $("agent-select").value;
  return liveAgents.some((a) => a.name === value) ? value : undefined;
}

/** The agent picker of a new chat: the live agents, the one picked before (else `default`) selected. */
function renderAgentPicker() {
  const pick = $("agent-pick");
  const offer = !active && !blocked && liveAgents.length >= 2;
  pick.hidden = !offer;
  if (!offer) return;
  const select = $("agent-select");
  const names = liveAgents.map((a) => a.name);
  const wanted = names.includes(chosenAgent) ? chosenAgent
    : names.includes(select.value) ? select.value : names.includes("default") ? "default" : names[0];
  if ([...select.options].map((o) => o.value).join("\n") !== names.join("\n")) {
    select.replaceChildren(...liveAgents.map((a) => {
      const kind = AGENT_KINDS[a.kind];
      return h("option", { value: a.name, text: kind ? `${a.name} (${kind})` : a.name });
    }));
  }
  if (select.value !== wanted) select.value = wanted;
}

const AGENT_KINDS = { "ag-ui": "AG-UI", openai: "OpenAI-compatible" };

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
    let since;
    try {
      since = await fetchPath(m);
    } catch (err) {
      m.loading = null;
      throw err;
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
    .catch((err) => notice(`Could not load that version. ${err.message}`))
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
  history.replaceState(null, "", `${location.pathname}${q.size ? `?${q}` : ""}`);
}

let goneTimer = null;
const GONE_MS = 10000;

/**
 * The chat on screen went (deleted on another device): a quiet line where it was, said once
 * to screen readers, gone after GONE_MS or when another chat is chosen. Not an alert: it
 * blocks nothing and concerns only that chat.
 */
function gone(text = null) {
  clearTimeout(goneTimer);
  const line = $("gone");
  line.textContent = text ?? "";
  line.hidden = !text;
  if (!text) return;
  announce(text);
  goneTimer = setTimeout(() => gone(), GONE_MS);
}

/** Show a chat (null: a new one, created by its first message). */
async function selectChat(chatId) {
  closeDrawer();
  gone();
  if (active === chatId) return;
  const previous = active;
  active = chatId;
  editingTitle = null;
  confirmingDelete = null;
  // Unsubscribe (not leave): the gateway buffers the old chat's frames on this connection,
  // so a turn that streams off-screen is complete when we come back.
  if (previous) {
    const pm = models.get(previous);
    if (pm) pm.subscribed = false;
    client.unsubscribe(previous);
  }
  setUrlChat(chatId);
  scheduleRender();
  if (chatId) await openChat(model(chatId));
}

/** This chat cannot be shown (a link to one that does not exist, or someone else's). */
function unavailable(chatId, err) {
  removeConversation(chatId);
  if (active === chatId || active === null) {
    active = null;
    setUrlChat(null);
  }
  notice(err.status === 404 || err.code === "not_found"
    ? `There is no conversation “${chatId}”: the link is wrong, or it was deleted. Type below to start a new one.`
    : `${err.message} Type below to start a new one.`);
  scheduleRender();
}

async function openChat(m) {
  let since = m.since;
  if (!m.loaded) {
    try {
      since = await loadHistory(m);
    } catch (err) {
      if (err.status === 404 || err.status === 403) {
        unavailable(m.chatId, err);
        return;
      }
      if (!blocked) m.error = `Could not load this conversation. ${err.message} Retrying when reconnected.`;
      scheduleRender();
      return;
    }
    m.since = since;
  }
  if (active !== m.chatId) return;
  loadClientTools(m);
  m.since = null; // used once: later subscribes resume from the client's own position
  // create: false: opening a conversation never creates one (a link to a deleted chat).
  client.subscribe(m.chatId, since ? { since, create: false } : { create: false }).catch((err) => {
    if (err?.code === "not_found" || err?.code === "forbidden") unavailable(m.chatId, err);
    else notice(describe(err));
  });
  scheduleRender();
}

/** A fresh chat id, made here so the first message can be shown before the chat exists. */
function newChatId() {
  const bytes = crypto.getRandomValues(new Uint8Array(8));
  return `c_${[...bytes].map((b) => b.toString(16).padStart(2, "0")).join("")}`;
}

/**
 * The first message of a new chat: create it (POST, naming the agent picked), open it, then
 * send the message.
 */
async function startChat(text) {
  const chatId = newChatId();
  const agent = agentForNewChat();
  const m = model(chatId);
  const clientMsgId = newClientMsgId();
  m.pending.set(clientMsgId, { text, state: "sending", error: null });
  m.loaded = true;
  active = chatId;
  scheduleRender();
  let c;
  try {
    c = await client.createConversation({ chat_id: chatId, agent });
  } catch (err) {
    err = plainError(err);
    models.delete(chatId);
    if (active === chatId) {
      active = null;
      const input = $("input");
      if (!input.value.trim()) {
        input.value = text; // not sent: the text comes back, to send again
        autosize();
      }
    }
    if (!blocked) notice(`Your message was not sent. ${err.message}`);
    scheduleRender();
    return;
  }
  upsertConversation({ ...c, created: true });
  m.since = { seq: c.last_seq, epoch: c.epoch };
  if (active === chatId) {
    setUrlChat(chatId);
    await openChat(m);
  }
  deliver(m, clientMsgId, text);
}

function deliver(m, clientMsgId, text) {
  client.sendMessage(m.chatId, text, { clientMsgId }).then(
    () => {
      const p = m.pending.get(clientMsgId);
      if (p) p.state = "sent";
      scheduleRender();
    },
    (err) => {
      const p = m.pending.get(clientMsgId);
      if (p && err?.code === "text_too_long") {
        // Refused as too long (a limit this page did not know): the text goes back in the
        // box, to shorten, rather than into a failed bubble.
        m.pending.delete(clientMsgId);
        const input = $("input");
        if (m.chatId === active && !input.value.trim()) {
          input.value = p.text;
          autosize();
        }
        hint(`Too long to send: ${describe(err)} Shorten it and send again.`, "too-long");
      } else if (p) {
        p.state = "failed";
        p.error = describe(err);
      }
      scheduleRender();
    },
  );
}

/**
 * Why `text` is too long to send, in words (null when it fits): the gateway would refuse it,
 * so it is never sent, and the text stays where the person can shorten it.
 */
function tooLong(text) {
  const bytes = new TextEncoder().encode(text).length;
  if (bytes <= maxTextBytes) return null;
  const number = (n) => n.toLocaleString("en");
  // Over by this many bytes: as many plain letters (accents and emoji take 2 to 4 each).
  return `Too long to send: shorten it by about ${number(bytes - maxTextBytes)} characters. `
    + `A message can be up to ${number(maxTextBytes)} bytes (as many plain letters; `
    + "accents and emoji take 2 to 4 each).";
}

/** The composer's text is too long (or fits again): say so under it, and mark it. */
function checkLength() {
  const input = $("input");
  const why = tooLong(input.value.trim());
  if (why) {
    hint(why, "too-long");
    input.setAttribute("aria-invalid", "true");
  } else if (input.hasAttribute("aria-invalid")) {
    input.removeAttribute("aria-invalid");
    if ($("composer-hint").dataset.kind === "too-long") hint();
  }
  return !why;
}

function send() {
  if (blocked) return;
  const input = $("input");
  const text = input.value.trim();
  if (!text) return;
  const m = active ? model(active) : null;
  if (m?.status === "running") {
    // Not queued: the answer may change what the user wants to say. The text stays.
    hint("The agent is still answering: press Stop, or wait and then send.", "busy");
    return;
  }
  if (!checkLength()) {
    input.focus();
    return; // not sent: it stays in the box, to shorten
  }
  hint();
  input.value = "";
  autosize();
  if (!m) {
    startChat(text);
    return;
  }
  const clientMsgId = newClientMsgId();
  m.pending.set(clientMsgId, { text, state: "sending", error: null });
  deliver(m, clientMsgId, text);
  scheduleRender();
}

function stop() {
  if (!active) return;
  const m = model(active);
  client.cancel(active, m.turnId ?? undefined).catch((err) => notice(describe(err)));
  $("input").focus(); // Stop disappears when the turn ends: keep the focus somewhere useful
}

// --- rename and delete (HTTP; every device hears it through the feed) ---------------------

function startRename(chatId) {
  editingTitle = chatId;
  confirmingDelete = null;
  renderSidebar();
  const input = document.querySelector(`[data-chat-id="${CSS.escape(chatId)}"] .rename-input`);
  input?.focus();
  input?.select();
}

async function saveRename(chatId, value) {
  const title = value.trim().replace(/\s+/g, " ");
  const c = conversations.get(chatId);
  editingTitle = null;
  if (!title || title === (c?.title ?? "")) {
    scheduleRender();
    return;
  }
  if (c) c.title = title; // shown at once; the feed confirms it
  scheduleRender();
  try {
    upsertConversation(await api("PATCH", `/v1/conversations/${encodeURIComponent(chatId)}`, { title }));
  } catch (err) {
    if (!blocked) notice(`Could not rename it. ${err.message}`);
    loadConversations().catch(() => {});
  }
  scheduleRender();
}

async function deleteChat(chatId) {
  confirmingDelete = null;
  try {
    await api("DELETE", `/v1/conversations/${encodeURIComponent(chatId)}`);
  } catch (err) {
    if (err.status !== 404) {
      if (!blocked) notice(`Could not delete it. ${err.message}`);
      scheduleRender();
      return;
    }
  }
  removeConversation(chatId);
  closeDrawer();
  $("input").focus();
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
  if (!editing) return false;
  const value = text.trim();
  if (!value) return false;
  const why = tooLong(value);
  if (why) {
    notice(why); // the editor stays open, with the text
    return false;
  }
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

/**
 * Every message was undone (the head is before the first one): fetch the first messages'
 * versions (GET …/tree), to offer them back. Once per such head.
 */
function loadRoots(m) {
  const tree = client?.tree(m.chatId);
  if (!tree?.headKnown || tree.head != null || m.rootsAt === tree.headSeq) return;
  const at = tree.headSeq;
  m.rootsAt = at;
  api("GET", `/v1/conversations/${encodeURIComponent(m.chatId)}/tree`).then((t) => {
    if (m.rootsAt !== at) return;
    const byId = new Map((t.nodes ?? []).map((n) => [n.id, n]));
    m.roots = (t.roots ?? []).map((id) => ({ id, preview: byId.get(id)?.preview ?? "" }));
  }, () => {
    if (m.rootsAt === at) m.rootsAt = null; // tried again at the next render
  }).finally(() => { if (m.chatId === active) scheduleRender(); });
}

/** A refusal from the gateway (a GatewayError), in words for people. */
function describe(err) {
  const text = {
    turn_in_progress: "The agent is still answering: wait, or press Stop.",
    text_too_long: "That message is too long.",
    forbidden: "That conversation belongs to someone else.",
    not_found: "That conversation does not exist any more.",
    no_active_turn: "Nothing to stop.",
    conflict: "This conversation changed on another device meanwhile: nothing was done.",
    not_on_path: "That message is not on the conversation shown any more.",
    nothing_to_retry: "There is no answer to retry.",
    nothing_to_undo: "There is nothing to undo.",
    rate_limited: "Slow down: the gateway is rate limiting this page.",
    disconnected: "The connection dropped before the gateway answered: try again.",
    not_connected: "Not connected: try again once the page says Connected.",
  }[err?.code];
  return text ?? "The gateway could not do that: try again.";
}

// --- notices, hints and announcements ------------------------------------------------------

/** A notice stays until dismissed or replaced (sticky ones cannot be dismissed). */
function notice(text, { sticky = false } = {}) {
  const box = $("notice");
  if (box.dataset.sticky === "true" && !sticky) return; // the sign-in problem comes first
  // `text` between backticks is a command: shown as code, never broken across lines.
  $("notice-text").replaceChildren(...text.split("`").map((part, i) => (i % 2 ? h("code", { text: part }) : part)));
  box.dataset.sticky = String(sticky);
  $("notice-close").hidden = sticky;
  box.hidden = false;
}

function dismissNotice() {
  const box = $("notice");
  if (box.dataset.sticky === "true") return;
  box.hidden = true;
  $("input").focus();
}

const KEYS_HINT = "Enter to send, Shift+Enter for a new line";

/** The line under the message box: the keys, or why Enter did nothing. */
function hint(text = null, kind = "keys") {
  const box = $("composer-hint");
  box.textContent = text ?? KEYS_HINT;
  box.dataset.kind = text ? kind : "keys";
}

/** Said once to screen readers (the transcript's own additions are announced by the log). */
function announce(text) {
  const box = $("announcer");
  box.textContent = "";
  setTimeout(() => { box.textContent = text; }, 50); // a change, even when the same words
}

/** The token was refused: say what to do, and turn off everything that needs it. */
function signedOut(expired) {
  if (blocked) return;
  blocked = true;
  try { sessionStorage.removeItem(TOKEN_KEY); } catch { /* nothing kept */ }
  client?.close();
  const what = expired ? "Your sign-in has expired." : "Your sign-in was not accepted.";
  notice(`${what} Open the page again with the link printed by \`gateway serve --dev\` `
    + "(it ends in ?token=…), or sign in again.", { sticky: true });
  renderConnection({ state: "closed", code: expired ? 4011 : 4001 });
  scheduleRender();
}

// --- the drawer (phones) ---------------------------------------------------------------------

function openDrawer() {
  $("app").dataset.drawer = "open";
  $("open-drawer").setAttribute("aria-expanded", "true");
  $("scrim").hidden = false;
  $("chat").inert = true; // a modal drawer: focus stays in it
  ($("conversations").querySelector('[aria-current="true"] .select') ?? $("new-chat")).focus();
}

function closeDrawer() {
  if ($("app").dataset.drawer !== "open") return;
  const hadFocus = $("sidebar").contains(document.activeElement);
  $("app").dataset.drawer = "closed";
  $("open-drawer").setAttribute("aria-expanded", "false");
  $("scrim").hidden = true;
  $("chat").inert = false;
  if (hadFocus) $("open-drawer").focus();
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

/**
 * Make `parent`'s children `nodes`, moving only what changed: a node that stays is not
 * taken out and put back (the log would announce it again, and focus inside it would drop).
 */
function reconcile(parent, nodes) {
  nodes.forEach((node, i) => {
    const at = parent.children[i];
    if (at !== node) parent.insertBefore(node, at ?? null);
  });
  while (parent.children.length > nodes.length) parent.lastElementChild.remove();
}

function conversationTitle(c) {
  return c?.title || "New chat";
}

function render() {
  renderSidebar();
  renderChat();
}

const sidebarNodes = new Map();

function toolButton(text, testId, label, onClick, cls = "tool") {
  const b = h("button", { type: "button", class: cls, "data-testid": testId, "aria-label": label, title: label, text });
  b.addEventListener("click", onClick);
  return b;
}

/** The row's controls for the open chat: Rename, Delete (then a confirmation), or the title editor. */
function rowActions(c) {
  const id = c.chat_id;
  if (editingTitle === id) {
    const input = h("input", {
      class: "rename-input", "data-testid": "rename-input", "aria-label": "Conversation title",
      maxlength: 200, value: c.title ?? "",
    });
    input.value = c.title ?? "";
    const cancel = () => { editingTitle = null; scheduleRender(); $("conversations").querySelector(`[data-chat-id="${CSS.escape(id)}"] .select`)?.focus(); };
    input.addEventListener("keydown", (ev) => {
      if (ev.key === "Enter" && !ev.isComposing) { ev.preventDefault(); saveRename(id, input.value); }
      else if (ev.key === "Escape") { ev.preventDefault(); ev.stopPropagation(); cancel(); }
    });
    return h("div", { class: "row-edit" }, input,
      toolButton("Save", "rename-save", "Save the title", () => saveRename(id, input.value), "row-button"),
      toolButton("Cancel", "rename-cancel", "Cancel renaming", cancel, "row-button"));
  }
  if (confirmingDelete === id) {
    return h("div", { class: "row-confirm", role: "group", "aria-label": "Delete this conversation?" },
      h("span", { class: "row-question", text: "Delete it for good?" }),
      toolButton("Delete", "delete-confirm", `Delete “${conversationTitle(c)}” for good`, () => deleteChat(id), "row-button danger"),
      toolButton("Keep", "delete-cancel", "Keep this conversation", () => {
        confirmingDelete = null;
        scheduleRender();
        requestAnimationFrame(() => $("conversations").querySelector(`[data-chat-id="${CSS.escape(id)}"] [data-testid="delete"]`)?.focus());
      }, "row-button"));
  }
  return h("div", { class: "row-actions" },
    toolButton("Rename", "rename", `Rename “${conversationTitle(c)}”`, () => startRename(id), "row-icon"),
    toolButton("Delete", "delete", `Delete “${conversationTitle(c)}”`, () => {
      confirmingDelete = id;
      editingTitle = null;
      renderSidebar();
      $("conversations").querySelector(`[data-chat-id="${CSS.escape(id)}"] [data-testid="delete-cancel"]`)?.focus();
    }, "row-icon"));
}

function renderSidebar() {
  const list = $("conversations");
  const sorted = [...conversations.values()].sort((a, b) => (b.updated_at - a.updated_at) || a.chat_id.localeCompare(b.chat_id));
  const nodes = sorted.map((c) => {
    let li = sidebarNodes.get(c.chat_id);
    if (!li) {
      li = h("li", { class: "conversation", "data-testid": "conversation", "data-chat-id": c.chat_id });
      const select = h("button", { type: "button", class: "select" },
        h("span", { class: "title", "data-testid": "conversation-title" }),
        h("span", { class: "badge", "data-testid": "conversation-status" }),
        h("span", { class: "shared", "data-testid": "conversation-shared" }),
        h("span", { class: "preview", "data-testid": "conversation-preview" }));
      select.addEventListener("click", () => selectChat(c.chat_id));
      li.append(select, h("div", { class: "row-slot" }));
      sidebarNodes.set(c.chat_id, li);
    }
    const isActive = c.chat_id === active;
    li.dataset.status = c.status;
    li.classList.toggle("active", isActive);
    const select = li.querySelector(".select");
    if (isActive) select.setAttribute("aria-current", "true");
    else select.removeAttribute("aria-current");
    const title = li.querySelector(".title");
    const hasGoal = !!c.goal_state?.active;
    title.textContent = conversationTitle(c);
    if (hasGoal) title.prepend(h("span", { class: "goal-dot", title: "active goal", "aria-label": "active goal: ", text: "◎" }));
    li.querySelector(".badge").textContent = c.status === "running" ? "running" : "";
    li.querySelector(".preview").textContent = c.preview ?? "";
    const share = sharing.get(c.chat_id);
    const sharedText = !share || me == null ? "" : share.owner !== me ? `shared by ${share.owner}`
      : Object.keys(share.members).length ? "shared" : "";
    li.querySelector(".shared").textContent = sharedText;
    // The row's controls, for the open chat only; rebuilt only when their state changes
    // (rebuilding would take the focus away from them).
    const slot = li.querySelector(".row-slot");
    // Rename and Delete are the owner's (a member's or a viewer's would be refused).
    const owns = myRole(c.chat_id) !== "member" && myRole(c.chat_id) !== "viewer";
    const state = !isActive || blocked || !owns ? "" : `${editingTitle === c.chat_id ? "edit" : confirmingDelete === c.chat_id ? "confirm" : "tools"}:${conversationTitle(c)}`;
    if (slot.dataset.state !== state) {
      slot.dataset.state = state;
      if (state) slot.replaceChildren(rowActions(c));
      else slot.replaceChildren();
    }
    li.classList.toggle("editing", editingTitle === c.chat_id && isActive);
    return li;
  });
  for (const id of [...sidebarNodes.keys()]) if (!conversations.has(id)) sidebarNodes.delete(id);
  reconcile(list, nodes);
  $("new-chat").disabled = blocked;
}

// A turn that ended without its answer, in words (the turn's controls offer Retry).
const FAILED = {
  error: "The agent failed: its answer did not come.",
  timeout: "The agent did not answer in time.",
};

/** What went wrong with a turn, in words: the agent's own (turn_end's `error`), or ours. */
function failureText(it) {
  if (!it || !FAILED[it.reason]) return null;
  return it.reason === "error" && it.error ? it.error : FAILED[it.reason];
}

function formatLatency(ms) {
  if (ms == null) return "";
  return ms < 1000 ? `${ms} ms` : `${(ms / 1000).toFixed(ms < 10000 ? 2 : 1)} s`;
}

/** Who wrote a message, for screen readers (sighted people see it from the layout). */
function author(kind) {
  return h("span", { class: "sr-only", text: kind === "user" ? "You said: " : "The agent said: " });
}

/**
 * A user message's author, on a shared conversation: a name over it ("You" for this person;
 * screen readers hear "bob said:"), and someone else's on the other side.
 */
function labelAuthor(m, node, by) {
  const shared = isShared(m.chatId) && by != null;
  const name = shared ? personName(by) : "You";
  const key = `${shared}:${by}:${me}`;
  if (node.dataset.authorKey === key) return;
  node.dataset.authorKey = key;
  node.dataset.by = by ?? "";
  node.classList.toggle("others", shared && by !== me);
  const label = node.querySelector(".by");
  label.hidden = !shared;
  label.textContent = shared ? name : "";
  node.querySelector(".sr-only").textContent = `${name} said: `;
}

function authorLabel() {
  return h("div", { class: "by", "data-testid": "message-author", "aria-hidden": "true", hidden: true });
}

function itemNode(m, it) {
  if (it.kind === "tool") return it.awaiting ? promptNode(m, it) : toolNode(m, it); // they change
  let node = m.nodes.get(it.key);
  if (node) {
    if (it.kind === "user") labelAuthor(m, node, it.by);
    return node;
  }
  if (it.kind === "user" || it.kind === "assistant") {
    node = h("div", { class: `msg ${it.kind}${it.cancelled ? " cancelled" : ""}` },
      author(it.kind),
      it.kind === "user" ? authorLabel() : null,
      h("div", {
        class: "bubble", "data-testid": "message", "data-role": it.kind, "data-seq": it.seq,
        "data-node": it.node, "data-streamed": it.kind === "assistant" ? it.streamed : null,
        text: it.text,
      }));
    if (it.cancelled) node.append(h("div", { class: "meta", text: "stopped" }));
    if (it.kind === "user") labelAuthor(m, node, it.by);
  } else if (it.kind === "turn_end") {
    const failed = failureText(it);
    node = h("div", {
      class: "turn-meta", "data-testid": "turn-latency", "data-seq": it.seq,
      "data-turn-id": it.turnId, "data-reason": it.reason, "data-latency-ms": it.latency,
      title: "turn latency, measured by the gateway",
    },
    failed ? h("span", { class: "failure", "data-testid": "turn-failure", text: failed }) : null,
    h("span", { class: "latency", text: `${it.reason === "complete" ? "replied in" : it.reason === "awaiting_input" ? "asked you after" : failed ? "after" : "ended after"} ${formatLatency(it.latency)}` }),
    failed ? null : h("span", { class: "reason", text: it.reason }));
  } else {
    node = h("div", { class: "note", "data-testid": "note", "data-seq": it.seq, text: it.text });
  }
  m.nodes.set(it.key, node);
  return node;
}

/**
 * A tool the agent called: a row with its name and arguments in a line, that opens (a
 * <details>: a button to keyboards and screen readers) on its arguments and its result.
 */
function toolNode(m, it) {
  let node = m.nodes.get(it.key);
  if (!node) {
    const known = it.name != null;
    node = h("details", { class: "tool-call", "data-testid": "tool-call", "data-call-id": it.callId, "data-seq": it.seq },
      h("summary", { class: "tool-summary" },
        h("span", { class: "sr-only", text: known ? "The agent used the tool " : "A result of the tool call " }),
        h("span", { class: "tool-name", "data-testid": "tool-name", text: known ? it.name : it.callId ?? "tool" }),
        h("span", { class: "tool-brief", "data-testid": "tool-brief", text: known ? brief(it.args, 60) : "" }),
        h("span", { class: "tool-status", "data-testid": "tool-status" })),
      h("div", { class: "tool-body" },
        known ? h("div", { class: "tool-label", text: "Arguments" }) : null,
        known ? h("pre", { class: "tool-json", "data-testid": "tool-args", text: pretty(it.args) }) : null,
        h("div", { class: "tool-label", text: "Result" }),
        h("pre", { class: "tool-json", "data-testid": "tool-result" })));
    m.nodes.set(it.key, node);
  }
  const has = it.result !== undefined;
  // Still running while its turn runs; a turn that ended without a result left it unanswered
  // (a client tool's call waits for a person's answer).
  const status = has ? "done" : it.awaiting ? "waiting for an answer"
    : m.status === "running" && m.turnId === it.node ? "running…" : "no result";
  node.dataset.state = has ? "done" : status === "no result" ? "none" : "running";
  const statusNode = node.querySelector(".tool-status");
  if (statusNode.textContent !== status) statusNode.textContent = status;
  const result = node.querySelector('[data-testid="tool-result"]');
  const text = has ? pretty(it.result) : status === "no result" ? "(none)" : "(not yet)";
  if (result.textContent !== text) result.textContent = text;
  return node;
}

// --- client tools: the agent asks the person --------------------------------------------

/** A JSON Schema's type, when it names one ("integer" and "number" alike are numbers). */
function schemaType(schema) {
  if (!schema || typeof schema !== "object") return null;
  let type = schema.type;
  if (Array.isArray(type)) type = type.find((t) => t !== "null") ?? null;
  if (!type && Array.isArray(schema.enum)) type = "enum";
  if (!type && schema.properties) type = "object";
  return typeof type === "string" ? type : null;
}

/** "tip_percent" -> "Tip percent": a property's name in words (its schema's title first). */
function words(name, schema) {
  if (typeof schema?.title === "string" && schema.title.trim()) return schema.title.trim();
  const text = String(name).replace(/[_-]+/g, " ").replace(/([a-z])([A-Z])/g, "$1 $2").trim().toLowerCase();
  return text ? text[0].toUpperCase() + text.slice(1) : String(name);
}

/** The two answers of a yes-or-no property: Approve and Reject for an approval. */
function yesNo(name) {
  return /^(approved?|accept(ed)?|allow(ed)?|confirm(ed)?|ok)$/i.test(name) ? ["Approve", "Reject"] : ["Yes", "No"];
}

/**
 * How a person answers a client tool, from its `result` JSON Schema:
 * - none (any answer): a text box, whose text is the answer;
 * - an object: a field per property (a string enum is a choice, a string a text box, a
 *   number a number box, another boolean a checkbox, anything else JSON), and its first
 *   boolean property (`approved`) is the pair of buttons that send it (Approve, Reject);
 * - a boolean: the pair of buttons; a string, a number, an enum: one field.
 */
function answerShape(schema) {
  const type = schemaType(schema);
  if (type === "object") {
    const props = Object.entries(schema.properties ?? {});
    const required = new Set(Array.isArray(schema.required) ? schema.required : []);
    const decide = props.find(([, s]) => schemaType(s) === "boolean")?.[0] ?? null;
    const fields = props.filter(([name]) => name !== decide)
      .map(([name, s]) => ({ name, schema: s, kind: fieldKind(s), required: required.has(name) }));
    if (!props.length) fields.push({ name: null, schema: {}, kind: "json", required: true });
    return { kind: "object", decide, fields };
  }
  if (type === "boolean") return { kind: "boolean", decide: "answer", fields: [] };
  if (!type) return { kind: "value", decide: null, fields: [{ name: null, schema: schema ?? {}, kind: schema ? "json" : "text", required: true }] };
  return { kind: "value", decide: null, fields: [{ name: null, schema, kind: fieldKind(schema), required: true }] };
}

function fieldKind(schema) {
  const type = schemaType(schema);
  if (Array.isArray(schema?.enum) && schema.enum.length && schema.enum.every((v) => typeof v === "string" || typeof v === "number")) return "choice";
  if (type === "string") return "text";
  if (type === "number" || type === "integer") return "number";
  if (type === "boolean") return "check";
  return "json";
}

let fieldIds = 0;

/** A labelled control for one field of an answer; `read()` gives its value (undefined: none). */
function answerField(field, what) {
  const id = `answer-${++fieldIds}`;
  const schema = field.schema ?? {};
  const label = field.name == null ? what : words(field.name, schema);
  const help = typeof schema.description === "string" && schema.description.trim() ? schema.description.trim() : null;
  const helpId = help ? `${id}-help` : null;
  const common = { id, "data-testid": "answer-field", "data-field": field.name ?? "", "aria-describedby": helpId };
  let control;
  let read;
  if (field.kind === "choice") {
    control = h("select", { ...common, class: "answer-input" },
      h("option", { value: "", text: "Choose…" }),
      ...schema.enum.map((v, i) => h("option", { value: String(i), text: String(v) })));
    read = () => (control.value === "" ? undefined : schema.enum[Number(control.value)]);
  } else if (field.kind === "number") {
    control = h("input", { ...common, class: "answer-input", type: "number", inputmode: "decimal",
      step: schemaType(schema) === "integer" ? "1" : "any", min: schema.minimum, max: schema.maximum });
    read = () => (control.value.trim() === "" ? undefined : Number(control.value));
  } else if (field.kind === "check") {
    control = h("input", { ...common, class: "answer-check", type: "checkbox" });
    read = () => control.checked;
  } else if (field.kind === "text" && field.name != null) {
    control = h("input", { ...common, class: "answer-input", type: "text", maxlength: schema.maxLength });
    read = () => (control.value === "" ? undefined : control.value);
  } else {
    // A free answer (no schema: its text is the answer), or JSON for what has no form.
    const json = field.kind === "json";
    control = h("textarea", { ...common, class: "answer-input", rows: json ? 3 : 2,
      placeholder: json ? "JSON, or plain text" : null });
    read = () => {
      const text = control.value;
      if (!json) return text.trim() === "" ? undefined : text;
      if (text.trim() === "") return undefined;
      try { return JSON.parse(text); } catch { return text; }
    };
  }
  if (field.required) control.setAttribute("aria-required", "true");
  const row = h("div", { class: `answer-row ${field.kind}` },
    h("label", { for: id, text: label }), control,
    help ? h("span", { id: helpId, class: "answer-help", text: help }) : null);
  if (field.kind === "check") row.classList.add("inline");
  return { field, control, read, row };
}

/**
 * The form a prompt asks with, built once per call and schema and kept across renders, so
 * what the person typed stays (also when the answer is refused).
 */
function answerFormNode(m, it, tool) {
  const shape = answerShape(tool?.result ?? null);
  const key = `form:${it.callId}:${JSON.stringify(tool?.result ?? null)}`;
  let form = m.nodes.get(key);
  if (form) return form;
  for (const k of [...m.nodes.keys()]) if (k.startsWith(`form:${it.callId}:`)) m.nodes.delete(k);
  const inputs = shape.fields.map((f) => answerField(f, shape.kind === "value" && f.kind === "text" ? "Your answer" : "Answer"));
  const errorId = `answer-error-${it.callId}`;
  const buttons = [];
  if (shape.decide) {
    const [yes, no] = yesNo(shape.decide);
    buttons.push(h("button", { type: "submit", class: "tool primary answer-yes", "data-testid": "answer-yes", value: "yes", text: yes }),
      h("button", { type: "submit", class: "tool answer-no", "data-testid": "answer-no", value: "no", text: no }));
  } else {
    buttons.push(h("button", { type: "submit", class: "tool primary", "data-testid": "answer-send", value: "send", text: "Send answer" }));
  }
  form = h("form", { class: "answer-form", "data-testid": "answer-form", novalidate: true, "aria-describedby": errorId },
    ...inputs.map((i) => i.row),
    h("p", { id: errorId, class: "answer-error", "data-testid": "answer-error", role: "alert" }),
    h("div", { class: "answer-actions" }, ...buttons));
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    const choice = ev.submitter?.value ?? (shape.decide ? null : "send");
    if (!choice || m.answers.get(it.callId)?.state === "sending") return;
    const values = {};
    for (const input of inputs) {
      input.control.removeAttribute("aria-invalid");
      const v = input.read();
      if (v !== undefined) values[input.field.name] = v;
    }
    let result;
    if (shape.kind === "boolean") result = choice === "yes";
    else if (shape.kind === "value") {
      result = values[null];
      if (result === undefined) {
        refuseAnswer(m, it, "Type an answer first.", inputs[0]?.control);
        return;
      }
    } else {
      result = { ...values };
      if (shape.fields.length === 1 && shape.fields[0].name == null) result = values[null] ?? {};
      if (shape.decide) result[shape.decide] = choice === "yes";
    }
    sendAnswer(m, it, result, inputs);
  });
  m.nodes.set(key, form);
  return form;
}

/** Refused before or by the gateway: said next to the form, which keeps what was typed. */
function refuseAnswer(m, it, text, control = null) {
  m.answers.set(it.callId, { state: "invalid", error: text });
  if (control) {
    control.setAttribute("aria-invalid", "true");
    control.focus();
  }
  scheduleRender();
}

/** An answer's refusal by the gateway, in words: which field, and why (its message says). */
function invalidAnswerText(err, inputs) {
  const message = String(err?.message ?? "");
  const why = message.includes("schema: ") ? message.slice(message.lastIndexOf("schema: ") + 8) : "";
  const at = /at \['([^']+)'\]/.exec(message)?.[1];
  const input = at ? inputs.find((i) => i.field.name === at) : null;
  const missing = /'([^']+)' is a required property/.exec(why)?.[1];
  const absent = missing ? inputs.find((i) => i.field.name === missing) : null;
  let text;
  if (absent) text = `${words(missing, absent.field.schema)} is needed.`;
  else if (input && why) text = `${words(at, input.field.schema)}: ${why}.`;
  else text = why ? `${why[0].toUpperCase()}${why.slice(1)}.` : "The gateway did not accept that answer.";
  return { text: `That answer was not accepted. ${text}`, control: (input ?? absent)?.control ?? null };
}

function sendAnswer(m, it, result, inputs) {
  const answer = { state: "sending", error: null };
  m.answers.set(it.callId, answer);
  scheduleRender();
  client.answer(m.chatId, it.callId, result).then(() => {
    answer.state = "sent";
    scheduleRender();
  }, (err) => {
    if (m.answers.get(it.callId) !== answer) return;
    if (err?.code === "invalid_request") {
      const { text, control } = invalidAnswerText(err, inputs);
      refuseAnswer(m, it, text, control);
      return;
    }
    // conflict: another device answered first (its tool_result says what), or the
    // conversation went on without an answer.
    answer.state = err?.code === "conflict" ? "lost" : "failed";
    answer.error = err?.code === "conflict" ? null : describe(err);
    scheduleRender();
  });
}

/** The answer, in words: "Approved", "Rejected · note: …", or the value. */
function answerText(it, tool) {
  const shape = answerShape(tool?.result ?? null);
  const result = it.result;
  if (shape.kind === "boolean" && typeof result === "boolean") return yesNo("")[result ? 0 : 1];
  if (shape.decide && result && typeof result === "object" && typeof result[shape.decide] === "boolean") {
    const [yes, no] = yesNo(shape.decide);
    const said = result[shape.decide] ? (yes === "Approve" ? "Approved" : yes) : (no === "Reject" ? "Rejected" : no);
    const { [shape.decide]: _, ...rest } = result;
    return Object.keys(rest).length ? `${said} · ${brief(rest, 120)}` : said;
  }
  return brief(result, 160) || "(empty)";
}

/** Whether the call still waits for an answer: true, false, or null (not known yet). */
function stillAsking(m, it) {
  if (it.result !== undefined) return false;
  const live = client?.awaiting(m.chatId);
  const known = live ?? m.awaitingHttp;
  return known ? it.callId in known : null;
}

/** A question answered live: said once to screen readers (the log announces additions only). */
function announceAnswer(m, it) {
  if (m.chatId !== active || !m.subscribed) return;
  const mine = m.answers.get(it.callId);
  if (mine?.state === "sending" || mine?.state === "sent") return; // this page said it
  queueMicrotask(() => announce(`${mine?.state === "lost" ? "Another device answered first" : "Answered"}: ${answerText(it, m.tools.get(it.name))}.`));
}

/**
 * A client tool the agent called to ask the person: what it asks (the tool's name and
 * description, the arguments), and, while it waits, a form built from the tool's `result`
 * schema. Once answered (here or on another device) the form gives way to the answer.
 */
function promptNode(m, it) {
  const tool = m.tools.get(it.name) ?? null;
  let node = m.nodes.get(it.key);
  if (!node) {
    const titleId = `prompt-title-${it.callId}`;
    node = h("section", { class: "prompt", "data-testid": "prompt", "data-call-id": it.callId, "data-seq": it.seq,
      role: "group", "aria-labelledby": titleId },
    h("div", { class: "prompt-head", id: titleId },
      h("span", { class: "prompt-kicker", text: "The agent asks you:" }),
      h("span", { class: "tool-name", "data-testid": "prompt-tool", text: it.name })),
    h("p", { class: "prompt-description", "data-testid": "prompt-description" }),
    argsNode(it.args),
    h("div", { class: "prompt-body" }));
    m.nodes.set(it.key, node);
  }
  const description = node.querySelector(".prompt-description");
  const about = typeof tool?.description === "string" ? tool.description.trim() : "";
  description.hidden = !about;
  if (description.textContent !== about) description.textContent = about;

  const asking = stillAsking(m, it);
  const mine = m.answers.get(it.callId) ?? null;
  // The form waits for the tool's schema too (the history's client_tools event, or the GET).
  const state = it.result !== undefined ? "answered" : asking === false ? "unanswered"
    : asking && (tool || m.toolsSeq >= 0) ? "waiting" : "pending";
  node.dataset.state = state;
  const body = node.querySelector(".prompt-body");
  const hadFocus = node.contains(document.activeElement) && !description.contains(document.activeElement);
  let parts;
  if (state === "waiting" && readOnly(m.chatId)) {
    parts = [statusLine(m, it, "prompt-status", "Waiting for an answer. You can read this conversation, not answer here.")];
  } else if (state === "waiting") {
    const form = answerFormNode(m, it, tool);
    const error = form.querySelector(".answer-error");
    const text = mine?.state === "invalid" || mine?.state === "failed" ? mine.error ?? "" : "";
    if (error.textContent !== text) error.textContent = text;
    error.hidden = !text;
    form.dataset.state = mine?.state ?? "";
    form.setAttribute("aria-busy", String(mine?.state === "sending"));
    for (const b of form.querySelectorAll("button")) b.setAttribute("aria-disabled", String(mine?.state === "sending"));
    parts = [form];
    if (mine?.state === "sending") parts.push(statusLine(m, it, "prompt-status", client?.connected ? "Sending your answer…" : "Your answer goes out when reconnected."));
  } else if (state === "answered") {
    const said = answerText(it, tool);
    const text = mine?.state === "lost"
      ? `Sorry: another device answered first, so yours was not used. The answer: ${said}`
      : `${answeredBy(m, it, mine)}: ${said}`;
    parts = [statusLine(m, it, "prompt-answer", text, mine?.state === "lost" ? "lost" : "")];
  } else if (state === "unanswered") {
    const text = mine?.state === "lost"
      ? "Sorry: this question was closed before your answer arrived (answered elsewhere, or the conversation went on)."
      : "Not answered: the conversation went on without it.";
    parts = [statusLine(m, it, "prompt-answer", text, mine?.state === "lost" ? "lost" : "")];
  } else {
    parts = [statusLine(m, it, "prompt-status", "Waiting for an answer…")];
  }
  reconcile(body, parts);
  // The form went (answered, here or elsewhere): the focus stays in the prompt, on its outcome.
  if (hadFocus && !node.contains(document.activeElement)) parts[0].focus();
  return node;
}

/** Who answered a question: "You answered", "bob answered" (shared), or "Answered". */
function answeredBy(m, it, mine) {
  if (mine?.state === "sent") return "You answered";
  if (it.by && isShared(m.chatId)) return `${personName(it.by)} answered`;
  return "Answered";
}

/** A prompt's outcome or progress, in a line (kept while its words stay: said once). */
function statusLine(m, it, testId, text, kind = "") {
  const key = `outcome:${it.callId}:${testId}:${text}`;
  let node = m.nodes.get(key);
  if (!node) {
    for (const k of [...m.nodes.keys()]) if (k.startsWith(`outcome:${it.callId}:`)) m.nodes.delete(k);
    node = h("p", { class: `prompt-outcome ${kind}`, "data-testid": testId, tabindex: "-1", text });
    m.nodes.set(key, node);
  }
  return node;
}

/** The arguments of a question: a list of name and value (or the value, when not an object). */
function argsNode(args) {
  if (args === undefined || args === null || (typeof args === "object" && !Array.isArray(args) && !Object.keys(args).length)) {
    return h("div", { hidden: true });
  }
  if (typeof args !== "object" || Array.isArray(args)) {
    return h("pre", { class: "tool-json", "data-testid": "prompt-args", text: pretty(args) });
  }
  return h("dl", { class: "prompt-args", "data-testid": "prompt-args" },
    ...Object.entries(args).flatMap(([k, v]) => [
      h("dt", { text: words(k) }),
      h("dd", { "data-arg": k, text: typeof v === "string" ? v : pretty(v) }),
    ]));
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
    }, author("user"), authorLabel(), h("div", { class: "bubble", text: p.text }), h("div", { class: "meta", "data-role": "meta" }));
    if (failed) {
      node.append(toolButton("Dismiss", "dismiss-failed", "Dismiss this unsent message", () => {
        m.pending.delete(id);
        scheduleRender();
      }));
    }
    m.nodes.set(key, node);
  }
  labelAuthor(m, node, me);
  const meta = node.querySelector('[data-role="meta"]');
  const text = p.state === "failed" ? p.error
    : p.state === "sent" ? "sent" : client?.connected ? "sending…" : "queued: sent when reconnected";
  if (meta.textContent !== text) meta.textContent = text;
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
  const failed = kind === "turn" && isHead && failedTurn(m, nodeId);
  const key = `bar:${nodeId}:${sib.index}/${sib.ids.length}:${isHead}:${busy}:${editing}:${failed}`;
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
  if (kind === "turn" && isHead) {
    const retryButton = button("Retry", "retry", "Retry: answer this message again", retry, busy);
    // After a failed turn, Retry is what to do next: it stands out.
    if (failed) retryButton.classList.add("primary");
    parts.push(retryButton);
  }
  if (!parts.length) return null;
  node = h("div", { class: `node-bar ${kind}`, "data-testid": `${kind}-bar`, "data-node-id": nodeId }, ...parts);
  m.nodes.set(key, node);
  return node;
}

/** Whether the turn `nodeId` ended without its answer (an agent error, a timeout). */
function failedTurn(m, nodeId) {
  return m.items.some((it) => it.kind === "turn_end" && it.node === nodeId && FAILED[it.reason]);
}

/** A user message being edited in place: the text, then Send (a new version) or Cancel. */
function editorNode(m, it) {
  const key = `edit:${it.node}`;
  let node = m.nodes.get(key);
  if (node) return node;
  const input = h("textarea", { class: "edit-input", "data-testid": "edit-input", "aria-label": "Edited message", rows: 2 });
  input.value = m.editing?.text ?? it.text;
  const cancel = () => { m.editing = null; m.nodes.delete(key); scheduleRender(); };
  const save = () => {
    if (m.editing) m.editing.text = input.value;
    if (saveEdit(m, input.value) !== false) m.nodes.delete(key);
  };
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
 * The answer being written (and an attempt it started over from), if any, and under it the
 * step the agent runs now.
 */
function streamNodes(m) {
  const nodes = [];
  if (m.discarded && !m.discarded.startsWith(m.streaming)) nodes.push(discardedNode(m));
  if (m.streaming || m.discarded) nodes.push(streamingNode(m));
  if (m.steps.size) nodes.push(stepNode(m));
  return nodes;
}

/** "searching…": the step the agent started last and runs still (gone when it finishes). */
function stepNode(m) {
  let node = m.nodes.get("step");
  if (!node) {
    node = h("div", { class: "step-line", "data-testid": "step" },
      h("span", { class: "step-dot", "aria-hidden": "true" }), h("span", { class: "step-text" }));
    m.nodes.set("step", node);
  }
  const name = [...m.steps.keys()].at(-1);
  const words = `${name.replace(/[_-]+/g, " ").trim()}…`;
  node.dataset.step = name;
  node.dataset.count = String(m.steps.size);
  const text = node.lastChild;
  if (text.textContent !== words) text.textContent = words;
  return node;
}

/**
 * A turn's notes about its end ("stop requested") go after its answer, wherever they fall
 * in seq order: below the answer while it is written and once it is stored alike.
 */
function answerFirst(items) {
  const out = items.filter((it) => !it.late);
  for (const note of items.filter((it) => it.late)) {
    let at = -1;
    out.forEach((it, i) => { if (it.node === note.node && it.kind !== "turn_end") at = i + 1; });
    if (at < 0) at = out.findIndex((it) => it.node === note.node && it.kind === "turn_end");
    if (at < 0) at = out.findIndex((it) => it.seq > note.seq);
    out.splice(at < 0 ? out.length : at, 0, note);
  }
  return out;
}

/**
 * The chat's items on its active path, in order, each node's controls after its last item.
 * The answer being written goes where its turn's answer will be: after the turn's earlier
 * items, before its end notes and its controls, so nothing moves when it is stored.
 * Until the head is known (a gateway without trees), every item. `placed`: whether the
 * answer being written is among them (else it goes after the messages being sent).
 */
function pathNodes(m) {
  const tree = client?.tree(m.chatId);
  if (!tree?.headKnown) return { nodes: m.items.map((it) => itemNode(m, it)), placed: false };
  // A viewer's controls are disabled: every tree operation is a write.
  const busy = m.status === "running" || readOnly(m.chatId);
  const shown = answerFirst(m.items.filter((it) => tree.visible(it)));
  const path = tree.path();
  // The turn whose answer is being written (a plain delta with no turn: after everything).
  const writing = (m.streaming || m.discarded || m.steps.size) && m.turnId && path.includes(m.turnId) ? m.turnId : null;
  const lastOf = new Map(); // node -> index of its last item shown
  shown.forEach((it, i) => { if (it.node) lastOf.set(it.node, i); });
  const nodes = [];
  let placed = false;
  const placeStream = (node) => {
    if (placed || node !== writing) return;
    placed = true;
    nodes.push(...streamNodes(m));
  };
  shown.forEach((it, i) => {
    if (it.late || it.kind === "turn_end") placeStream(it.node);
    nodes.push(it.kind === "user" && m.editing?.msgId === it.node ? editorNode(m, it) : itemNode(m, it));
    if (!it.node || lastOf.get(it.node) !== i) return;
    if (it.kind !== "user") {
      placeStream(it.node);
      nodes.push(barNode(m, tree, it.node, "turn", busy));
      return;
    }
    nodes.push(barNode(m, tree, it.node, "user", busy));
    // Its answer has nothing to show yet (just started): its controls go here.
    const turn = path[path.indexOf(it.node) + 1];
    if (turn && !lastOf.has(turn)) {
      placeStream(turn);
      nodes.push(barNode(m, tree, turn, "turn", busy));
    }
  });
  return { nodes: nodes.filter((n) => n != null), placed };
}

/**
 * The answer being written. Not announced as it grows (aria-live off, busy): the log
 * announces the finished message once. When the agent starts over (a redelivered turn),
 * the text it had is kept, dimmed, past what the new attempt wrote, until it is passed.
 */
function streamingNode(m) {
  let node = m.nodes.get("streaming");
  if (!node) {
    node = h("div", { class: "msg assistant streaming", "data-testid": "streaming", "aria-live": "off", "aria-busy": "true" },
      h("span", { class: "sr-only", text: "The agent is writing: " }),
      h("div", { class: "bubble", "data-testid": "streaming-text" },
        h("span", { class: "fresh" }), h("span", { class: "stale", "data-testid": "streaming-stale", "aria-hidden": "true" })));
    m.nodes.set("streaming", node);
  }
  const [fresh, stale] = node.querySelector(".bubble").children;
  const rest = m.discarded.startsWith(m.streaming) ? m.discarded.slice(m.streaming.length) : "";
  if (fresh.textContent !== m.streaming) fresh.textContent = m.streaming;
  if (stale.textContent !== rest) stale.textContent = rest;
  node.dataset.deltas = String(m.deltas);
  node.dataset.restarted = String(!!m.discarded);
  return node;
}

/** Every message was undone: say so, and offer each first message back (a switch). */
function undoneNode(m) {
  const key = `undone:${readOnly(m.chatId)}:${m.roots.map((r) => r.id).join(",")}`;
  let node = m.nodes.get(key);
  if (node) return node;
  for (const k of [...m.nodes.keys()]) if (k.startsWith("undone:")) m.nodes.delete(k);
  const one = m.roots.length === 1;
  node = h("div", { class: "undone", "data-testid": "undone" },
    h("p", { text: `You undid every message. Type a new one below, or bring back ${one ? "the conversation" : "one of its versions"}:` }),
    h("div", { class: "undone-list" }, ...m.roots.map((r) => {
      const b = button(`↩ “${r.preview}”`, "bring-back", `Bring back “${r.preview}” and what followed it`, () => switchTo(m, r.id), readOnly(m.chatId));
      b.classList.add("bring-back");
      return b;
    })));
  m.nodes.set(key, node);
  return node;
}

/** The earlier attempt, when the new one does not start like it: dimmed until passed. */
function discardedNode(m) {
  let node = m.nodes.get("discarded");
  if (!node) {
    node = h("div", { class: "msg assistant discarded", "data-testid": "discarded", "aria-hidden": "true" },
      h("div", { class: "bubble" }), h("div", { class: "meta", text: "starting over…" }));
    m.nodes.set("discarded", node);
  }
  node.firstChild.textContent = m.discarded;
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
  $("empty").hidden = !!active || blocked;
  const title = conversationTitle(c);
  if ($("chat-title").textContent !== title) $("chat-title").textContent = title;
  // The agent that answers it (a conversation names one for good).
  const agentLabel = $("chat-agent");
  const agentName = c?.agent ?? "";
  agentLabel.hidden = !agentName;
  agentLabel.dataset.agent = agentName;
  if (agentLabel.lastChild.textContent !== agentName) agentLabel.lastChild.textContent = agentName;
  renderAgentPicker();
  document.title = active ? `${title} · gateway demo` : "gateway · demo chat";
  const running = m?.status === "running";
  const online = !!client?.connected;
  const status = $("chat-status");
  // Never "answering" while offline: nobody knows, and the page cannot show it.
  const statusText = running ? (online ? "agent is answering…" : "waiting for the connection…") : "";
  status.dataset.status = running ? (online ? "running" : "unknown") : "idle";
  if (status.textContent !== statusText) status.textContent = statusText;

  const usage = $("chat-usage");
  const spent = usageText(c?.usage);
  usage.hidden = !spent.text;
  if (usage.textContent !== spent.text) usage.textContent = spent.text;
  usage.title = spent.detail;

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
  renderAgentState(m);
  renderSharing(active);
  renderPresence(m);
  renderTyping(m);

  const box = $("messages");
  const nodes = [];
  if (m) {
    const path = pathNodes(m);
    nodes.push(...path.nodes);
    for (const [id, p] of m.pending) nodes.push(pendingNode(m, id, p));
    if (!path.placed) nodes.push(...streamNodes(m)); // no turn to place it in
    if (m.loaded && tree?.headKnown && tree.head == null) {
      // Everything undone: not a blank pane, and the versions there were one click away.
      loadRoots(m);
      if (m.roots.length && !m.pending.size && !path.nodes.length) nodes.push(undoneNode(m));
    }
    if (m.error) nodes.push(h("div", { class: "note", "data-testid": "chat-error", text: m.error }));
  }
  const switched = box.dataset.chatId !== (active ?? "");
  const nearBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 80;
  if (switched) box.replaceChildren(...nodes);
  else reconcile(box, nodes);
  box.dataset.chatId = active ?? "";
  if (switched || nearBottom) box.scrollTop = box.scrollHeight;

  // While an answer streams, Send becomes Stop (in the same place; Enter says so).
  // A viewer reads: nothing to send, stop or undo, and a plain word why.
  const viewer = readOnly(active);
  $("composer").dataset.disabled = String(blocked || viewer);
  $("input").disabled = blocked || viewer;
  $("read-only").hidden = !viewer || blocked;
  const send = $("send");
  const stopButton = $("stop");
  const hadFocus = document.activeElement;
  send.hidden = running && !viewer;
  send.disabled = blocked || running || viewer;
  stopButton.hidden = !running || blocked || viewer;
  if (running && hadFocus === send) stopButton.focus();
  if (!running && hadFocus === stopButton) send.focus();
  // Undo takes back the active path's last user message (there is one unless it is empty).
  const undoButton = $("undo");
  undoButton.disabled = blocked || viewer || !active || running || !tree?.headKnown || tree.head == null;
  if (!running && $("composer-hint").dataset.kind === "busy") hint();
}

// --- who is here, who is typing ----------------------------------------------------------

const ROLE_WORDS = { owner: "owner", member: "member", viewer: "can read" };

/** Who a shared chat is shared with, in the header: its owner first, then the others. */
function renderSharing(chatId) {
  const box = $("chat-sharing");
  const s = isShared(chatId) ? sharing.get(chatId) : null;
  const people = s ? [[s.owner, "owner"], ...Object.entries(s.members).sort(([a], [b]) => a.localeCompare(b))] : [];
  const key = JSON.stringify([me, people]);
  box.hidden = !s;
  if (box.dataset.key === key) return;
  box.dataset.key = key;
  box.replaceChildren(...people.map(([userId, role]) => h("li", {
    class: "sharer", "data-testid": "sharer", "data-user-id": userId, "data-role": role,
    "data-me": userId === me ? "true" : null,
  }, h("span", { class: "sharer-name", text: personName(userId) }), h("span", { class: "sharer-role", text: ` (${ROLE_WORDS[role] ?? role})` }))));
}

function plural(n, one, many) {
  return `${n} ${n === 1 ? one : many}`;
}

/**
 * Who is connected to the chat now, in the header: the person (with their devices), any
 * other people, and the agents running a turn. Nothing while not live (nobody knows).
 */
function renderPresence(m) {
  const box = $("chat-presence");
  const list = m?.subscribed ? client?.presence(m.chatId) : null;
  const users = list ? [...list.users].sort((a, b) => (b.user_id === me) - (a.user_id === me)) : [];
  const agents = list?.agents ?? [];
  const key = JSON.stringify([me, users, agents]);
  box.hidden = !list;
  if (box.dataset.key === key) return;
  box.dataset.key = key;
  box.replaceChildren(
    ...users.map((u) => {
      const devices = plural(u.connections, "device", "devices");
      const who = u.user_id === me ? "You" : u.user_id;
      return h("li", {
        class: "present", "data-testid": "present-user", "data-user-id": u.user_id,
        "data-connections": u.connections, "data-me": u.user_id === me ? "true" : null,
        title: `${u.user_id === me ? "You are" : `${u.user_id} is`} here on ${devices}`,
      }, h("span", { class: "present-name", text: who }), h("span", { class: "present-devices", text: ` · ${devices}` }));
    }),
    ...agents.map((a) => h("li", {
      class: "present present-agent", "data-testid": "present-agent", "data-agent": a.name,
      "data-workers": a.workers, title: `The agent ${a.name} is answering here`,
    }, h("span", { class: "present-name", text: a.name }), h("span", { class: "present-devices", text: " · agent" }))),
  );
}

/** "alice is typing…" for the people typing now; this person's other devices say so. */
function typingText(users) {
  const others = users.filter((u) => u !== me);
  const mine = users.includes(me);
  if (!others.length) return mine ? "You are typing on another device…" : "";
  const names = mine ? [...others, "you (on another device)"] : others;
  const list = names.length === 1 ? names[0]
    : `${names.slice(0, -1).join(", ")} and ${names.at(-1)}`;
  return `${list} ${names.length === 1 ? "is" : "are"} typing…`;
}

function renderTyping(m) {
  const box = $("typing");
  const users = m?.subscribed ? client?.typing(m.chatId) ?? [] : [];
  const text = typingText(users);
  box.dataset.users = users.join(" ");
  if (box.textContent !== text) box.textContent = text; // a change only: said once
}

/** The person types in the message box: the chat's other devices are told (throttled). */
function typed() {
  if (!active || blocked || !client?.connected || !models.get(active)?.subscribed) return;
  if (!$("input").value.trim()) return;
  // At most one `typing` per typing_interval leaves (the client keeps to it); nothing to
  // say when it does not.
  client.sendTyping(active).catch(() => {});
}

/** The agent's state, pretty: as is when it is text, else indented JSON. */
function pretty(value) {
  if (value === undefined) return "";
  if (typeof value === "string") return value;
  try { return JSON.stringify(value, null, 2) ?? String(value); } catch { return String(value); }
}

/** A state or an argument list in a line: "city: Lisbon · days: 3", else compact JSON. */
function brief(value, max = 80) {
  let text;
  if (value && typeof value === "object" && !Array.isArray(value)) {
    const keys = Object.keys(value);
    text = keys.map((k) => {
      const v = value[k];
      return `${k}: ${v !== null && typeof v === "object" ? (Array.isArray(v) ? `[${v.length}]` : "{…}") : JSON.stringify(v)}`;
    }).join(" · ");
  } else {
    text = typeof value === "string" ? value : JSON.stringify(value) ?? "";
  }
  text = text.replace(/\s+/g, " ");
  return text.length > max ? `${text.slice(0, max - 1)}…` : text;
}

/** The panel of the conversation's agent state, when it has one (collapsed: a line of it). */
function renderAgentState(m) {
  const panel = $("agent-state");
  const state = m?.state ?? null;
  panel.hidden = state === null;
  panel.dataset.seq = String(m?.stateSeq ?? "");
  if (state === null) return;
  const text = pretty(state);
  const json = $("agent-state-json");
  if (json.textContent !== text) json.textContent = text;
  const line = brief(state);
  if ($("agent-state-brief").textContent !== line) $("agent-state-brief").textContent = line;
}

let countdown = null;

const CLOSE_REASONS = {
  1012: "the gateway is restarting", 1013: "the gateway's backend is unavailable",
  4008: "the connection was too slow", 4029: "too many connections",
};

/** The connection indicator: what is happening, in words, and the real wait. */
function renderConnection(s) {
  clearTimeout(countdown);
  const box = $("connection");
  box.dataset.state = s.state;
  let label;
  const offline = s.state !== "open" && (s.reason === "offline" || globalThis.navigator?.onLine === false);
  switch (blocked ? "signed-out" : offline ? "offline" : s.state) {
    case "signed-out": label = "Not signed in"; box.dataset.state = "closed"; break;
    case "offline": label = "Offline: waiting for the network"; box.dataset.state = "offline"; break;
    case "open": label = "Connected"; break;
    case "connecting": label = everConnected ? "Reconnecting…" : "Connecting…"; break;
    case "reconnecting": {
      const why = CLOSE_REASONS[s.code] ? ` (${CLOSE_REASONS[s.code]})` : "";
      const left = s.retryAt ? s.retryAt - Date.now() : s.delay ?? 0;
      // Whole seconds only when there is a second to wait: a 0.1 s wait is "Reconnecting…".
      label = left >= 1000 ? `Reconnecting in ${Math.round(left / 1000)} s${why}` : `Reconnecting…${why}`;
      if (left >= 1000 && s.retryAt) {
        countdown = setTimeout(() => renderConnection(s), Math.min(left - 500, 1000 - ((left - 500) % 1000)));
      }
      break;
    }
    case "closed": label = "Disconnected"; break;
    default: label = "Starting…";
  }
  $("connection-label").textContent = label;
}

function autosize() {
  const input = $("input");
  input.style.height = "auto";
  const max = Math.max(64, Math.min(200, innerHeight * 0.3));
  input.style.height = `${Math.min(max, input.scrollHeight + 2)}px`;
  input.style.overflowY = input.scrollHeight + 2 > max ? "auto" : "hidden";
}

// --- boot ------------------------------------------------------------------------------

function wire() {
  $("new-chat").addEventListener("click", () => {
    selectChat(null);
    loadAgents(); // who is live now: the picker follows
    $("input").focus();
  });
  $("agent-select").addEventListener("change", () => { chosenAgent = $("agent-select").value; });
  $("open-drawer").addEventListener("click", openDrawer);
  $("close-drawer").addEventListener("click", closeDrawer);
  $("scrim").addEventListener("click", closeDrawer);
  $("notice-close").addEventListener("click", dismissNotice);
  document.addEventListener("keydown", (ev) => {
    if (ev.key === "Escape" && $("app").dataset.drawer === "open") closeDrawer();
  });
  phone.addEventListener("change", () => { if (!phone.matches) closeDrawer(); });
  $("composer").addEventListener("submit", (ev) => { ev.preventDefault(); send(); });
  $("stop").addEventListener("click", stop);
  $("undo").addEventListener("click", undo);
  $("input").addEventListener("input", () => {
    autosize();
    if ($("input").hasAttribute("aria-invalid")) checkLength(); // shortened enough yet?
    typed();
  });
  addEventListener("resize", autosize);
  $("input").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
      ev.preventDefault();
      send();
    }
  });
}

async function boot() {
  wire();
  autosize();
  if (!token) {
    blocked = true;
    notice("No sign-in. Open the page with the link printed by `gateway serve --dev` "
      + "(it ends in ?token=…).", { sticky: true });
    renderConnection({ state: "closed" });
    render();
    $("app").dataset.ready = "true";
    return;
  }

  client = new GatewayClient({ token: currentToken, maxDelay: 8000 });
  window.demo = { client, conversations, models };
  client.on("state", (s) => {
    // Never the URL or the token: only the state, the close code and the wait.
    console.info(`[gateway] ${s.state}`, s.code ?? "", s.delay != null ? `retry in ${s.delay} ms` : "");
    if (s.state === "closed" && (s.code === 4001 || s.code === 4011)) {
      signedOut(s.code === 4011 || /expired/i.test(s.reason ?? ""));
      return;
    }
    if (s.state === "closed" && s.code === 4005) {
      // An administrator ended this user's connections: the client does not come back by
      // itself. The reason is theirs, written for people.
      notice(`You were disconnected by an administrator${s.reason ? `: ${s.reason}` : ""}. `
        + "Reload the page to connect again.", { sticky: true });
    }
    renderConnection(s);
    if (s.state !== "open") for (const m of models.values()) m.subscribed = false;
    render(); // now, not at the next frame: the header stops saying "answering" with the socket
  });
  client.on("hello", (hello) => {
    maxTextBytes = hello.limits?.max_text_bytes ?? maxTextBytes;
    $("whoami").textContent = `signed in as ${hello.user_id}`;
    me = hello.user_id;
    scheduleRender(); // "You", and this person's role in each chat
    if (everConnected && active && !model(active).loaded) openChat(model(active));
    everConnected = true;
  });
  // Reconnected: the feed frames sent meanwhile are not replayed; the list catches up.
  client.on("feed_gap", () => {
    loadConversations().catch(() => {});
    loadAgents();
  });
  client.on("conversation", (f) => {
    if (f.deleted && f.removed) removedFrom(f.chat_id);
    else if (f.deleted) removeConversation(f.chat_id, true);
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
    setAgentState(m, snap.state, frame.seq); // and so does the agent's state
    // Steps are ephemeral (never replayed): those that ended meanwhile went unheard.
    if (snap.status !== "running") m.steps.clear();
    if (snap.title) setTitle(chatId, snap.title, frame.seq);
    const c = conversations.get(chatId);
    if (c && snap.usage && frame.seq >= (c.seq ?? -1)) c.usage = snap.usage;
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
    const m = models.get(chatId);
    if (!m) return;
    if (stream && stream.type === "delta") {
      // Text that does not go on from what is shown: the agent started over. Keep what
      // was shown (dimmed) until the new attempt passes it, so the answer never shrinks.
      if (m.streaming && !stream.text.startsWith(m.streaming) && m.streaming.length > m.discarded.length) {
        m.discarded = m.streaming;
      }
      m.streaming = stream.text;
      m.deltas = stream.pos;
      if (m.discarded && m.streaming.length >= m.discarded.length) m.discarded = "";
    } else if (!stream && ended !== "committed") {
      // Discarded (the turn was redelivered: the agent starts over) or gone while we were
      // away: keep it, dimmed, until the next attempt passes it or the answer is stored.
      if (m.streaming.length > m.discarded.length) m.discarded = m.streaming;
      m.streaming = "";
      m.deltas = 0;
    }
    if (chatId === active) scheduleRender();
  });
  client.on("presence", ({ chatId }) => { if (chatId === active) scheduleRender(); });
  // Who shares a chat changed (a member made a viewer reads from now on); removed: it closes.
  client.on("members", ({ chatId, owner, members }) => setSharing(chatId, owner, members));
  client.on("removed", ({ chatId }) => removedFrom(chatId));
  client.on("typing", ({ chatId }) => { if (chatId === active) scheduleRender(); });
  client.on("offline", () => renderConnection({ state: "reconnecting", reason: "offline" }));
  client.on("recovery", ({ chatId }) => {
    // The gateway could not replay what we missed: start over from the HTTP history.
    const m = model(chatId);
    resetModel(m);
    loadHistory(m).catch((err) => { m.error = `Could not reload this conversation. ${err.message}`; }).finally(scheduleRender);
  });
  client.on("error", (f) => {
    if (f.code === "rate_limited") notice(describe(f));
  });
  // The sign-in was renewed without a reconnect, or could not be (the socket closes at the
  // old token's expiry, and the page reconnects with the newest sign-in, or says it expired).
  client.on("token_refreshed", ({ expiresAt }) => {
    console.info("[gateway] token refreshed in band, valid until", new Date(expiresAt).toISOString());
  });
  client.on("token_refresh_failed", ({ error }) => {
    console.info("[gateway] no in-band token refresh:", error.code);
  });
  client.connect();

  const listed = loadConversations().catch((err) => {
    if (!blocked) notice(`Could not load your conversations. ${err.message}`);
  });
  const agentsListed = loadAgents();
  const wanted = params.get("chat");
  if (wanted) await selectChat(wanted);
  await listed;
  await agentsListed;
  scheduleRender();
  $("app").dataset.ready = "true";
}

boot();
