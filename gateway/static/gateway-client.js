// @ts-check
// gateway-client.js: a client for the gateway wire protocol v1 (see protocol.md).
//
// One ES module, no dependencies, no build step. Works in browsers and in any runtime with a
// WHATWG WebSocket (Node 22+, Deno, Bun), or pass `WebSocket` in the options.
//
//   import { GatewayClient } from "/static/gateway-client.js";
//   const client = new GatewayClient({ token: () => fetchToken() });
//   client.on("event", (frame) => render(frame));
//   client.on("recovery", ({ chatId }) => reloadHistory(chatId));
//   client.connect();
//   await client.subscribe("trip");
//   await client.sendMessage("trip", "plan a day in Lisbon");
//
// What it does for you:
// - keeps the token out of URLs: before each socket it trades the token for a single-use
//   connection ticket (POST /v1/ws-ticket) and connects with `?ticket=` (option useTicket);
// - reconnects at once (with a little jitter) when an open socket goes, with exponential
//   backoff and full jitter only for attempts that failed; stops on the terminal close codes
//   (4001, 4003, 4004, 4005); asks the token callback again on every attempt (so 4011 gets a
//   fresh one);
// - refreshes the token in band: on `token_expiring` it asks the token callback for a fresh
//   token and sends `refresh`, so the connection, its subscriptions and buffers go on (no
//   reconnect, no replay); a refused refresh leaves the 4011 at expiry to reconnect as before;
// - notices a dead network: a ping after 5 s of silence (2 s while an answer streams), and a
//   socket that does not answer within 5 s (2.5 s) more is replaced;
// - remembers {seq, epoch} per chat, resubscribes with `since` after a reconnect, drops
//   duplicate durable events, repairs a gap by resubscribing, and tells the app with a
//   `recovery` event when the gateway answers `recovered: false` (reload history over HTTP);
// - subscribe/unsubscribe keep the gateway's per-connection buffer useful: a chat that was
//   unsubscribed on this connection is resubscribed without `since`, so the buffered frames
//   (deltas included) are drained; after a reconnect it resumes with `since` instead;
// - sendMessage() makes a client_msg_id once and reuses it for every retry; messages and
//   cancels are queued while disconnected and sent once, in order, after the resubscribes;
// - keeps each chat's conversation tree (ConversationTree: nodes, head, active path,
//   siblings) from the events, tells the app with a `head` event when the head moves, and
//   sends the tree operations retry/edit/undo/switch with the head it knows as
//   `expected_head` (two devices racing: one gets a clean `conflict`);
// - keeps each chat's client tool calls that wait for a person (awaiting()), and sends a
//   person's answer (answer(): the first answer wins, the others get `conflict`);
// - keeps who is connected to each live chat (presence(), the `presence` event: the list
//   with the highest `v`) and who is typing there (typing(), the `typing` event: heard
//   within three `typing_interval`s, not since sent their message), and sends the person's
//   own typing at most once per `typing_interval` (sendTyping()).
// - keeps who shares each conversation (members(): its owner and {user_id: role}, from the
//   feed's `conversation` frames, the `members` frames and setMembers(); role()), tells the
//   app with a `members` event, and on `removed` (its user was taken off the conversation)
//   ends that chat: forgotten, never resubscribed, the app hears `removed` with the reason.
//
// The public types live in gateway-client.d.ts; the JSDoc below uses them, and
// tests/js (tsc) checks this file against them and the .d.ts against this file.

/**
 * @import {
 *   AckFrame, AgentList, Conversation, ConnectionState, ConversationFrame, ConversationPage,
 *   CreateConversationOptions, EditOptions, ErrorFrame, EventFrame, ListAgentsOptions,
 *   ListConversationsOptions, RequestOptions, WsTicket, Members, MembersChange, MembersFrame,
 *   MembersResult, RemovedFrame, Role, SetMembersOptions,
 *   GatewayClientEvents, GatewayClientOptions, HeadMove, HelloFrame, HistoryPage, LeftFrame,
 *   PongFrame, PresenceFrame, PresenceList, RequestId, SendMessageOptions, ServerFrame,
 *   Siblings, Since, StateChange, StreamState, SubscribedEvent, SubscribedFrame,
 *   SubscribeOptions, TokenExpiringFrame, TokenRequest, TokenSource, TreeNode, TreeOpOptions,
 *   TypedFrame, RefreshedFrame,
 *   TypingFrame, UnsubscribedFrame,
 *   ConversationTree as PublicTree,
 * } from "./gateway-client.js"
 */

/**
 * A chat as the client holds it (see _chat).
 * @typedef {object} ChatState
 * @property {string} id
 * @property {"live" | "off"} want
 * @property {"none" | "live" | "buffering"} server
 * @property {string | null} epoch
 * @property {number | null} seq
 * @property {number | null} subReq
 * @property {SubscribedEvent["mode"] | null} subMode
 * @property {{resolve: (frame: SubscribedFrame | null) => void, reject: (error: GatewayError) => void}[]} waiters
 * @property {SubscribedFrame["snapshot"] | null} snapshot
 * @property {Map<string, StreamState>} streams
 * @property {boolean} resyncing
 * @property {ConversationTree} tree
 * @property {boolean} create subscribe with `create: false` when false
 * @property {string | null} agent the agent a creating subscribe names (null: the default)
 * @property {boolean} running a turn runs (tokens are expected)
 * @property {Record<string, string> | null} awaiting client tool calls waiting for a person's
 *   answer, {call_id: tool name} (null until a snapshot told)
 * @property {number} awaitingSeq the seq `awaiting` is known at: older news never changes it
 * @property {PresenceList | null} presence who is connected to it now (the highest `v` heard
 *   since it went live on this connection); null when not known
 * @property {Map<string, number>} typing user id -> when (Date.now()) their `typing` came
 * @property {ReturnType<typeof setTimeout> | undefined} typingTimer ends the oldest typing
 * @property {number} typedAt when (Date.now()) sendTyping() last sent a `typing` here
 */

/** @typedef {"message" | "cancel" | "retry" | "edit" | "undo" | "switch" | "tool_result"} OutboxKind */

/**
 * A queued message, cancel or tree operation (see _enqueue).
 * @typedef {object} OutboxEntry
 * @property {OutboxKind} kind
 * @property {{type: OutboxKind, chat_id: string, [field: string]: unknown}} frame
 * @property {(ack: AckFrame | null) => void} resolve
 * @property {(error: GatewayError) => void} reject
 * @property {number | null} reqId
 * @property {number} attempts
 * @property {boolean} written sent on the current connection
 */

/**
 * A request waiting for its answer, by request id.
 * @typedef {object} PendingRequest
 * @property {"subscribe" | "unsubscribe" | "leave" | "ping" | "typing" | "refresh" | OutboxKind} kind
 * @property {string} [chatId]
 * @property {object} [frame]
 * @property {OutboxEntry} [entry]
 * @property {(frame: ServerFrame | null) => void} [resolve]
 * @property {(error: GatewayError) => void} [reject]
 */

export const JSON_SUBPROTOCOL = "gateway.v1.json";

export const CloseCodes = Object.freeze({
  NORMAL: 1000,
  FRAME_TOO_BIG: 1009,
  SERVER_RESTART: 1012,
  BACKEND_UNAVAILABLE: 1013,
  UNAUTHORIZED: 4001,
  FORBIDDEN: 4003,
  PROTOCOL_ABUSE: 4004,
  DISCONNECTED: 4005,
  SLOW_CONSUMER: 4008,
  TOKEN_EXPIRED: 4011,
  TOO_MANY: 4029,
});

/**
 * Close codes after which reconnecting cannot help: the app must fix something first (or,
 * after 4005, an administrator disconnected the user: not reconnecting is the point).
 * @type {ReadonlySet<number>}
 */
export const TERMINAL_CLOSE_CODES = Object.freeze(new Set([4001, 4003, 4004, 4005]));
/** How long after a 1012 failed attempts keep to restartMaxDelay (ms). */
const RESTART_WINDOW = 30000;
// At most this many ticket requests at once on a reconnect (see _ticket).
const TICKET_ATTEMPTS = 4;
/** Close codes that ask for a real backoff before the next attempt (never an instant retry). */
const BUSY_CLOSE_CODES = new Set([4029, 1013]);

const REPLY_TYPES = new Set(["hello", "subscribed", "unsubscribed", "left", "ack", "pong",
  "error", "conversation", "refreshed", "token_expiring"]);
/** A `typing` shows for this many `typing_interval`s after the last one from its user. */
const TYPING_SHOWN_FOR = 3;
/** Requests whose ack carries the conversation's new head. */
const HEAD_ACKS = new Set(["message", "retry", "edit", "undo", "switch", "tool_result"]);
/**
 * Tree operations and a person's answer to a client tool: not idempotent, so never written
 * twice (see _connectionLost).
 */
const TREE_OPS = new Set(["retry", "edit", "undo", "switch", "tool_result"]);

/**
 * An error reported by the gateway (an `error` frame, or an HTTP error reply), or by the
 * client itself.
 */
export class GatewayError extends Error {
  /**
   * @param {string} code
   * @param {string} [message]
   * @param {ErrorFrame | null} [frame]
   * @param {number | null} [status]
   */
  constructor(code, message, frame = null, status = null) {
    super(message || code);
    this.name = "GatewayError";
    this.code = code;
    this.frame = frame;
    /** The HTTP status of an HTTP call's error reply; null otherwise. */
    this.status = status;
    /**
     * A refused tree operation: the conversation's head now (null: none); undefined when
     * the gateway did not say.
     * @type {string | null | undefined}
     */
    this.head = frame && "head" in frame ? frame.head ?? null : undefined;
  }
}

/**
 * A fresh, unguessable client_msg_id.
 * @returns {string}
 */
export function newClientMsgId() {
  const c = globalThis.crypto;
  if (c && typeof c.randomUUID === "function") return "m-" + c.randomUUID();
  const bytes = new Uint8Array(16);
  if (c && typeof c.getRandomValues === "function") c.getRandomValues(bytes);
  else for (let i = 0; i < bytes.length; i++) bytes[i] = Math.floor(Math.random() * 256);
  return "m-" + Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

/**
 * Exponential backoff with full jitter: uniform in [0, min(maxDelay, initialDelay * 2^attempt)).
 * @param {number} attempt
 * @param {number} [initialDelay]
 * @param {number} [maxDelay]
 * @param {() => number} [random]
 * @returns {number}
 */
export function backoffDelay(attempt, initialDelay = 500, maxDelay = 15000, random = Math.random) {
  const cap = Math.min(maxDelay, initialDelay * 2 ** Math.min(attempt, 30));
  return Math.floor(random() * cap);
}

/**
 * The HTTP origin of a WebSocket URL: ws://host/v1/ws -> http://host.
 * @param {string} url
 * @returns {string}
 */
function httpOrigin(url) {
  const u = new URL(url);
  return (u.protocol === "wss:" ? "https:" : u.protocol === "ws:" ? "http:" : u.protocol) + "//" + u.host;
}

/** @returns {string} */
function defaultUrl() {
  const loc = globalThis.location;
  if (!loc || !loc.host) throw new Error("GatewayClient: pass `url` (no page location to derive it from)");
  return (loc.protocol === "https:" ? "wss://" : "ws://") + loc.host + "/v1/ws";
}

// --- the conversation tree ----------------------------------------------------------------

/**
 * A conversation's tree as a client holds it: the nodes, the head, the active path. Pure
 * bookkeeping, the same as gateway/sdk/tree.py in the Python SDK (protocol.md, "The
 * conversation tree"):
 * - nodes are user messages (`user_message.data.msg_id`, parent `data.parent_id`: the turn it
 *   follows, or null) and turns (`turn_start.data.turn_id`, parent: the message it answers);
 *   siblings, in creation order, are versions (edits, retries);
 * - the head moves by durable `head` events; a `subscribed` snapshot, an ack and a history
 *   page tell it too, each as of a seq, and older news never moves it back (a replay after a
 *   resume carries every old move, and the snapshot already told the last one);
 * - a history page of the active path gives its `forks`: siblings not seen yet are kept as
 *   placeholders (`seen: false`) under the same parent;
 * - `recovered: false`: reset(), then reload.
 * The tree keeps no events: visible(frame) tells whether one belongs on the active path.
 */
export class ConversationTree {
  constructor() {
    /** @type {Map<string, TreeNode>} */
    this.nodes = new Map();
    /** @type {string[]} the first messages (and their edits), in creation order */
    this.roots = [];
    /** @type {string | null} */
    this.head = null;
    /** Told the head at all (null is a head too: an empty conversation's). */
    this.headKnown = false;
    /** The seq the head is known at. */
    this.headSeq = -1;
    /** @type {string[] | null} */
    this._path = null;
    /** @type {Set<string> | null} */
    this._pathSet = null;
  }

  /**
   * Forget everything (`recovered: false`: the history must be reloaded).
   * @returns {void}
   */
  reset() {
    this.nodes = new Map();
    this.roots = [];
    this.head = null;
    this.headKnown = false;
    this.headSeq = -1;
    this._changed();
  }

  /**
   * Apply one durable event frame (live, replayed, or from a history page); returns the
   * head's move when it moved. Other events, and a frame applied twice, change nothing.
   * @param {EventFrame} frame
   * @returns {HeadMove | null}
   */
  apply(frame) {
    const seq = frame.seq;
    const data = frame.data;
    if (typeof seq !== "number" || !data || typeof data !== "object") return null;
    // A person's answer to a client tool (a tool_result with msg_id) is a node of their side.
    if (frame.type === "user_message" || (frame.type === "tool_result" && "msg_id" in data)) {
      this._add(data.msg_id, "user", data.parent_id, seq);
    } else if (frame.type === "turn_start") this._add(data.turn_id, "turn", data.parent_id, seq);
    else if (frame.type === "head") {
      const head = data.head_id;
      if (head === null || typeof head === "string") {
        return this._move(head, seq, str(data.cause), str(data.by));
      }
    }
    return null;
  }

  /**
   * The head as of `seq` (a snapshot's or a page's `last_seq`, an ack's `seq`); a null seq
   * (nobody told) is taken only when no head is known yet.
   * @param {string | null} head
   * @param {number | null} seq
   * @returns {HeadMove | null}
   */
  setHead(head, seq) {
    if (seq == null) {
      if (this.headKnown) return null;
      seq = -1;
    }
    return this._move(head, seq, null, null);
  }

  /**
   * A page of `GET /v1/conversations/{chat_id}/events`: its events, its `forks` (the
   * default `view=active`) and its `head` as of its `last_seq`. Returns the head's move.
   * @param {HistoryPage} page
   * @returns {HeadMove | null}
   */
  loadPage(page) {
    /** @type {HeadMove[]} */
    const moves = [];
    for (const frame of page.events ?? []) {
      const move = this.apply(frame);
      if (move) moves.push(move);
    }
    if (page.forks && typeof page.forks === "object") this.loadForks(page.forks);
    if ("head" in page) {
      const move = this.setHead(page.head ?? null, typeof page.last_seq === "number" ? page.last_seq : null);
      if (move) moves.push(move);
    }
    if (!moves.length) return null;
    const last = /** @type {HeadMove} */ (moves.at(-1));
    return { ...last, previous: moves[0].previous };
  }

  /**
   * A page's `forks`: `{node_id: {siblings, index}}` for the path's nodes that have
   * siblings. Apply the page's events first: siblings go under their node's parent.
   * @param {Record<string, {siblings: string[], index: number}>} forks
   * @returns {void}
   */
  loadForks(forks) {
    for (const [nodeId, fork] of Object.entries(forks)) {
      const node = this.nodes.get(nodeId);
      const siblings = fork?.siblings;
      if (!node || !Array.isArray(siblings)) continue;
      const listed = siblings.filter((s) => typeof s === "string");
      for (const id of listed) {
        if (!this.nodes.has(id)) {
          this.nodes.set(id, { id, kind: node.kind, parentId: node.parentId, seq: null, seen: false, children: [] });
        }
      }
      const group = this._childrenOf(node.parentId, node.kind);
      // The page's order is the creation order; children it does not list are newer.
      const rest = group.filter((c) => !listed.includes(c));
      group.splice(0, group.length, ...listed, ...rest);
    }
    this._changed();
  }

  /**
   * The active path's node ids, from the first message to the head. It starts at the
   * oldest node whose parent the client knows of.
   * @returns {string[]}
   */
  path() {
    if (!this._path) {
      /** @type {string[]} */
      const path = [];
      let id = this.head;
      while (id != null && path.length <= this.nodes.size) {
        path.push(id);
        id = this.nodes.get(id)?.parentId ?? null;
      }
      this._path = path.reverse();
      this._pathSet = new Set(path);
    }
    return [...this._path];
  }

  /**
   * @param {string | null | undefined} nodeId
   * @returns {boolean}
   */
  onPath(nodeId) {
    if (nodeId == null) return false;
    this.path();
    return /** @type {Set<string>} */ (this._pathSet).has(nodeId);
  }

  /**
   * Whether an event belongs on the active path: its `node` is on it, or it has none.
   * @param {{node?: string | null}} frame
   * @returns {boolean}
   */
  visible(frame) {
    return frame.node == null || this.onPath(frame.node);
  }

  /**
   * The versions of a node (itself included, in creation order) and its index among them;
   * a node whose siblings the client does not know is alone.
   * @param {string} nodeId
   * @returns {Siblings}
   */
  siblings(nodeId) {
    const node = this.nodes.get(nodeId);
    const group = !node ? null : node.parentId == null ? this.roots : this.nodes.get(node.parentId)?.children;
    const index = group ? group.indexOf(nodeId) : -1;
    return index < 0 || !group ? { ids: [nodeId], index: 0 } : { ids: [...group], index };
  }

  /**
   * The siblings of every node on the active path that has some, by node id.
   * @returns {Record<string, Siblings>}
   */
  forks() {
    /** @type {Record<string, Siblings>} */
    const found = {};
    for (const id of this.path()) {
      const s = this.siblings(id);
      if (s.ids.length > 1) found[id] = s;
    }
    return found;
  }

  /**
   * Nodes of the active path whose events the client may not hold (placeholders, and
   * nodes it never heard of): reload the path's history to show it.
   * @returns {string[]}
   */
  missing() {
    return this.path().filter((id) => !this.nodes.get(id)?.seen);
  }

  _changed() {
    this._path = null;
    this._pathSet = null;
  }

  /**
   * The list a node of `childKind` under `parentId` belongs to.
   * @param {string | null} parentId
   * @param {TreeNode["kind"]} childKind
   * @returns {string[]}
   */
  _childrenOf(parentId, childKind) {
    if (parentId == null) return this.roots;
    let parent = this.nodes.get(parentId);
    if (!parent) {
      // A parent not known yet (a client that joined live): a placeholder holds its
      // children until it comes. A message's parent is a turn, a turn's a message.
      parent = { id: parentId, kind: childKind === "user" ? "turn" : "user", parentId: null, seq: null, seen: false, children: [] };
      this.nodes.set(parentId, parent);
    }
    return parent.children;
  }

  /**
   * @param {unknown} id
   * @param {TreeNode["kind"]} kind
   * @param {unknown} parentId
   * @param {number} seq
   */
  _add(id, kind, parentId, seq) {
    if (typeof id !== "string" || !(parentId === null || parentId === undefined || typeof parentId === "string")) return;
    const parent = parentId ?? null;
    let node = this.nodes.get(id);
    if (node?.seen) return;
    if (!node) {
      node = { id, kind, parentId: parent, seq, seen: true, children: [] };
      this.nodes.set(id, node);
    } else { // a placeholder (a page's fork, or a parent its children came before)
      Object.assign(node, { kind, parentId: parent, seq, seen: true });
    }
    this._changed();
    const group = this._childrenOf(parent, kind);
    if (group.includes(id)) return;
    // Creation order: before the first sibling created later (placeholders keep their places).
    let at = group.findIndex((other) => {
      const otherSeq = this.nodes.get(other)?.seq;
      return otherSeq != null && otherSeq > seq;
    });
    if (at < 0) at = group.length;
    group.splice(at, 0, id);
  }

  /**
   * @param {string | null} head
   * @param {number} seq
   * @param {string | null} cause
   * @param {string | null} by
   * @returns {HeadMove | null}
   */
  _move(head, seq, cause, by) {
    if (this.headKnown && seq < this.headSeq) return null; // older news: a later move is known
    const previous = this.head;
    const wasKnown = this.headKnown;
    this.head = head;
    this.headKnown = true;
    this.headSeq = Math.max(seq, this.headSeq);
    this._changed();
    if (wasKnown && previous === head) return null;
    return { head, previous, seq: seq >= 0 ? seq : null, cause, by };
  }
}

/**
 * @param {unknown} value
 * @returns {string | null}
 */
function str(value) {
  return typeof value === "string" ? value : null;
}

/**
 * A presence list, copied (the app gets its own).
 * @param {PresenceList} list
 * @returns {PresenceList}
 */
function copyPresence(list) {
  return {
    v: list.v,
    users: list.users.map((u) => ({ user_id: String(u.user_id), connections: Number(u.connections) })),
    agents: list.agents.map((a) => ({ name: String(a.name), workers: Number(a.workers) })),
  };
}

export class GatewayClient {
  /**
   * @param {GatewayClientOptions} [options] see gateway-client.d.ts
   */
  constructor(options = {}) {
    this.url = options.url ?? defaultUrl();
    /** @type {TokenSource} */
    this._token = options.token ?? null;
    /** @type {NonNullable<GatewayClientOptions["WebSocket"]>} */
    this._WebSocket = options.WebSocket ?? globalThis.WebSocket;
    if (typeof this._WebSocket !== "function") throw new Error("GatewayClient: no WebSocket implementation");
    this._initialDelay = options.initialDelay ?? 500;
    this._maxDelay = options.maxDelay ?? 15000;
    this._random = options.random ?? Math.random;
    this._connectTimeout = options.connectTimeout ?? 10000;
    this._rateLimitRetry = options.rateLimitRetry ?? 1000;
    // A silent dead socket is noticed within idlePing + pongTimeout (about 10 s); while an
    // answer streams, tokens are expected: within activePing + activePongTimeout (< 5 s).
    this._idlePing = options.idlePing ?? 5000;
    this._pongTimeout = options.pongTimeout ?? 5000;
    this._activePing = options.activePing ?? 2000;
    this._activePongTimeout = options.activePongTimeout ?? 2500;
    // The first reconnect after an open socket went: a whole pod's clients at once after a
    // restart (1012) or a crash, spread over this many ms rather than all in the same one.
    this._reconnectJitter = options.reconnectJitter ?? 500;
    // A gateway that said it restarts (1012) is back within seconds: for RESTART_WINDOW ms
    // after one, failed attempts wait at most restartMaxDelay, not the full backoff.
    this._restartMaxDelay = options.restartMaxDelay ?? 2000;
    this._restartAt = 0;
    this._hiddenSince = 0;
    this._offline = false;
    /** @type {typeof fetch | null} */
    this._fetch = options.fetch ?? (typeof globalThis.fetch === "function" ? globalThis.fetch.bind(globalThis) : null);
    this.httpUrl = (options.httpUrl ?? httpOrigin(this.url)).replace(/\/+$/, "");
    this._httpTimeout = options.httpTimeout ?? 10000;
    // After a lost connection the ticket request may ride a keep-alive connection that died
    // with the network: with no reply within this many ms it is sent again, on another one.
    this._ticketRetryAfter = options.ticketRetryAfter ?? 1000;
    // A ticket (single use, 30 s) rather than the token in the socket's URL, where a browser
    // would print it in the console for every failed attempt. Same origin only by default:
    // the gateway sends no CORS headers, so a page elsewhere cannot fetch one.
    const page = globalThis.location?.origin;
    this._useTicket = options.useTicket ?? (this._token != null && this._fetch != null
      && (!page || page === "null" || page === this.httpUrl));

    /** @type {Map<keyof GatewayClientEvents, Set<(event: any) => void>>} */
    this._listeners = new Map();
    /** @type {Map<string, ChatState>} */
    this._chats = new Map(); // chat_id -> ChatState (see _chat)
    /** @type {Map<string, Members>} chat_id -> who shares it (see members()) */
    this._members = new Map();
    /** @type {OutboxEntry[]} */
    this._outbox = []; // queued messages and cancels, in order; removed when answered
    /** @type {Map<RequestId, PendingRequest>} */
    this._pending = new Map(); // request id -> {kind, chatId?, entry?, resolve?, reject?}
    this._nextId = 1;

    /** @type {WebSocket | null} */
    this._ws = null;
    /** @type {HelloFrame | null} */
    this._hello = null;
    /** @type {ConnectionState} */
    this._state = "idle";
    this._stopped = true;
    this._attempt = 0;
    this._generation = 0;
    /** @type {ReturnType<typeof setTimeout> | undefined} */
    this._timer = undefined;
    /** @type {ReturnType<typeof setInterval> | undefined} */
    this._heartbeat = undefined;
    /** @type {ReturnType<typeof setTimeout> | undefined} */
    this._retryTimer = undefined;
    this._lastRx = 0;
    this._pingSent = 0;
    /** A connection was open before: the next one missed feed frames meanwhile. */
    this._wasOpen = false;
    /** @type {TokenRequest["lastClose"]} */
    this._lastClose = null;
    /** The token the current socket runs on (its handshake's, or the last refreshed one). */
    this._wsToken = /** @type {string | null} */ (null);
    /** The `expires_at` of the `token_expiring` a refresh was tried for on this socket. */
    this._refreshFor = /** @type {number | null} */ (null);
    /** Durable events dropped because their seq was already delivered. */
    this.duplicatesDropped = 0;

    // The browser knows before any timer does: say so at once, and reconnect at once.
    this._onOnline = () => {
      this._offline = false;
      this._emit("online", {});
      if (this._ws && this._hello) this._probe();
      else this.reconnectNow();
    };
    this._onOffline = () => {
      this._offline = true;
      this._emit("offline", {});
      if (this._ws) this._drop(this._ws, "offline");
    };
    // A page hidden for a while (a phone in a pocket, a laptop asleep): check the socket
    // as soon as it is seen again.
    this._onVisibility = () => {
      const doc = globalThis.document;
      if (!doc) return;
      if (doc.visibilityState === "hidden") {
        this._hiddenSince = Date.now();
      } else if (this._hiddenSince && Date.now() - this._hiddenSince > this._idlePing) {
        this._hiddenSince = 0;
        if (this._ws && this._hello) this._probe();
        else this.reconnectNow();
      }
    };
    if (typeof globalThis.addEventListener === "function") {
      globalThis.addEventListener("online", this._onOnline);
      globalThis.addEventListener("offline", this._onOffline);
      globalThis.document?.addEventListener?.("visibilitychange", this._onVisibility);
    }
  }

  // --- events ------------------------------------------------------------------------

  /**
   * Listen to an event; returns a function that removes the listener.
   * @template {keyof GatewayClientEvents} K
   * @param {K} type
   * @param {(event: GatewayClientEvents[K]) => void} listener
   * @returns {() => void}
   */
  on(type, listener) {
    let set = this._listeners.get(type);
    if (!set) this._listeners.set(type, (set = new Set()));
    set.add(listener);
    return () => this.off(type, listener);
  }

  /**
   * @template {keyof GatewayClientEvents} K
   * @param {K} type
   * @param {(event: GatewayClientEvents[K]) => void} listener
   * @returns {void}
   */
  off(type, listener) {
    this._listeners.get(type)?.delete(listener);
  }

  /**
   * @template {keyof GatewayClientEvents} K
   * @param {K} type
   * @param {GatewayClientEvents[K]} payload
   */
  _emit(type, payload) {
    const set = this._listeners.get(type);
    if (!set) return;
    for (const listener of [...set]) {
      try {
        listener(payload);
      } catch (err) {
        // A broken listener must not break the connection.
        setTimeout(() => { throw err; });
      }
    }
  }

  // --- connection --------------------------------------------------------------------

  /**
   * "idle" | "connecting" | "open" | "reconnecting" | "closed"
   * @returns {ConnectionState}
   */
  get state() { return this._state; }
  /**
   * True once `hello` arrived on the current socket.
   * @returns {boolean}
   */
  get connected() { return this._state === "open"; }
  /**
   * The `hello` frame of the current connection, or null.
   * @returns {HelloFrame | null}
   */
  get hello() { return this._hello; }
  /**
   * Messages and cancels not answered yet (queued or in flight).
   * @returns {number}
   */
  get outboxSize() { return this._outbox.length; }

  /**
   * Start connecting (again, after close() or a terminal close).
   * @returns {void}
   */
  connect() {
    if (!this._stopped) return;
    this._stopped = false;
    this._attempt = 0;
    this._open("connect");
  }

  /**
   * Replace the token (a string or a callback) used by the next connection attempt.
   * @param {TokenSource} token
   * @returns {void}
   */
  setToken(token) {
    this._token = token;
  }

  /**
   * Skip the backoff wait and try now (also done on the browser's `online` event); the
   * backoff starts over.
   * @returns {void}
   */
  reconnectNow() {
    if (this._stopped || this._state !== "reconnecting") return;
    this._attempt = 0;
    this._open("reconnect");
  }

  /**
   * Close for good (until connect()). Queued messages stay queued.
   * @returns {void}
   */
  close() {
    this._stopped = true;
    this._generation++;
    clearTimeout(this._timer);
    this._timer = undefined;
    const ws = this._ws;
    if (ws) {
      this._detach(ws);
      try { ws.close(1000, "client closed"); } catch { /* already closing */ }
    }
    this._connectionLost();
    this._setState("closed", { code: 1000, reason: "client closed", terminal: false });
    if (typeof globalThis.removeEventListener === "function") {
      globalThis.removeEventListener("online", this._onOnline);
      globalThis.removeEventListener("offline", this._onOffline);
      globalThis.document?.removeEventListener?.("visibilitychange", this._onVisibility);
    }
  }

  /**
   * @param {ConnectionState} state
   * @param {Omit<StateChange, "state" | "attempt">} [info]
   */
  _setState(state, info = {}) {
    this._state = state;
    this._emit("state", { state, attempt: this._attempt, ...info });
  }

  /**
   * @param {TokenRequest["reason"]} reason
   * @returns {Promise<string | null | undefined>}
   */
  async _getToken(reason) {
    const token = this._token;
    if (typeof token === "function") return await token({ reason, lastClose: this._lastClose });
    return token;
  }

  /** @param {"connect" | "reconnect"} reason */
  async _open(reason) {
    clearTimeout(this._timer);
    this._timer = undefined;
    const generation = ++this._generation;
    this._setState("connecting", { reason });
    let token;
    try {
      token = await this._getToken(this._lastClose?.code === 4011 ? "expired" : reason);
    } catch (/** @type {any} */ err) {
      if (generation !== this._generation || this._stopped) return;
      this._scheduleReconnect(0, "token callback failed: " + (err?.message ?? err));
      return;
    }
    if (generation !== this._generation || this._stopped) return;
    let url = this.url;
    let query = token ? "token=" + encodeURIComponent(token) : "";
    if (token && this._useTicket) {
      try {
        const { ticket } = /** @type {WsTicket} */ (await this._ticket(token, reason === "reconnect"));
        query = "ticket=" + encodeURIComponent(ticket);
      } catch (/** @type {any} */ err) {
        if (generation !== this._generation || this._stopped) return;
        if (err?.status === 401) {
          // The token itself is refused: as a socket with it would be, with 4001.
          this._onSocketClosed(CloseCodes.UNAUTHORIZED, err.message);
        } else {
          this._scheduleReconnect(0, "no connection ticket: " + (err?.message ?? err));
        }
        return;
      }
      if (generation !== this._generation || this._stopped) return;
    }
    if (query) url += (url.includes("?") ? "&" : "?") + query;
    let ws;
    try {
      ws = new this._WebSocket(url, [JSON_SUBPROTOCOL]);
    } catch (/** @type {any} */ err) {
      this._scheduleReconnect(0, "cannot open: " + (err?.message ?? err));
      return;
    }
    this._ws = ws;
    this._wsToken = token ?? null;
    this._refreshFor = null;
    this._lastRx = Date.now();
    ws.onmessage = (ev) => {
      if (this._ws !== ws) return;
      this._lastRx = Date.now();
      this._pingSent = 0;
      if (typeof ev.data !== "string") return; // JSON subprotocol: text frames only
      let frame;
      try { frame = JSON.parse(ev.data); } catch { return; }
      if (frame && typeof frame === "object") this._onFrame(/** @type {ServerFrame} */ (frame));
    };
    ws.onclose = (ev) => {
      if (this._ws !== ws) return;
      this._onSocketClosed(ev.code ?? 1006, ev.reason ?? "");
    };
    ws.onerror = () => { /* a close event follows */ };
    // No hello within connectTimeout: treat as a dropped connection.
    this._timer = setTimeout(() => {
      if (this._ws === ws && !this._hello) this._drop(ws, "connect timeout");
    }, this._connectTimeout);
  }

  /**
   * A connection ticket (POST /v1/ws-ticket). On a reconnect the network may have just
   * died under the browser's pooled keep-alive connections, and a request on one of them
   * waits out its whole timeout (nothing closes it). So a request with no reply within
   * ticketRetryAfter ms is sent again beside it (it gets another connection: the first is
   * busy), up to TICKET_ATTEMPTS at once, and one that fails without a reply is sent again
   * at once; the first ticket wins and the others are aborted, which makes the browser
   * drop their connections. A reply with an error status ends it.
   * @param {string} token
   * @param {boolean} reconnect
   * @returns {Promise<WsTicket>}
   */
  _ticket(token, reconnect) {
    if (!reconnect) return this._http("POST", "/v1/ws-ticket", token, undefined, this._httpTimeout);
    return new Promise((resolve, reject) => {
      /** @type {AbortController[]} */
      const attempts = [];
      let failed = 0;
      let done = false;
      /** @type {ReturnType<typeof setTimeout> | undefined} */
      let hedge;
      const finish = () => {
        done = true;
        clearTimeout(hedge);
        for (const controller of attempts) controller.abort();
      };
      const launch = () => {
        clearTimeout(hedge);
        if (done || attempts.length >= TICKET_ATTEMPTS) return;
        const controller = new AbortController();
        attempts.push(controller);
        if (attempts.length < TICKET_ATTEMPTS) hedge = setTimeout(launch, this._ticketRetryAfter);
        this._http("POST", "/v1/ws-ticket", token, undefined, this._httpTimeout, controller.signal).then(
          (reply) => {
            if (done) return;
            finish();
            resolve(reply);
          },
          (/** @type {any} */ err) => {
            if (done) return;
            failed++;
            if (err?.status || failed >= TICKET_ATTEMPTS) {
              finish();
              reject(err);
            } else if (attempts.length < TICKET_ATTEMPTS) {
              launch();
            }
          });
      };
      launch();
    });
  }

  /** @param {WebSocket} ws */
  _detach(ws) {
    ws.onmessage = ws.onclose = ws.onerror = null;
    if (this._ws === ws) this._ws = null;
  }

  /**
   * Abandon a socket that stopped answering and reconnect as after a network drop.
   * @param {WebSocket} ws
   * @param {string} reason
   */
  _drop(ws, reason) {
    this._detach(ws);
    try { ws.close(4000, reason); } catch { /* ignore */ }
    this._onSocketClosed(1006, reason);
  }

  /**
   * @param {number} code
   * @param {string} reason
   */
  _onSocketClosed(code, reason) {
    const ws = this._ws;
    const wasOpen = this._hello != null;
    if (ws) this._detach(ws);
    clearTimeout(this._timer);
    this._timer = undefined;
    this._lastClose = { code, reason };
    if (code === CloseCodes.SERVER_RESTART) this._restartAt = Date.now();
    this._connectionLost();
    if (this._stopped) return;
    if (TERMINAL_CLOSE_CODES.has(code)) {
      this._stopped = true;
      this._setState("closed", { code, reason, terminal: true });
      this._emit("closed", { code, reason, terminal: true });
      return;
    }
    this._emit("closed", { code, reason, terminal: false });
    this._scheduleReconnect(code, reason, wasOpen);
  }

  /** Forget everything that only lived on the socket that just went away. */
  _connectionLost() {
    this._hello = null;
    clearInterval(this._heartbeat);
    this._heartbeat = undefined;
    clearTimeout(this._retryTimer);
    this._retryTimer = undefined;
    for (const chat of this._chats.values()) {
      chat.server = "none"; // the gateway's subscription and buffer died with the socket
      chat.subReq = null;
      chat.subMode = null;
      chat.resyncing = false; // the resubscribe after reconnecting brings a snapshot
      this._forgetPresence(chat); // not known while away: the resubscribe's snapshot tells
    }
    for (const req of this._pending.values()) {
      // Unsubscribe/leave/ping are moot now; subscribes are redone on resume; messages and
      // cancels stay in the outbox and are sent again.
      if (req.resolve) req.resolve(null);
    }
    this._pending.clear();
    for (const entry of [...this._outbox]) {
      if (TREE_OPS.has(entry.kind) && entry.written) {
        // Not idempotent: it may or may not have been applied. Sending it again could apply
        // it twice; the app decides (the head events tell what happened).
        this._settle(entry);
        const what = entry.kind === "tool_result" ? "answer" : entry.kind;
        entry.reject(new GatewayError("disconnected", `the connection was lost: the ${what} may or may not have been applied`));
        continue;
      }
      entry.reqId = null;
      entry.written = false;
    }
  }

  /**
   * @param {number} code
   * @param {string} reason
   * @param {boolean} [wasOpen] the socket that went had said hello
   */
  _scheduleReconnect(code, reason, wasOpen = false) {
    let attempt = this._attempt++;
    let delay;
    if (BUSY_CLOSE_CODES.has(code)) {
      // The gateway asked for a pause: a real backoff, never an instant retry.
      attempt = Math.max(attempt, 2);
      delay = Math.max(this._initialDelay, backoffDelay(attempt, this._initialDelay, this._maxDelay, this._random));
    } else if (wasOpen && !this._offline) {
      // An open socket went (a restart's 1012, a network change, a dead socket): back at
      // once, but spread, so a pod's clients do not all arrive in the same millisecond.
      delay = Math.floor(this._random() * this._reconnectJitter);
    } else {
      // Attempts that failed: the gateway or the network is not back yet. Soon after a
      // 1012 the gateway is expected back any moment: keep the waits short.
      const restarting = this._restartAt > 0 && Date.now() - this._restartAt < RESTART_WINDOW;
      const cap = restarting ? Math.min(this._maxDelay, this._restartMaxDelay) : this._maxDelay;
      delay = backoffDelay(attempt, this._initialDelay, cap, this._random);
    }
    this._setState("reconnecting", { code, reason, delay, retryAt: Date.now() + delay });
    const generation = ++this._generation;
    this._timer = setTimeout(() => {
      if (generation === this._generation && !this._stopped) this._open("reconnect");
    }, delay);
  }

  _startHeartbeat() {
    // After idlePing ms with nothing received, a ping; nothing within pongTimeout more: the
    // socket is dead (browsers do not notice a vanished network for minutes) and replaced.
    // While an answer streams (or a turn runs) frames are expected: the shorter active ones.
    clearInterval(this._heartbeat);
    const tick = Math.max(50, Math.min(this._idlePing, this._pongTimeout, this._activePing, this._activePongTimeout) / 20);
    this._heartbeat = setInterval(() => {
      const ws = this._ws;
      if (!ws || !this._hello) return;
      const active = this._expecting();
      const now = Date.now();
      const pongWait = active ? Math.min(this._pongTimeout, this._activePongTimeout) : this._pongTimeout;
      const pingAfter = active ? Math.min(this._idlePing, this._activePing) : this._idlePing;
      if (this._pingSent && now - this._pingSent > pongWait) {
        this._drop(ws, "no answer to ping");
      } else if (now - this._lastRx > pingAfter && !this._pingSent) {
        this._probe();
      }
    }, tick); // 100 ms with the defaults
  }

  /**
   * Whether frames are expected now: a chat the app wants live has an open stream or a
   * running turn.
   * @returns {boolean}
   */
  _expecting() {
    for (const chat of this._chats.values()) {
      if (chat.want === "live" && (chat.running || chat.streams.size > 0)) return true;
    }
    return false;
  }

  /** Ask the gateway for a sign of life now; the heartbeat drops the socket without one. */
  _probe() {
    if (this._pingSent) return;
    this._pingSent = Date.now();
    this._send({ type: "ping", id: this._nextId++ });
  }

  /**
   * @param {object} frame
   * @returns {boolean}
   */
  _send(frame) {
    const ws = this._ws;
    if (!ws || ws.readyState !== 1) return false;
    ws.send(JSON.stringify(frame));
    return true;
  }

  /**
   * Round-trip time to the gateway in ms (rejects when not connected).
   * @returns {Promise<number>}
   */
  ping() {
    if (!this.connected) return Promise.reject(new GatewayError("not_connected", "not connected"));
    return new Promise((resolve, reject) => {
      const id = this._nextId++;
      const started = Date.now();
      this._pending.set(id, {
        kind: "ping",
        resolve: (frame) => (frame ? resolve(Date.now() - started) : reject(new GatewayError("disconnected", "connection lost"))),
        reject,
      });
      this._send({ type: "ping", id });
    });
  }

  // --- HTTP ----------------------------------------------------------------------------

  /**
   * A call of the gateway's HTTP API (protocol.md, "HTTP API") with the client's token, and
   * a timeout: resolves with the decoded JSON reply (null for none). Rejects with a
   * GatewayError: the reply's error `code` and `status`, or code "timeout" (no reply within
   * `timeout` ms, default the `httpTimeout` option), "network" (no connection) or "aborted".
   * @param {string} method
   * @param {string} path
   * @param {RequestOptions} [options]
   * @returns {Promise<any>}
   */
  async request(method, path, options = {}) {
    const token = await this._getToken("request");
    return this._http(method, path, token ?? null, options.body, options.timeout ?? this._httpTimeout, options.signal);
  }

  /**
   * The caller's conversations, newest change first (`GET /v1/conversations`), asked again
   * until it succeeds: each attempt times out after `timeout` ms (default the `httpTimeout`
   * option), and one that fails for want of a network or a gateway is retried after a
   * backoff. An error reply (401, 400) rejects; so does `signal` aborting. Call it on load
   * and on every `feed_gap`.
   * @param {ListConversationsOptions} [options]
   * @returns {Promise<ConversationPage>}
   */
  async listConversations(options = {}) {
    const params = new URLSearchParams();
    if (options.limit != null) params.set("limit", String(options.limit));
    if (options.cursor != null) params.set("cursor", String(options.cursor));
    const query = params.toString();
    const path = "/v1/conversations" + (query ? "?" + query : "");
    for (let attempt = 0; ; attempt++) {
      try {
        return await this.request("GET", path, { timeout: options.timeout, signal: options.signal });
      } catch (/** @type {any} */ err) {
        const transient = err?.code === "timeout" || err?.code === "network" || err?.status >= 500;
        if (!transient || options.signal?.aborted) throw err;
      }
      const delay = Math.max(this._initialDelay, backoffDelay(attempt + 1, this._initialDelay, this._maxDelay, this._random));
      await new Promise((resolve) => setTimeout(resolve, delay));
      if (options.signal?.aborted) throw new GatewayError("aborted", "aborted");
    }
  }

  /**
   * Create a conversation (`POST /v1/conversations`): `chat_id` (else the gateway makes
   * one), a first `title`, the `agent` that answers it (else the gateway's default; see
   * listAgents()), and `parent_chat_id` for a sub-conversation. Resolves with the
   * conversation (its `epoch` and `last_seq` are a resume point for subscribe()). Asked
   * once, never again by itself: a retry after a lost reply may find it made (409
   * "conflict" when `chat_id` was given).
   * @param {CreateConversationOptions} [options]
   * @returns {Promise<Conversation>}
   */
  async createConversation(options = {}) {
    /** @type {Record<string, string>} */
    const body = {};
    for (const field of /** @type {const} */ (["chat_id", "title", "agent", "parent_chat_id"])) {
      const value = options[field];
      if (value != null) body[field] = value;
    }
    return this.request("POST", "/v1/conversations", { body, timeout: options.timeout, signal: options.signal });
  }

  /**
   * The agents with a live worker now (`GET /v1/agents`): `{agents: [{name, kind,
   * workers}]}`. Offer them when a conversation is created (createConversation's
   * or subscribe's `agent`).
   * @param {ListAgentsOptions} [options]
   * @returns {Promise<AgentList>}
   */
  async listAgents(options = {}) {
    return this.request("GET", "/v1/agents", { timeout: options.timeout, signal: options.signal });
  }

  /**
   * Share a conversation (`PATCH /v1/conversations/{chat_id}/members`, its owner or a
   * service): `set` gives users a role ("member" or "viewer"), `remove` takes users off,
   * together. Resolves with `{chat_id, owner, members, removed}` (`members`: the whole list
   * after the change), which members() keeps. Asked once; a refusal rejects (403
   * "forbidden", 400 "invalid_request", 404 "not_found").
   * @param {string} chatId
   * @param {MembersChange} change
   * @param {SetMembersOptions} [options]
   * @returns {Promise<MembersResult>}
   */
  async setMembers(chatId, change, options = {}) {
    /** @type {MembersChange} */
    const body = {};
    if (change.set != null) body.set = change.set;
    if (change.remove != null) body.remove = change.remove;
    /** @type {MembersResult} */
    const result = await this.request("PATCH", `/v1/conversations/${encodeURIComponent(chatId)}/members`,
      { body, timeout: options.timeout, signal: options.signal });
    if (result && typeof result.owner === "string") {
      this._members.set(chatId, { owner: result.owner, members: { ...(result.members ?? {}) } });
    }
    return result;
  }

  /**
   * Who shares a conversation, as last heard (a `conversation` or `members` frame, or
   * setMembers()): its owner and `members` ({user_id: "member" | "viewer"}, the owner not
   * in it), or null when not known.
   * @param {string} chatId
   * @returns {Members | null}
   */
  members(chatId) {
    const known = this._members.get(chatId);
    return known ? { owner: known.owner, members: { ...known.members } } : null;
  }

  /**
   * A user's role in a conversation ("owner", "member", "viewer"; null: none, or not known),
   * from members(). `userId` defaults to this connection's user (hello's `user_id`).
   * @param {string} chatId
   * @param {string | null} [userId]
   * @returns {Role | null}
   */
  role(chatId, userId) {
    const known = this._members.get(chatId);
    const who = userId ?? this._hello?.user_id ?? null;
    if (!known || who == null) return null;
    if (known.owner === who) return "owner";
    return known.members[who] ?? null;
  }

  /** @param {ConversationFrame} frame */
  _onConversation(frame) {
    if (frame.deleted) this._members.delete(frame.chat_id);
    else if (typeof frame.owner === "string") {
      this._members.set(frame.chat_id, { owner: frame.owner, members: { ...(frame.members ?? {}) } });
    }
    this._emit("conversation", frame);
  }

  /** @param {MembersFrame} frame */
  _onMembers(frame) {
    const known = { owner: frame.owner, members: { ...(frame.members ?? {}) } };
    this._members.set(frame.chat_id, known);
    this._emit("members", { chatId: frame.chat_id, ...known, frame });
  }

  /**
   * This connection's user was removed from the conversation: the gateway ended every
   * subscription of theirs to it (its buffer too). The chat is forgotten like a left one
   * and never resubscribed (a subscribe would be refused); the app hears `removed`.
   * @param {RemovedFrame} frame
   */
  _onRemoved(frame) {
    const chat = this._chats.get(frame.chat_id);
    this._members.delete(frame.chat_id);
    if (chat) {
      this._chats.delete(chat.id);
      if (chat.subReq != null) this._pending.delete(chat.subReq);
      for (const w of chat.waiters) w.resolve(null);
      this._forgetPresence(chat);
      // Writes still queued for it would only be refused.
      for (const entry of [...this._outbox]) {
        if (entry.frame.chat_id !== chat.id) continue;
        this._settle(entry);
        entry.reject(new GatewayError("forbidden", frame.reason));
      }
    }
    this._emit("removed", { chatId: frame.chat_id, userId: frame.user_id, reason: frame.reason, frame });
  }

  /**
   * @param {string} method
   * @param {string} path
   * @param {string | null} token
   * @param {unknown} body
   * @param {number} timeout
   * @param {AbortSignal} [signal]
   * @returns {Promise<any>}
   */
  async _http(method, path, token, body, timeout, signal) {
    const doFetch = this._fetch;
    if (!doFetch) throw new GatewayError("network", "no fetch() in this runtime");
    if (signal?.aborted) throw new GatewayError("aborted", "aborted");
    const controller = new AbortController();
    let timedOut = false;
    const timer = setTimeout(() => { timedOut = true; controller.abort(); }, timeout);
    const onAbort = () => controller.abort();
    signal?.addEventListener("abort", onAbort);
    try {
      /** @type {Record<string, string>} */
      const headers = {};
      if (token) headers.Authorization = "Bearer " + token;
      if (body !== undefined) headers["Content-Type"] = "application/json";
      let res;
      try {
        res = await doFetch(this.httpUrl + path, {
          method, headers, signal: controller.signal, cache: "no-store",
          body: body === undefined ? undefined : JSON.stringify(body),
        });
      } catch (/** @type {any} */ err) {
        if (timedOut) throw new GatewayError("timeout", `${method} ${path}: no reply within ${timeout} ms`);
        if (controller.signal.aborted) throw new GatewayError("aborted", "aborted");
        throw new GatewayError("network", `${method} ${path}: ${err?.message ?? err}`);
      }
      let text;
      try {
        text = await res.text();
      } catch (/** @type {any} */ err) {
        if (timedOut) throw new GatewayError("timeout", `${method} ${path}: no reply within ${timeout} ms`);
        throw new GatewayError("network", `${method} ${path}: ${err?.message ?? err}`);
      }
      let json = null;
      try { json = text ? JSON.parse(text) : null; } catch { /* not JSON: said below */ }
      if (!res.ok) {
        const error = json?.error;
        throw new GatewayError(typeof error?.code === "string" ? error.code : "http_error",
          typeof error?.message === "string" ? error.message : `${method} ${path}: HTTP ${res.status}`,
          null, res.status);
      }
      return json;
    } finally {
      clearTimeout(timer);
      signal?.removeEventListener("abort", onAbort);
    }
  }

  // --- chats -------------------------------------------------------------------------

  /**
   * @param {string} chatId
   * @returns {ChatState}
   */
  _chat(chatId) {
    let chat = this._chats.get(chatId);
    if (!chat) {
      chat = {
        id: chatId,
        want: "off", // what the app asked for: "live" or "off"
        server: "none", // what this connection's gateway session has: none | live | buffering
        epoch: null,
        seq: null, // last durable seq handed to the app
        subReq: null, // id of the subscribe request in flight
        subMode: null, // since | buffer | again | fresh
        waiters: [],
        snapshot: null,
        streams: new Map(), // stream id -> {id, type, turnId, text, pos}: answers being written
        resyncing: false, // a stream skipped a position: a fresh snapshot is on its way
        tree: new ConversationTree(), // nodes, head, active path
        create: true, // false: subscribe with `create: false` (a link must not create)
        agent: null, // the agent a creating subscribe names (null: the gateway's default)
        running: false, // a turn runs: tokens are expected (the heartbeat listens closer)
        awaiting: null, // {call_id: tool name}: client tool calls waiting for a person
        awaitingSeq: -1, // the seq `awaiting` is known at
        presence: null, // who is connected now: {v, users, agents}
        typing: new Map(), // user id -> when their `typing` came (ms)
        typingTimer: undefined, // ends the typing heard longest ago
        typedAt: -Infinity, // when sendTyping() last sent a `typing` here (ms)
      };
      this._chats.set(chatId, chat);
    }
    return chat;
  }

  /**
   * The chat's open streams (answers being written): [{id, type, turnId, text, pos}].
   * @param {string} chatId
   * @returns {StreamState[]}
   */
  streams(chatId) {
    const chat = this._chats.get(chatId);
    return chat ? [...chat.streams.values()].map((s) => ({ ...s })) : [];
  }

  /**
   * The resume point of a chat: {seq, epoch}, or null when unknown.
   * @param {string} chatId
   * @returns {Since | null}
   */
  position(chatId) {
    const chat = this._chats.get(chatId);
    return chat && chat.epoch != null && chat.seq != null ? { seq: chat.seq, epoch: chat.epoch } : null;
  }

  // --- the conversation tree ----------------------------------------------------------

  /**
   * The chat's tree as the client keeps it from the events (read it, do not change it), or
   * null for a chat the client does not hold. A subscribe without `since` knows the head,
   * then the nodes made from then on; loadHistory() fills in what came before. A `recovery`
   * resets it.
   * @param {string} chatId
   * @returns {PublicTree | null}
   */
  tree(chatId) {
    return this._chats.get(chatId)?.tree ?? null;
  }

  /**
   * The node the next message follows (a turn), null for none, undefined when not known.
   * @param {string} chatId
   * @returns {string | null | undefined}
   */
  head(chatId) {
    const tree = this._chats.get(chatId)?.tree;
    return tree?.headKnown ? tree.head : undefined;
  }

  /**
   * The active path's node ids, from the first message the client knows of to the head:
   * what a chat UI shows (events whose `node` is on it, or that have none).
   * @param {string} chatId
   * @returns {string[]}
   */
  activePath(chatId) {
    return this._chats.get(chatId)?.tree.path() ?? [];
  }

  /**
   * The versions of a node (itself included, in creation order) and its index, for a
   * fork's "‹ 2/3 ›"; a node whose siblings the client does not know is alone.
   * @param {string} chatId
   * @param {string} nodeId
   * @returns {Siblings}
   */
  siblings(chatId, nodeId) {
    return this._chats.get(chatId)?.tree.siblings(nodeId) ?? { ids: [nodeId], index: 0 };
  }

  /**
   * Fill a chat's tree from a page of `GET /v1/conversations/{chat_id}/events` (its events,
   * `forks` and `head`): on load, and after a `recovery`. A page of another epoch than the
   * client's is ignored. Emits `head` when the head moved.
   * @param {string} chatId
   * @param {HistoryPage} page
   * @returns {void}
   */
  loadHistory(chatId, page) {
    const chat = this._chat(chatId);
    if (chat.epoch != null && page.epoch != null && page.epoch !== chat.epoch) return;
    const moved = chat.tree.loadPage(page);
    if (moved) this._emit("head", { chatId, ...moved });
  }

  /**
   * Chats the app wants live.
   * @returns {string[]}
   */
  get subscriptions() {
    return [...this._chats.values()].filter((c) => c.want === "live").map((c) => c.id);
  }

  /**
   * Subscribe to a chat; resolves with the `subscribed` frame (or null if the app unsubscribed
   * first). `since` (say, after loading history over HTTP) sets the resume point; without it
   * the client picks: drain this connection's buffer, resume from the remembered position,
   * or start live. `create: false`: a conversation that does not exist is not created; the
   * promise rejects with a GatewayError of code "not_found" (and `error` is emitted).
   * `agent`: the agent that answers the conversation, should this subscribe create it.
   * @param {string} chatId
   * @param {SubscribeOptions} [options]
   * @returns {Promise<SubscribedFrame | null>}
   */
  subscribe(chatId, options = {}) {
    const chat = this._chat(chatId);
    if (options.create !== undefined) chat.create = options.create;
    if (options.agent !== undefined) chat.agent = options.agent;
    const since = options.since ?? null;
    if (since) {
      chat.epoch = since.epoch;
      chat.seq = since.seq;
    }
    const already = chat.want === "live";
    chat.want = "live";
    /** @type {Promise<SubscribedFrame | null>} */
    const promise = new Promise((resolve, reject) => chat.waiters.push({ resolve, reject }));
    if (this.connected && (!already || since || !chat.subReq)) this._sendSubscribe(chat, since);
    return promise;
  }

  /**
   * @param {ChatState} chat
   * @param {Since | null} since
   */
  _sendSubscribe(chat, since) {
    /** @type {SubscribedEvent["mode"]} */
    let mode;
    if (since) mode = "since";
    else if (chat.server === "buffering") mode = "buffer";
    else if (chat.server === "live") mode = "again";
    else if (chat.epoch != null && chat.seq != null) {
      mode = "since";
      since = { seq: chat.seq, epoch: chat.epoch };
    } else mode = "fresh";
    const id = this._nextId++;
    chat.subReq = id;
    chat.subMode = mode;
    chat.server = "live";
    /** @type {{type: "subscribe", chat_id: string, id: number, since?: Since, create?: false, agent?: string}} */
    const frame = { type: "subscribe", chat_id: chat.id, id };
    if (since) frame.since = { seq: since.seq, epoch: since.epoch };
    if (!chat.create) frame.create = false;
    else if (chat.agent != null) frame.agent = chat.agent; // the gateway ignores it once the chat exists
    this._pending.set(id, { kind: "subscribe", chatId: chat.id, frame });
    this._send(frame);
  }

  /** @param {SubscribedFrame} frame */
  _onSubscribed(frame) {
    const req = frame.id != null ? this._pending.get(frame.id) : null;
    if (req) this._pending.delete(/** @type {RequestId} */ (frame.id));
    const chat = this._chats.get(frame.chat_id);
    if (!chat) return; // left meanwhile
    if (frame.id != null && chat.subReq != null && frame.id !== chat.subReq) {
      // Superseded: the later subscribe's reply is the one that counts. When that one drains
      // this connection's buffer, though, the buffered frames continue from this reply's
      // position: keep it if the client has none, or it would take them for duplicates.
      if (chat.subMode === "buffer" && chat.epoch == null) {
        chat.epoch = frame.epoch;
        chat.seq = frame.seq;
      }
      return;
    }
    const mode = chat.subMode ?? "again";
    chat.subReq = null;
    chat.subMode = null;
    chat.snapshot = frame.snapshot ?? null;
    chat.running = frame.snapshot?.status === "running";
    if (frame.snapshot) {
      // The calls waiting for an answer as of the reply's seq (the replay brings older news).
      chat.awaiting = { ...(frame.snapshot.awaiting ?? {}) };
      chat.awaitingSeq = frame.seq;
    }
    if (frame.recovered === false || (chat.epoch != null && chat.epoch !== frame.epoch)) {
      // The tree goes with the history: the app reloads both (loadHistory()).
      chat.tree.reset();
    }
    if (frame.recovered === false) {
      // Nothing was replayed: the app must reload history; live frames continue from here.
      chat.epoch = frame.epoch;
      chat.seq = frame.seq;
    } else if (chat.epoch !== frame.epoch) {
      // First sight of this chat (or of a new incarnation of it): live from now.
      chat.epoch = frame.epoch;
      chat.seq = frame.seq;
    } else if (chat.seq == null) {
      chat.seq = frame.seq;
    }
    // "since", "buffer", "again": the replayed, buffered or live frames move chat.seq on.
    const listed = frame.snapshot?.streams;
    if (Array.isArray(listed)) {
      // The whole truth about open streams: show each text as is; unlisted ones are gone.
      chat.resyncing = false;
      const before = chat.streams;
      chat.streams = new Map(listed.map((s) => [s.id, {
        id: s.id, type: s.type, turnId: s.turn_id ?? null, text: s.text, pos: s.pos,
      }]));
      for (const id of before.keys()) {
        if (!chat.streams.has(id)) this._emit("stream", { chatId: chat.id, stream: null, id, ended: "gone" });
      }
      for (const stream of chat.streams.values()) {
        this._emit("stream", { chatId: chat.id, stream: { ...stream }, id: stream.id, reset: true });
      }
    }
    // The head now, as of the reply's seq: the replay that follows brings older moves only.
    const snapshotHead = frame.snapshot && "head" in frame.snapshot
      ? chat.tree.setHead(frame.snapshot.head ?? null, frame.seq) : null;
    this._emit("subscribed", { chatId: chat.id, frame, mode });
    if (snapshotHead) this._emit("head", { chatId: chat.id, ...snapshotHead });
    if (frame.snapshot?.presence) this._onPresence(chat, frame.snapshot.presence);
    if (frame.recovered === false) {
      this._emit("recovery", {
        chatId: chat.id, recovered: false, epoch: frame.epoch, seq: frame.seq, frame,
      });
    }
    const waiters = chat.waiters;
    chat.waiters = [];
    for (const w of waiters) w.resolve(frame);
  }

  /**
   * Stop receiving a chat's frames; the gateway buffers them for this connection, and the
   * next subscribe() drains that buffer. Resolves when the gateway confirmed (or at once
   * when not connected).
   * @param {string} chatId
   * @returns {Promise<UnsubscribedFrame | null>}
   */
  unsubscribe(chatId) {
    const chat = this._chats.get(chatId);
    if (!chat || chat.want !== "live") return Promise.resolve(null);
    chat.want = "off";
    const waiters = chat.waiters;
    chat.waiters = [];
    for (const w of waiters) w.resolve(null);
    this._forgetPresence(chat); // never buffered: the next subscribe's snapshot tells
    if (!this.connected || chat.server !== "live") return Promise.resolve(null);
    chat.server = "buffering";
    chat.subReq = null;
    chat.subMode = null;
    return /** @type {Promise<UnsubscribedFrame | null>} */ (
      this._request({ type: "unsubscribe", chat_id: chatId }, "unsubscribe"));
  }

  /**
   * Stop receiving a chat and forget it (its buffer and resume point too).
   * @param {string} chatId
   * @returns {Promise<LeftFrame | null>}
   */
  leave(chatId) {
    const chat = this._chats.get(chatId);
    if (!chat) return Promise.resolve(null);
    this._chats.delete(chatId);
    for (const w of chat.waiters) w.resolve(null);
    this._forgetPresence(chat);
    if (!this.connected || chat.server === "none") return Promise.resolve(null);
    return /** @type {Promise<LeftFrame | null>} */ (
      this._request({ type: "leave", chat_id: chatId }, "leave"));
  }

  /**
   * @param {{type: "unsubscribe" | "leave", chat_id: string}} frame
   * @param {"unsubscribe" | "leave"} kind
   * @returns {Promise<ServerFrame | null>}
   */
  _request(frame, kind) {
    return new Promise((resolve, reject) => {
      const id = this._nextId++;
      this._pending.set(id, { kind, chatId: frame.chat_id, resolve, reject, frame });
      this._send({ ...frame, id });
    });
  }

  // --- messages and cancels (the outbox) --------------------------------------------

  /**
   * Post a user message; resolves with the `ack` (`duplicate: true` when a retry found the
   * first attempt stored). Queued while disconnected; retried with the same client_msg_id.
   * @param {string} chatId
   * @param {string} text
   * @param {SendMessageOptions} [options]
   * @returns {Promise<AckFrame>}
   */
  sendMessage(chatId, text, options = {}) {
    /** @type {OutboxEntry["frame"]} */
    const frame = {
      type: "message", chat_id: chatId, text,
      client_msg_id: options.clientMsgId ?? newClientMsgId(),
    };
    if (options.data != null) frame.data = options.data;
    // Only a cancel resolves with null (see _onError).
    return /** @type {Promise<AckFrame>} */ (this._enqueue("message", frame));
  }

  /**
   * Ask the agent to stop the running turn (of `turnId`, if given); resolves with the ack.
   * @param {string} chatId
   * @param {string} [turnId]
   * @returns {Promise<AckFrame | null>}
   */
  cancel(chatId, turnId) {
    /** @type {OutboxEntry["frame"]} */
    const frame = { type: "cancel", chat_id: chatId };
    if (turnId) frame.turn_id = turnId;
    return this._enqueue("cancel", frame);
  }

  // --- tree operations ----------------------------------------------------------------
  //
  // Each is queued like a message and resolves with the `ack` (the new `head`, and what the
  // operation made). `expectedHead` defaults to the head the client knows, so of two devices
  // racing from one head, one gets a clean `conflict` (a GatewayError with `head`, the head
  // now); `cancel: true` ends a running turn first instead of `turn_in_progress`. One that
  // was written when the connection dropped is not sent again (it is not idempotent): it
  // rejects with code "disconnected".

  /**
   * A new answer to the head turn's message (the ack has its `turn_id`).
   * @param {string} chatId
   * @param {TreeOpOptions} [options]
   * @returns {Promise<AckFrame>}
   */
  retry(chatId, options = {}) {
    return this._treeOp("retry", chatId, options, {});
  }

  /**
   * A new version of the user message `msgId` (on the active path) with `text`, and a turn
   * answering it (the ack has the new `msg_id` and `turn_id`).
   * @param {string} chatId
   * @param {string} msgId
   * @param {string} text
   * @param {EditOptions} [options]
   * @returns {Promise<AckFrame>}
   */
  edit(chatId, msgId, text, options = {}) {
    /** @type {Record<string, unknown>} */
    const fields = { msg_id: msgId, text };
    if (options.clientMsgId) fields.client_msg_id = options.clientMsgId;
    return this._treeOp("edit", chatId, options, fields);
  }

  /**
   * The head back before the active path's last user message; the ack gives its `text`
   * (and `msg_id`) back: put it in the composer. switch() to that message redoes it.
   * @param {string} chatId
   * @param {TreeOpOptions} [options]
   * @returns {Promise<AckFrame>}
   */
  undo(chatId, options = {}) {
    return this._treeOp("undo", chatId, options, {});
  }

  /**
   * The head to the leaf last active below `nodeId`: another version at a fork, or redo.
   * @param {string} chatId
   * @param {string} nodeId
   * @param {TreeOpOptions} [options]
   * @returns {Promise<AckFrame>}
   */
  switch(chatId, nodeId, options = {}) {
    return this._treeOp("switch", chatId, options, { node_id: nodeId });
  }

  // --- client tools: the agent asks a person ------------------------------------------

  /**
   * A person's answer to the client tool call `callId` that waits for one (see awaiting()):
   * resolves with the `ack` (the new turn's `turn_id`, the new `head`, the answer's
   * `msg_id`). Queued like a message while disconnected; one written when the connection
   * dropped is not sent again (code "disconnected"). Rejects with a GatewayError: "conflict"
   * (another answer won, or the question was left unanswered: the winning `tool_result`
   * comes as an event), "invalid_request" (it does not fit the tool's `result` schema; the
   * message says where), "not_found", "forbidden".
   * @param {string} chatId
   * @param {string} callId
   * @param {unknown} result
   * @returns {Promise<AckFrame>}
   */
  answer(chatId, callId, result) {
    /** @type {OutboxEntry["frame"]} */
    const frame = { type: "tool_result", chat_id: chatId, call_id: callId, result };
    this._chat(chatId); // kept for the ack's head, even if never subscribed
    return /** @type {Promise<AckFrame>} */ (this._enqueue("tool_result", frame));
  }

  /**
   * The chat's client tool calls that wait for a person's answer, {call_id: tool name}:
   * from the last `subscribed` snapshot (`snapshot.awaiting`), then live (a `tool_call` with
   * `awaiting: true` adds one; any move of the head, an answer's included, ends them all).
   * Null until a snapshot told.
   * @param {string} chatId
   * @returns {Record<string, string> | null}
   */
  awaiting(chatId) {
    const awaiting = this._chats.get(chatId)?.awaiting;
    return awaiting ? { ...awaiting } : null;
  }

  /**
   * @param {ChatState} chat
   * @param {EventFrame} frame a durable event, in order
   */
  _trackAwaiting(chat, frame) {
    if (!chat.awaiting || typeof frame.seq !== "number" || frame.seq <= chat.awaitingSeq) return;
    const data = frame.data;
    if (frame.type === "head") chat.awaiting = {};
    else if (frame.type === "tool_call" && data?.awaiting === true && typeof data.call_id === "string") {
      chat.awaiting[data.call_id] = typeof data.name === "string" ? data.name : "";
    } else return;
    chat.awaitingSeq = frame.seq;
  }

  // --- presence and typing ------------------------------------------------------------

  /**
   * Who is connected to a live chat now (protocol.md, "Presence and typing"): `{v, users:
   * [{user_id, connections}], agents: [{name, workers}]}`, the agents being those running
   * a turn in it. The newest list (highest `v`) of the `subscribed` snapshot's and the
   * `presence` frames' since the chat went live on this connection; null before the first,
   * and while the chat is not live (unsubscribed, left, or the connection lost).
   * @param {string} chatId
   * @returns {PresenceList | null}
   */
  presence(chatId) {
    const list = this._chats.get(chatId)?.presence;
    return list ? copyPresence(list) : null;
  }

  /**
   * The users typing in a live chat now, sorted: each one's last `typing` came within three
   * `typing_interval`s, they have not sent a message since, and they are still present. It
   * includes this client's own user when another of their devices types (the gateway never
   * sends a connection its own typing): compare with `hello.user_id`.
   * @param {string} chatId
   * @returns {string[]}
   */
  typing(chatId) {
    const chat = this._chats.get(chatId);
    if (!chat) return [];
    const since = Date.now() - this._typingShownFor();
    return [...chat.typing].filter(([, at]) => at >= since).map(([user]) => user).sort();
  }

  /**
   * Tell the chat's other connections that the person is typing: call it on every change
   * of the message box. At most one `typing` per `typing_interval` (hello.limits) goes out
   * per chat; a call sooner resolves with false at once, and so does one made while not
   * connected (typing is of the moment: nothing is queued). Otherwise resolves with the
   * `typed` reply's `sent` (false: the gateway dropped it as too soon), or false when the
   * connection drops first. Rejects with a GatewayError "not_subscribed" for a chat this
   * connection does not hold live.
   * @param {string} chatId
   * @returns {Promise<boolean>}
   */
  sendTyping(chatId) {
    const chat = this._chats.get(chatId);
    const now = Date.now();
    if (!this.connected || (chat && now - chat.typedAt < this._typingInterval())) {
      return Promise.resolve(false);
    }
    if (chat) chat.typedAt = now;
    return new Promise((resolve, reject) => {
      const id = this._nextId++;
      this._pending.set(id, {
        kind: "typing", chatId,
        resolve: (frame) => resolve(/** @type {TypedFrame | null} */ (frame)?.sent === true),
        reject,
      });
      this._send({ type: "typing", chat_id: chatId, id });
    });
  }

  /** The gateway's `typing_interval` in ms (hello.limits; 2 s until a hello says). */
  _typingInterval() {
    const seconds = this._hello?.limits?.typing_interval;
    return (typeof seconds === "number" && seconds >= 0 ? seconds : 2) * 1000;
  }

  /** How long a `typing` shows, in ms. */
  _typingShownFor() {
    return TYPING_SHOWN_FOR * this._typingInterval();
  }

  /**
   * A list from a `presence` frame or a snapshot: kept when newer (higher `v`) than the one
   * held. Typing users gone from it are no longer typing.
   * @param {ChatState} chat
   * @param {PresenceList} list
   * @param {PresenceFrame} [frame]
   */
  _onPresence(chat, list, frame) {
    if (!list || typeof list.v !== "number" || !Array.isArray(list.users) || !Array.isArray(list.agents)) return;
    if (chat.presence && list.v <= chat.presence.v) return; // older news
    chat.presence = copyPresence(list);
    const present = new Set(chat.presence.users.map((u) => u.user_id));
    let gone = false;
    for (const user of [...chat.typing.keys()]) {
      if (!present.has(user)) gone = chat.typing.delete(user) || gone;
    }
    /** @type {GatewayClientEvents["presence"]} */
    const event = { chatId: chat.id, presence: copyPresence(chat.presence) };
    if (frame) event.frame = frame;
    this._emit("presence", event);
    if (gone) this._typingChanged(chat);
  }

  /** @param {TypingFrame} frame */
  _onTyping(frame) {
    const chat = this._chats.get(frame.chat_id);
    if (!chat || chat.want !== "live" || typeof frame.user_id !== "string") return;
    chat.typing.delete(frame.user_id); // the latest last: the timer goes by the first
    chat.typing.set(frame.user_id, Date.now());
    this._typingChanged(chat, frame);
  }

  /**
   * Tell the app who types now (something changed, or `frame` came).
   * @param {ChatState} chat
   * @param {TypingFrame} [frame]
   */
  _typingChanged(chat, frame) {
    this._expireTyping(chat);
    /** @type {GatewayClientEvents["typing"]} */
    const event = { chatId: chat.id, users: this.typing(chat.id) };
    if (frame) event.frame = frame;
    this._emit("typing", event);
  }

  /**
   * End each typing whose time is up, and set a timer for the next one; returns whether
   * any ended.
   * @param {ChatState} chat
   * @returns {boolean}
   */
  _expireTyping(chat) {
    clearTimeout(chat.typingTimer);
    chat.typingTimer = undefined;
    const shownFor = this._typingShownFor();
    const now = Date.now();
    let ended = false;
    for (const [user, at] of [...chat.typing]) {
      if (now - at > shownFor) ended = chat.typing.delete(user) || ended;
    }
    const oldest = chat.typing.values().next(); // the Map is in the order they came
    if (!oldest.done) {
      chat.typingTimer = setTimeout(() => {
        chat.typingTimer = undefined;
        if (this._chats.get(chat.id) !== chat || !this._expireTyping(chat)) return;
        this._emit("typing", { chatId: chat.id, users: this.typing(chat.id) });
      }, Math.max(0, oldest.value + shownFor - now) + 1);
    }
    return ended;
  }

  /**
   * The chat is not live here any more: who is here and typing is not known. Tells the app
   * when it held any.
   * @param {ChatState} chat
   */
  _forgetPresence(chat) {
    clearTimeout(chat.typingTimer);
    chat.typingTimer = undefined;
    const had = chat.presence != null;
    const typed = chat.typing.size > 0;
    chat.presence = null;
    chat.typing.clear();
    if (had) this._emit("presence", { chatId: chat.id, presence: null });
    if (typed) this._emit("typing", { chatId: chat.id, users: [] });
  }

  /**
   * @param {"retry" | "edit" | "undo" | "switch"} kind
   * @param {string} chatId
   * @param {TreeOpOptions} options
   * @param {Record<string, unknown>} fields
   * @returns {Promise<AckFrame>}
   */
  _treeOp(kind, chatId, options, fields) {
    /** @type {OutboxEntry["frame"]} */
    const frame = { type: kind, chat_id: chatId, ...fields };
    const expected = options.expectedHead;
    if (expected === undefined) {
      const tree = this._chat(chatId).tree; // kept for the ack's head, even if never subscribed
      if (tree.headKnown) frame.expected_head = tree.head;
    } else if (expected !== false) {
      frame.expected_head = expected;
    }
    if (options.cancel) frame.cancel = true;
    return /** @type {Promise<AckFrame>} */ (this._enqueue(kind, frame));
  }

  /**
   * @param {OutboxEntry["kind"]} kind
   * @param {OutboxEntry["frame"]} frame
   * @returns {Promise<AckFrame | null>}
   */
  _enqueue(kind, frame) {
    return new Promise((resolve, reject) => {
      /** @type {OutboxEntry} */
      const entry = { kind, frame, resolve, reject, reqId: null, attempts: 0, written: false };
      this._outbox.push(entry);
      if (this.connected) this._sendEntry(entry);
    });
  }

  /** @param {OutboxEntry} entry */
  _sendEntry(entry) {
    if (entry.reqId != null) this._pending.delete(entry.reqId);
    const id = this._nextId++;
    entry.reqId = id;
    entry.attempts++;
    this._pending.set(id, { kind: entry.kind, chatId: entry.frame.chat_id, entry });
    entry.written = this._send({ ...entry.frame, id }) || entry.written;
  }

  /** @param {OutboxEntry} entry */
  _settle(entry) {
    const i = this._outbox.indexOf(entry);
    if (i >= 0) this._outbox.splice(i, 1);
    if (entry.reqId != null) this._pending.delete(entry.reqId);
  }

  // --- inbound -----------------------------------------------------------------------

  /** @param {ServerFrame} frame */
  _onFrame(frame) {
    // (Event frames have any `type`: a cast names the frame each case handles.)
    switch (frame.type) {
      case "hello":
        this._onHello(/** @type {HelloFrame} */ (frame));
        return;
      case "subscribed":
        this._onSubscribed(/** @type {SubscribedFrame} */ (frame));
        return;
      case "unsubscribed":
      case "left":
      case "pong":
      case "typed":
      case "refreshed": {
        const reply = /** @type {UnsubscribedFrame | LeftFrame | PongFrame | TypedFrame | RefreshedFrame} */ (frame);
        const req = reply.id != null ? this._pending.get(reply.id) : null;
        if (req) {
          this._pending.delete(/** @type {RequestId} */ (reply.id));
          req.resolve?.(reply);
        }
        return;
      }
      case "ack":
        this._onAck(/** @type {AckFrame} */ (frame));
        return;
      case "error":
        this._onError(/** @type {ErrorFrame} */ (frame));
        return;
      case "conversation":
        this._onConversation(/** @type {ConversationFrame} */ (frame));
        return;
      case "members":
        this._onMembers(/** @type {MembersFrame} */ (frame));
        return;
      case "removed":
        this._onRemoved(/** @type {RemovedFrame} */ (frame));
        return;
      case "token_expiring":
        this._refreshToken(/** @type {TokenExpiringFrame} */ (frame));
        return;
      case "presence": {
        const list = /** @type {PresenceFrame} */ (frame);
        const chat = this._chats.get(list.chat_id);
        if (chat && chat.want === "live") this._onPresence(chat, list, list);
        return;
      }
      case "typing":
        this._onTyping(/** @type {TypingFrame} */ (frame));
        return;
      default: {
        const event = /** @type {EventFrame} */ (frame);
        if (!REPLY_TYPES.has(event.type) && typeof event.chat_id === "string") this._onEvent(event);
      }
    }
  }

  /**
   * The connection's token expires soon (`token_expiring`): ask the token callback for a
   * fresh one (reason "refresh") and send it in band (`refresh`). On `refreshed` the
   * connection goes on, on the new token, as it is (subscriptions, buffers, presence): no
   * reconnect, no replay; the app hears `token_refreshed`. Refused, or no new token to send:
   * the app hears `token_refresh_failed` (and a refusal's `error`), and the 4011 at the old
   * token's expiry reconnects with a fresh token as before. Tried once per expiry: a token
   * that changed nothing (the same one, or one with the same `exp`) is not sent again.
   * @param {TokenExpiringFrame} frame
   * @returns {Promise<void>}
   */
  async _refreshToken(frame) {
    const ws = this._ws;
    const expiresAt = frame.expires_at;
    if (!ws || !this._hello || this._refreshFor === expiresAt) return;
    this._refreshFor = expiresAt;
    /** @param {GatewayError} error */
    const failed = (error) => {
      if (this._ws === ws) this._emit("token_refresh_failed", { expiresAt, error });
    };
    let token;
    try {
      token = await this._getToken("refresh");
    } catch (/** @type {any} */ err) {
      failed(new GatewayError("token_callback", "the token callback failed: " + (err?.message ?? err)));
      return;
    }
    if (this._ws !== ws || !this._hello) return; // that connection went: the next one asks anew
    if (!token) {
      failed(new GatewayError("token_callback", "the token callback gave no token"));
      return;
    }
    if (token === this._wsToken) {
      // Sending it would change nothing (and be answered with another token_expiring).
      failed(new GatewayError("token_unchanged", "no fresh token: the token callback gave the one the connection runs on"));
      return;
    }
    const id = this._nextId++;
    /** @type {ServerFrame | GatewayError | null} */
    const reply = await new Promise((resolve) => {
      this._pending.set(id, { kind: "refresh", resolve, reject: resolve });
      if (!this._send({ type: "refresh", token, id })) {
        this._pending.delete(id);
        resolve(null);
      }
    });
    if (this._ws !== ws || reply == null) return;
    if (reply instanceof GatewayError) {
      failed(reply);
      return;
    }
    this._wsToken = token;
    const refreshed = /** @type {RefreshedFrame} */ (reply);
    this._emit("token_refreshed", { expiresAt: refreshed.expires_at, frame: refreshed });
  }

  /** @param {HelloFrame} frame */
  _onHello(frame) {
    clearTimeout(this._timer);
    this._timer = undefined;
    this._hello = frame;
    this._attempt = 0;
    this._restartAt = 0;
    this._lastClose = null;
    this._startHeartbeat();
    this._setState("open", { connectionId: frame.connection_id });
    this._emit("hello", frame);
    // Resume: resubscribe every chat the app wants (with `since` where known), then flush
    // queued messages and cancels, in the order the app made them.
    for (const chat of this._chats.values()) {
      if (chat.want === "live") this._sendSubscribe(chat, null);
    }
    for (const entry of [...this._outbox]) this._sendEntry(entry);
    if (this._wasOpen) {
      // The feed is not replayed: what changed while away is told by a list over HTTP. The
      // feed is live by the reply to this ping (protocol.md), so a list asked for after it
      // misses nothing.
      const id = this._nextId++;
      this._pending.set(id, {
        kind: "ping",
        resolve: (pong) => { if (pong) this._emit("feed_gap", { connectionId: frame.connection_id }); },
      });
      this._send({ type: "ping", id });
    }
    this._wasOpen = true;
  }

  /** @param {AckFrame} frame */
  _onAck(frame) {
    const req = frame.id != null ? this._pending.get(frame.id) : null;
    this._emit("ack", frame);
    if (!req) return;
    this._pending.delete(/** @type {RequestId} */ (frame.id));
    if (req.entry) {
      this._settle(req.entry);
      const chat = this._chats.get(frame.chat_id);
      if (chat && chat.server !== "live" && HEAD_ACKS.has(req.entry.kind) && "head" in frame
          && typeof frame.seq === "number") {
        // The head after the operation, as of its seq, for a chat this connection does not
        // get live. A live one gets the `head` event, after the events that made its node:
        // the tree never points at a node whose events are still on their way.
        const moved = chat.tree.setHead(frame.head ?? null, frame.seq);
        if (moved && chat.awaiting && frame.seq > chat.awaitingSeq) {
          // Every move of the path leaves the questions before it unanswered (or answered).
          chat.awaiting = {};
          chat.awaitingSeq = frame.seq;
        }
        if (moved) this._emit("head", { chatId: chat.id, ...moved });
      }
      req.entry.resolve(frame);
    } else {
      req.resolve?.(frame);
    }
  }

  /** @param {ErrorFrame} frame */
  _onError(frame) {
    this._emit("error", frame);
    if (frame.code === "rate_limited" && frame.id == null) {
      // The gateway dropped a frame without reading it: resend whatever still waits for an
      // answer (messages are idempotent by client_msg_id; subscribes are safe to repeat).
      if (!this._retryTimer) {
        this._retryTimer = setTimeout(() => {
          this._retryTimer = undefined;
          this._resendUnanswered();
        }, this._rateLimitRetry);
      }
      return;
    }
    const req = frame.id != null ? this._pending.get(frame.id) : null;
    if (!req) return;
    this._pending.delete(/** @type {RequestId} */ (frame.id));
    const error = new GatewayError(frame.code, frame.message, frame);
    if (req.entry) {
      const entry = req.entry;
      this._settle(entry);
      if (entry.kind === "cancel" && entry.attempts > 1
          && (frame.code === "no_active_turn" || frame.code === "turn_mismatch")) {
        entry.resolve(null); // an earlier attempt got through before the connection dropped
      } else {
        entry.reject(error);
      }
      return;
    }
    if (req.kind === "subscribe") {
      const chat = this._chats.get(/** @type {string} */ (req.chatId));
      if (chat && chat.subReq === frame.id) {
        // forbidden, not_found, too_many_subscriptions: the gateway holds no subscription.
        this._chats.delete(chat.id);
        for (const w of chat.waiters) w.reject(error);
      }
      return;
    }
    req.reject?.(error);
  }

  _resendUnanswered() {
    if (!this.connected) return;
    for (const chat of this._chats.values()) {
      if (chat.subReq != null && chat.want === "live") {
        this._pending.delete(chat.subReq);
        const mode = chat.subMode;
        const since = mode === "since" ? /** @type {Since} */ ({ seq: chat.seq, epoch: chat.epoch }) : null;
        if (mode === "buffer") chat.server = "buffering";
        else if (mode === "fresh") chat.server = "none";
        this._sendSubscribe(chat, since);
      }
    }
    for (const entry of [...this._outbox]) this._sendEntry(entry);
  }

  /** @param {EventFrame} frame */
  _onEvent(frame) {
    const chat = this._chats.get(frame.chat_id);
    if (!chat) return; // left, or never subscribed
    if (frame.type === "deleted") {
      // The conversation is gone and the gateway ended the subscription.
      this._chats.delete(chat.id);
      for (const w of chat.waiters) w.resolve(null);
      this._forgetPresence(chat);
      this._emit("event", frame);
      return;
    }
    if (frame.stream) {
      this._onStreamed(chat, frame);
      return;
    }
    if (frame.type === "stream_discarded") {
      const id = /** @type {string} */ (frame.data?.stream_id);
      if (chat.streams.delete(id)) this._emit("stream", { chatId: chat.id, stream: null, id, ended: "discarded" });
      this._emit("event", frame);
      return;
    }
    if (frame.seq == null) {
      this._emit("event", frame); // ephemeral: never replayed, nothing to de-duplicate
      return;
    }
    if (chat.seq != null) {
      if (frame.seq <= chat.seq) {
        this.duplicatesDropped++;
        return;
      }
      if (frame.seq > chat.seq + 1) {
        if (chat.subReq != null && chat.subMode === "since") return; // the replay covers it
        if (chat.want === "live" && this.connected) {
          // A hole: ask for it (and everything after it) again rather than skip it.
          this._emit("gap", { chatId: chat.id, expected: chat.seq + 1, got: frame.seq });
          this._sendSubscribe(chat, { seq: chat.seq, epoch: /** @type {string} */ (chat.epoch) });
          return;
        }
      }
    }
    chat.seq = frame.seq;
    if (frame.type === "turn_start") chat.running = true;
    else if (frame.type === "turn_end") chat.running = false;
    this._trackAwaiting(chat, frame);
    const moved = chat.tree.apply(frame);
    const committed = frame.data?.stream_id;
    if (typeof committed === "string" && chat.streams.delete(committed)) {
      this._emit("stream", { chatId: chat.id, stream: null, id: committed, ended: "committed", frame });
    }
    this._emit("event", frame);
    if (moved) this._emit("head", { chatId: chat.id, ...moved, frame });
    const author = frame.type === "user_message" ? frame.data?.user_id : null;
    if (typeof author === "string" && chat.typing.delete(author)) this._typingChanged(chat); // sent
  }

  /**
   * A streamed delta: continue its stream at exactly its position, or resync.
   * @param {ChatState} chat
   * @param {EventFrame} frame a frame with `stream`
   */
  _onStreamed(chat, frame) {
    if (chat.resyncing) return; // the snapshot on its way holds it
    const { id, pos } = /** @type {NonNullable<EventFrame["stream"]>} */ (frame.stream);
    let stream = chat.streams.get(id);
    if (!stream && pos === 0) {
      stream = { id, type: frame.type, turnId: null, text: "", pos: 0 };
      chat.streams.set(id, stream);
    }
    if (stream && pos < stream.pos) {
      this.duplicatesDropped++;
      return;
    }
    if (!stream || pos > stream.pos) {
      // Missed a piece: a fresh snapshot (with since) gives the exact text again.
      this._emit("gap", { chatId: chat.id, stream: id, expected: stream?.pos ?? 0, got: pos });
      if (chat.want === "live" && this.connected && chat.epoch != null && chat.seq != null) {
        chat.resyncing = true;
        this._sendSubscribe(chat, { seq: chat.seq, epoch: chat.epoch });
      }
      return;
    }
    stream.text += typeof frame.data?.text === "string" ? frame.data.text : "";
    stream.pos = pos + 1;
    this._emit("event", frame);
    this._emit("stream", { chatId: chat.id, stream: { ...stream }, id, frame });
  }
}

export default GatewayClient;
