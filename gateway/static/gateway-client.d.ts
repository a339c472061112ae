// Type declarations for gateway-client.js (gateway wire protocol v1; see protocol.md).

export declare const JSON_SUBPROTOCOL: "gateway.v1.json";

export declare const CloseCodes: Readonly<{
  NORMAL: 1000;
  FRAME_TOO_BIG: 1009;
  SERVER_RESTART: 1012;
  BACKEND_UNAVAILABLE: 1013;
  UNAUTHORIZED: 4001;
  FORBIDDEN: 4003;
  PROTOCOL_ABUSE: 4004;
  DISCONNECTED: 4005;
  SLOW_CONSUMER: 4008;
  TOKEN_EXPIRED: 4011;
  TOO_MANY: 4029;
}>;

/**
 * 4001, 4003, 4004, 4005 (disconnected by an administrator): the client stops reconnecting
 * (state "closed" and a `closed` event with `terminal: true` and the close's reason).
 */
export declare const TERMINAL_CLOSE_CODES: ReadonlySet<number>;

export type RequestId = string | number;

/** The resume point of a conversation. */
export interface Since {
  seq: number;
  epoch: string;
}

// --- frames ----------------------------------------------------------------------------

export interface Limits {
  max_frame_bytes: number;
  max_text_bytes: number;
  max_subscriptions: number;
  replay_limit: number;
  rate_limit: number;
  buffer_max_frames: number;
  buffer_max_bytes: number;
  buffer_ttl: number;
  /** Seconds: a connection's `typing` goes out at most once per this, per chat. */
  typing_interval: number;
}

export interface HelloFrame {
  type: "hello";
  connection_id: string;
  user_id: string;
  role: "user" | "service";
  heartbeat_interval: number;
  protocol: "v1";
  limits: Limits;
}

export interface GoalState {
  active: boolean;
  status: string;
  objective: string;
  ui_summary: string;
  recap?: string | null;
  updated_at: number;
  [extra: string]: unknown;
}

/** An open stream as `snapshot.streams` lists it: its text so far, the next position. */
export interface StreamSnapshot {
  id: string;
  type: string;
  turn_id: string;
  text: string;
  pos: number;
}

/** What a conversation's turns cost, as their agents reported it (`input_tokens`,
 * `output_tokens`, `cost`, ...): `billed` sums every turn ever, on every branch, and only
 * grows; `active` sums the turns on the active path and follows the head. */
export interface UsageTotals {
  billed: Record<string, number>;
  active: Record<string, number>;
}

/** A sub-conversation as its parent lists it (`snapshot.children`, `GET .../children`). */
export interface ChildSummary {
  chat_id: string;
  title: string | null;
  status: "idle" | "running";
  usage: UsageTotals;
}

/** A user connected to a conversation, with how many connections (devices, tabs) they have. */
export interface PresentUser {
  user_id: string;
  connections: number;
}

/** An agent running a turn in a conversation, with how many of its workers do. */
export interface PresentAgent {
  name: string;
  workers: number;
}

/**
 * Who is connected to a conversation now: the whole list, never a diff. `v` only grows: of
 * two lists, the one with the higher `v` is newer. `users` sorted by `user_id`, `agents` by
 * `name`.
 */
export interface PresenceList {
  v: number;
  users: PresentUser[];
  agents: PresentAgent[];
}

/** A conversation's presence list changed (never stored, replayed or buffered). */
export interface PresenceFrame extends PresenceList {
  type: "presence";
  chat_id: string;
  ts: number;
}

/** Another connection's person is typing (maybe this user's, on another device). */
export interface TypingFrame {
  type: "typing";
  chat_id: string;
  user_id: string;
  ts: number;
}

/** The reply to a `typing`: `sent` false when it came sooner than `typing_interval`. */
export interface TypedFrame { type: "typed"; chat_id: string; sent: boolean; id?: RequestId }

export interface Snapshot {
  title: string | null;
  status: "idle" | "running";
  turn_id: string | null;
  started_at: number | null;
  goal_state: GoalState | null;
  /** The node the next message follows (a turn), or null: the conversation tree's head. */
  head?: string | null;
  /** Every open stream; omitted when the connection already holds them all. */
  streams?: StreamSnapshot[];
  usage?: UsageTotals;
  /** User messages and turns on the active path. */
  message_count?: number;
  /** The conversation's sub-conversations, oldest first; omitted when it has none. */
  children?: ChildSummary[];
  /** The agent's state (the last `state` event's snapshot: any JSON); omitted when none. */
  state?: unknown;
  /**
   * The client tool calls that wait for a person's answer, {call_id: tool name}; omitted
   * when none does (GatewayClient.awaiting() keeps it live).
   */
  awaiting?: Record<string, string>;
  /** Who is connected to it now, this connection included (GatewayClient.presence()). */
  presence?: PresenceList;
}

export interface SubscribedFrame {
  type: "subscribed";
  chat_id: string;
  id?: RequestId;
  epoch: string;
  seq: number;
  recovered: boolean;
  replayed: number;
  snapshot: Snapshot;
  /** Present when this subscribe drained the connection's buffer of an unsubscribed chat. */
  buffered?: number;
  /** True when that buffer had overflowed or expired and durable events were replayed instead. */
  overflowed?: boolean;
}

export interface UnsubscribedFrame { type: "unsubscribed"; chat_id: string; id?: RequestId }
export interface LeftFrame { type: "left"; chat_id: string; id?: RequestId }

export interface AckFrame {
  type: "ack";
  chat_id: string;
  id?: RequestId;
  seq: number | null;
  client_msg_id: string | null;
  turn_id: string | null;
  duplicate: boolean;
  /** A message's or tree operation's: the conversation's head after it (null for none). */
  head?: string | null;
  /** The user message a message or an edit added, the one an undo took back, or a
   * person's answer to a client tool (tool_result). */
  msg_id?: string;
  /** undo: the text of the message taken back (put it back in the composer). */
  text?: string;
}

export interface PongFrame { type: "pong"; id?: RequestId; ts: number }

/** The connection's token expires soon: the client answers with a `refresh` (in band). */
export interface TokenExpiringFrame { type: "token_expiring"; /** the token's `exp`, ms */ expires_at: number }

/** A `refresh` was taken: the connection runs on the new token, which expires then (ms). */
export interface RefreshedFrame { type: "refreshed"; expires_at: number; id?: RequestId }

export type ErrorCode =
  | "malformed" | "unknown_type" | "invalid_frame" | "forbidden" | "not_found" | "not_subscribed"
  | "text_too_long" | "too_many_subscriptions" | "turn_in_progress" | "no_active_turn"
  | "turn_mismatch" | "conflict" | "not_on_path" | "nothing_to_retry" | "nothing_to_undo"
  | "rate_limited" | "replication_timeout" | "invalid_request" | "unauthorized" | (string & {});

export interface ErrorFrame {
  type: "error";
  code: ErrorCode;
  message: string;
  id?: RequestId;
  chat_id?: string;
  /** A refused tree operation's: the conversation's head now (null for none). */
  head?: string | null;
}

/** The live conversation feed: every owned conversation, subscribed or not. */
export interface ConversationFrame {
  type: "conversation";
  chat_id: string;
  title: string | null;
  status: "idle" | "running";
  updated_at: number;
  last_seq: number;
  goal_state: GoalState | null;
  preview: string | null;
  /** Absent on a deletion. */
  usage?: UsageTotals;
  message_count?: number;
  /** A sub-conversation's parent (null for a top-level one); absent when deleted. */
  parent?: string | null;
  /** The agent that answers it; absent when deleted. */
  agent?: string;
  /** Its owner; absent when deleted. */
  owner?: string;
  /** Whom it is shared with besides its owner, {user_id: role}; absent when deleted. */
  members?: Record<string, "member" | "viewer">;
  created: boolean;
  deleted: boolean;
  /** With `deleted`: this user was removed from it (it is gone from their list only). */
  removed?: boolean;
}

/** A user's role in a conversation (protocol.md, "Shared conversations"). */
export type Role = "owner" | "member" | "viewer";

/** Who shares a conversation: its owner, and the others with their role. */
export interface Members {
  owner: string;
  members: Record<string, "member" | "viewer">;
}

/** Who shares a conversation changed (ephemeral, to its subscribers). */
export interface MembersFrame extends Members {
  type: "members";
  chat_id: string;
  ts: number;
}

/** This connection's user was removed from the conversation: its subscription ended. */
export interface RemovedFrame {
  type: "removed";
  chat_id: string;
  user_id: string;
  reason: string;
  ts: number;
}

/** The body of `PATCH /v1/conversations/{chat_id}/members` (at least one of the two). */
export interface MembersChange {
  set?: Record<string, "member" | "viewer">;
  remove?: string[];
}

/** Its reply: the whole list after the change, and whom it removed. */
export interface MembersResult extends Members {
  chat_id: string;
  removed: string[];
}

export interface SetMembersOptions {
  /** ms; default the client's httpTimeout. */
  timeout?: number;
  signal?: AbortSignal;
}

/** The `members` event: who shares a chat now. */
export interface MembersEvent extends Members {
  chatId: string;
  frame: MembersFrame;
}

/** The `removed` event: the chat's subscription ended for good (not resubscribed). */
export interface RemovedEvent {
  chatId: string;
  userId: string;
  /** The gateway's words, for people. */
  reason: string;
  frame: RemovedFrame;
}

/** Any event of a conversation. `seq` is null on ephemeral events (deltas, usually). */
export interface EventFrame<T extends string = string, D = Record<string, unknown>> {
  type: T;
  chat_id: string;
  seq: number | null;
  ts: number;
  data: D;
  /** A streamed delta's place in its stream (an answer being written). */
  stream?: { id: string; pos: number };
  /** The tree node a durable event belongs to (a msg_id or a turn_id); none on
   * conversation-level events (title, goal_state, head, ...). */
  node?: string;
}

export type UserMessageEvent = EventFrame<"user_message", {
  text: string; client_msg_id: string; user_id: string; data?: Record<string, unknown>;
  msg_id: string; parent_id: string | null; edit_of?: string;
}>;
export type TurnStartEvent = EventFrame<"turn_start", {
  turn_id: string; started_at: number; parent_id: string; retry_of?: string;
}>;
/** Every move of the conversation's head. */
export type HeadMovedEvent = EventFrame<"head", {
  head_id: string | null; prev_head_id: string | null;
  cause: "message" | "retry" | "edit" | "undo" | "switch" | "answer"; by: string;
}>;
export type CancelRequestedEvent = EventFrame<"cancel_requested", { turn_id: string }>;
export type TurnEndEvent = EventFrame<"turn_end", {
  turn_id: string;
  latency_ms: number;
  goal_state: GoalState | null;
  /** awaiting_input: the agent asked a person (a client tool) and waits for the answer. */
  reason: "complete" | "cancelled" | "error" | "timeout" | "awaiting_input";
  usage: Record<string, unknown> | null;
  /** With reason "error" (or a timeout with no worker): what went wrong, in words. */
  error?: string;
}>;
export type GoalStateEvent = EventFrame<"goal_state", GoalState>;
export type TitleEvent = EventFrame<"title", { title: string; previous: string | null; source: string }>;
export type DeletedEvent = EventFrame<"deleted", { epoch: string; last_seq: number }>;
/** A sub-conversation was opened (conversation-level: no `node`). */
export type ChildEvent = EventFrame<"child", { chat_id: string; title: string | null }>;
/**
 * The agent called a tool: `args` as JSON once complete (else the text it sent). `awaiting`:
 * a client tool, asking a person (answer it with GatewayClient.answer()).
 */
export type ToolCallEvent = EventFrame<"tool_call", {
  call_id: string; name: string; args: unknown; awaiting?: boolean;
}>;
/**
 * What the tool call `call_id` returned. A person's answer to a client tool is a node of the
 * tree (`msg_id`, under the turn `parent_id` that asked) and says who answered (`by`).
 */
export type ToolResultEvent = EventFrame<"tool_result", {
  call_id: string; result: unknown; by?: string; msg_id?: string; parent_id?: string;
}>;
/** The conversation's client tools were declared (the whole list; conversation-level). */
export type ClientToolsEvent = EventFrame<"client_tools", { tools: ClientTool[] }>;
/** Ephemeral (seq null): a step of the agent's run started or finished ("searching…"). */
export type StepEvent = EventFrame<"step", { name: string; status: "started" | "finished" }>;
/** The agent's whole state after a change (conversation-level: no `node`). */
export type StateEvent = EventFrame<"state", { snapshot: unknown }>;
/** An agent's own event (AG-UI `CUSTOM`). */
export type CustomEvent = EventFrame<"custom", { name: string; value: unknown }>;

/** A page of `GET /v1/conversations/{chat_id}/events`. */
export interface HistoryPage {
  chat_id: string;
  epoch: string;
  last_seq: number;
  next_after: number | null;
  /** The head as of last_seq. */
  head?: string | null;
  /** `view=active` (the default): the siblings of each node of the path that has some. */
  forks?: Record<string, { siblings: string[]; index: number }>;
  events: EventFrame[];
}

/** A page of `GET /v1/conversations`. */
export interface ConversationPage {
  conversations: Conversation[];
  /** Give it as `cursor` for the next page; null on the last. */
  next_cursor: string | null;
}

/** A conversation as the HTTP API shows it. */
export interface Conversation {
  chat_id: string;
  owner: string;
  title: string | null;
  status: "idle" | "running";
  turn_id: string | null;
  epoch: string;
  last_seq: number;
  created_at: number;
  updated_at: number;
  goal_state: GoalState | null;
  preview: string | null;
  head: string | null;
  usage: UsageTotals;
  /** User messages and turns on the active path. */
  message_count: number;
  /** The conversation this one is a sub-conversation of, or null. */
  parent: string | null;
  /** The agent that answers it. */
  agent: string;
  /** The tools its agent may call to ask a person (`PATCH` declares them). */
  client_tools?: ClientTool[];
  /** The client tool calls that wait for a person's answer: {call_id: tool name}. */
  awaiting?: Record<string, string>;
}

/** A client tool: what the agent passes, and (optionally) what a person answers, as JSON Schemas. */
export interface ClientTool {
  name: string;
  description?: string;
  /** The JSON Schema (2020-12) of the arguments. */
  parameters: Record<string, unknown>;
  /** The JSON Schema of the answer; null or absent: any answer. */
  result?: Record<string, unknown> | null;
}

/** An agent with a live worker now (`GET /v1/agents`). */
export interface AgentInfo {
  name: string;
  /** "handler" (a Python handler), or an agent the gateway drives. */
  kind: "handler" | "ag-ui" | "openai" | (string & {});
  /** Its workers heard from in the last 10 s. */
  workers: number;
}

/** `GET /v1/agents`. */
export interface AgentList {
  agents: AgentInfo[];
}

/** `POST /v1/ws-ticket`: a single-use connection ticket for `GET /v1/ws?ticket=`. */
export interface WsTicket {
  ticket: string;
  /** Seconds it stays valid: at most 30, never past the token's expiry. */
  expires_in: number;
}

export type ServerFrame =
  | HelloFrame | SubscribedFrame | UnsubscribedFrame | LeftFrame | AckFrame | PongFrame
  | ErrorFrame | ConversationFrame | PresenceFrame | TypingFrame | TypedFrame
  | TokenExpiringFrame | RefreshedFrame | MembersFrame | RemovedFrame | EventFrame;

// --- the client --------------------------------------------------------------------------

export type ConnectionState = "idle" | "connecting" | "open" | "reconnecting" | "closed";

export interface TokenRequest {
  /**
   * "connect" (first attempt), "reconnect", "expired" (the last close was 4011),
   * "refresh" (the connection's token expires soon: a fresh one is sent in band, for the same
   * user and role; returning the token the connection runs on sends nothing), or "request"
   * (an HTTP call: request(), listConversations(), createConversation(), listAgents()).
   */
  reason: "connect" | "reconnect" | "expired" | "refresh" | "request";
  lastClose: { code: number; reason: string } | null;
}

/**
 * A token, or a callback asked before every connection attempt and before the token expires
 * on an open connection (reason "refresh"): return a fresh one.
 */
export type TokenSource = string | null | ((request: TokenRequest) => string | Promise<string>);

export interface GatewayClientOptions {
  /** ws(s)://host/v1/ws; defaults to the page's host. */
  url?: string;
  token?: TokenSource;
  /**
   * Connect with a single-use ticket (`POST /v1/ws-ticket`, then `?ticket=`) instead of
   * `?token=`, so the token is in no URL. Default: true when a token is given, `fetch`
   * exists and the gateway is on the page's origin (or there is no page); false sends
   * `?token=`. A ticket refused with 401 stops the client as a 4001 close would.
   */
  useTicket?: boolean;
  /** The HTTP API's origin (default: `url`'s, ws -> http, wss -> https). */
  httpUrl?: string;
  /** Every HTTP call gives up after this many ms (default 10000). */
  httpTimeout?: number;
  /**
   * On a reconnect, a ticket request with no reply after this many ms (default 1000) is sent
   * again beside it, on another connection (the first may ride a keep-alive connection that
   * died with the network), up to 4 at once; the first ticket wins, the rest are aborted.
   */
  ticketRetryAfter?: number;
  /** A WHATWG fetch (defaults to globalThis.fetch). */
  fetch?: typeof fetch;
  /** A WHATWG WebSocket constructor (defaults to globalThis.WebSocket). */
  WebSocket?: { new (url: string, protocols?: string | string[]): WebSocket };
  /**
   * The first reconnect after an open socket went (a 1012 restart, a dead network) waits a
   * random 0 to reconnectJitter ms (default 500), so a pod's clients do not arrive together.
   */
  reconnectJitter?: number;
  /**
   * For 30 s after a 1012 (a gateway restarting, back within seconds) failed attempts wait
   * at most this many ms (default 2000) rather than growing to maxDelay.
   */
  restartMaxDelay?: number;
  /** Backoff base for attempts that failed, ms (default 500). */
  initialDelay?: number;
  /** Backoff cap, ms (default 15000). */
  maxDelay?: number;
  /** No `hello` within this many ms: the attempt counts as failed (default 10000). */
  connectTimeout?: number;
  /** Wait before resending unanswered requests after `rate_limited` (default 1000 ms). */
  rateLimitRetry?: number;
  /** Random source in [0, 1), for the jitter (tests). */
  random?: () => number;
  /** Nothing received for this many ms: send a ping (default 5000). */
  idlePing?: number;
  /** No answer to that ping within this many ms: the socket is dead, reconnect (default 5000). */
  pongTimeout?: number;
  /** While a subscribed chat streams an answer or runs a turn: ping after this many ms (default 2000). */
  activePing?: number;
  /** ...and give up on the socket after this many more (default 2500): noticed within 5 s. */
  activePongTimeout?: number;
}

/** An answer being written, as the client holds it. */
export interface StreamState {
  id: string;
  /** "delta", "reasoning_delta", ... */
  type: string;
  turnId: string | null;
  /** Everything streamed so far: show it as is. */
  text: string;
  /** Position of the next delta. */
  pos: number;
}

/**
 * A stream changed. `stream` holds its whole text (after a delta, or `reset` by a snapshot
 * after a (re)subscribe), or is null when it `ended`: "committed" (the durable `frame`, a
 * `message` or `reasoning`, holds the final text), "discarded" (a redelivered turn starts
 * over) or "gone" (ended while this client was away).
 */
export interface StreamEvent {
  chatId: string;
  id: string;
  stream: StreamState | null;
  reset?: true;
  ended?: "committed" | "discarded" | "gone";
  frame?: EventFrame;
}

// --- the conversation tree ----------------------------------------------------------------

/** A node of a conversation tree: a user message or a turn. */
export interface TreeNode {
  id: string;
  kind: "user" | "turn";
  /** The turn a message follows (null: a first message), or the message a turn answers. */
  parentId: string | null;
  /** The seq of the event that created it (null for a placeholder). */
  seq: number | null;
  /** Its creating event was seen (else it is known from a page's `forks` only). */
  seen: boolean;
  /** Its children, in creation order. */
  children: string[];
}

/** A node's versions (itself included), in creation order, and its place among them. */
export interface Siblings {
  ids: string[];
  index: number;
}

/** The head moved, to `head` from `previous` (null: no node). */
export interface HeadMove {
  head: string | null;
  previous: string | null;
  /** The seq the new head is known at (null when not told). */
  seq: number | null;
  /** From a `head` event: "message", "retry", "edit", "undo", "switch"; else null. */
  cause: string | null;
  by: string | null;
}

/** A chat's head moved (a `head` event, a snapshot, an ack, a history page). */
export interface HeadChange extends HeadMove {
  chatId: string;
  /** The `head` event, when one moved it. */
  frame?: EventFrame;
}

/** A conversation's tree as a client holds it (the Python SDK's gateway/sdk/tree.py). */
export declare class ConversationTree {
  constructor();
  nodes: Map<string, TreeNode>;
  /** The first messages (and their edits), in creation order. */
  roots: string[];
  head: string | null;
  /** Told the head at all (null is a head too). */
  headKnown: boolean;
  /** The seq the head is known at: older news never moves it back. */
  headSeq: number;
  reset(): void;
  /** A durable event frame; returns the head's move when it moved. */
  apply(frame: EventFrame): HeadMove | null;
  /** The head as of `seq`; a null seq is taken only when no head is known. */
  setHead(head: string | null, seq: number | null): HeadMove | null;
  loadPage(page: HistoryPage): HeadMove | null;
  loadForks(forks: Record<string, { siblings: string[]; index: number }>): void;
  /** The active path's node ids, root first. */
  path(): string[];
  onPath(nodeId: string | null | undefined): boolean;
  /** Whether an event belongs on the active path (its node is on it, or it has none). */
  visible(frame: { node?: string | null }): boolean;
  siblings(nodeId: string): Siblings;
  /** The siblings of every node on the active path that has some. */
  forks(): Record<string, Siblings>;
  /** Nodes of the active path whose events the client may not hold: reload the history. */
  missing(): string[];
}

export interface TreeOpOptions {
  /**
   * The head the operation expects: by default the head the client knows (nothing when it
   * knows none); null for none; false to send none (apply to whatever the head is).
   */
  expectedHead?: string | null | false;
  /** End a running turn first instead of being refused with turn_in_progress. */
  cancel?: boolean;
}

export interface EditOptions extends TreeOpOptions {
  clientMsgId?: string;
}

export interface StateChange {
  state: ConnectionState;
  /** Attempts since the last open socket (1: the first reconnect, which goes out at once). */
  attempt: number;
  /** Close code that caused this state, when there was one. */
  code?: number;
  reason?: string;
  /** "reconnecting": the real wait before the next attempt (ms) and when it ends (epoch ms). */
  delay?: number;
  retryAt?: number;
  /** "closed": true when a terminal close code (4001/4003/4004/4005) stopped the client. */
  terminal?: boolean;
  connectionId?: string;
}

export interface SubscribedEvent {
  chatId: string;
  frame: SubscribedFrame;
  /** How the client subscribed: resumed with `since`, drained the buffer, repeated, or fresh. */
  mode: "since" | "buffer" | "again" | "fresh";
}

/** The gateway could not replay the gap (`recovered: false`): reload the history over HTTP. */
export interface RecoveryEvent {
  chatId: string;
  recovered: false;
  epoch: string;
  seq: number;
  frame: SubscribedFrame;
}

/** A durable seq, or a stream's position (`stream` set), skipped ahead: the client resyncs. */
export interface GapEvent { chatId: string; expected: number; got: number; stream?: string }
export interface ClosedEvent { code: number; reason: string; terminal: boolean }

/** The connection runs on a fresh token now, refreshed in band: no reconnect, no replay. */
export interface TokenRefreshedEvent {
  /** The new token's expiry (epoch ms). */
  expiresAt: number;
  frame: RefreshedFrame;
}

/**
 * The token could not be refreshed in band: the connection closes with 4011 at `expiresAt`
 * and reconnects with a fresh token from the callback (reason "expired"), as before.
 */
export interface TokenRefreshFailedEvent {
  /** The expiry (epoch ms) of the token the connection still runs on. */
  expiresAt: number;
  /**
   * Why: the gateway's refusal (code "unauthorized" or "forbidden", with its frame),
   * "token_callback" (it threw or gave no token), or "token_unchanged" (it gave the token
   * the connection already runs on: nothing was sent).
   */
  error: GatewayError;
}

/**
 * A connection opened after another was lost, and its conversation feed is live: feed
 * frames sent meanwhile are not replayed, so list the conversations again
 * (listConversations()) to catch up.
 */
export interface FeedGapEvent { connectionId: string }

/**
 * A live chat's presence list changed (a newer one came: `frame`, or the `subscribed`
 * snapshot's), or is no longer known (null: unsubscribed, left, deleted, disconnected).
 */
export interface PresenceEvent {
  chatId: string;
  presence: PresenceList | null;
  frame?: PresenceFrame;
}

/**
 * Who is typing in a chat now (GatewayClient.typing()): after a `typing` frame (`frame`),
 * and when a typing ended (its time was up, its user sent a message or left).
 */
export interface TypingEvent {
  chatId: string;
  users: string[];
  frame?: TypingFrame;
}

export interface GatewayClientEvents {
  state: StateChange;
  hello: HelloFrame;
  subscribed: SubscribedEvent;
  /** Each conversation event once, in order (durable ones de-duplicated by seq). */
  event: EventFrame;
  recovery: RecoveryEvent;
  gap: GapEvent;
  stream: StreamEvent;
  /** The browser lost the network: the socket is dropped at once and the client reconnects. */
  offline: Record<string, never>;
  /** The network is back: the client reconnects (or checks its socket) at once. */
  online: Record<string, never>;
  conversation: ConversationFrame;
  /** Reconnected: the feed missed what changed meanwhile; list the conversations again. */
  feed_gap: FeedGapEvent;
  /** A chat's head moved: show its new active path. */
  head: HeadChange;
  /** Who is connected to a live chat changed: show presence. */
  presence: PresenceEvent;
  /** Who is typing in a live chat changed. */
  typing: TypingEvent;
  /** Who shares a chat changed (a `members` frame): members() has the list. */
  members: MembersEvent;
  /**
   * This user was removed from a chat: its subscription ended and the client forgot it
   * (never resubscribed; its queued writes reject with "forbidden"). Close it.
   */
  removed: RemovedEvent;
  ack: AckFrame;
  error: ErrorFrame;
  closed: ClosedEvent;
  /** The token was refreshed in band (on `token_expiring`, through the token callback). */
  token_refreshed: TokenRefreshedEvent;
  /** An in-band refresh failed or had nothing to send: a reconnect follows at expiry. */
  token_refresh_failed: TokenRefreshFailedEvent;
}

export interface SubscribeOptions {
  /** Resume point, e.g. {seq: last_seq, epoch} of a history page just loaded over HTTP. */
  since?: Since | null;
  /**
   * false: a conversation that does not exist is not created (opening a link must not
   * write); subscribe() rejects with code "not_found". Kept for the chat's resubscribes.
   * Default true.
   */
  create?: boolean;
  /**
   * The agent that answers the conversation, should this subscribe create it (ignored when
   * it exists). Default: the gateway's (`GATEWAY_DEFAULT_AGENT`). Kept for the resubscribes.
   */
  agent?: string | null;
}

export interface RequestOptions {
  /** A JSON body. */
  body?: unknown;
  /** ms; default the client's httpTimeout. */
  timeout?: number;
  signal?: AbortSignal;
}

export interface ListConversationsOptions {
  limit?: number;
  cursor?: string;
  /** Per attempt, ms; default the client's httpTimeout. */
  timeout?: number;
  /** Stop retrying. */
  signal?: AbortSignal;
}

export interface CreateConversationOptions {
  /** Default: the gateway makes one. */
  chat_id?: string;
  title?: string;
  /** The agent that answers it (listAgents()); default the gateway's, or the parent's. */
  agent?: string;
  /** Open it as a sub-conversation of this one. */
  parent_chat_id?: string;
  /** ms; default the client's httpTimeout. */
  timeout?: number;
  signal?: AbortSignal;
}

export interface ListAgentsOptions {
  /** ms; default the client's httpTimeout. */
  timeout?: number;
  signal?: AbortSignal;
}

export interface SendMessageOptions {
  /** Defaults to a fresh id; it is reused for every retry of this message. */
  clientMsgId?: string;
  data?: Record<string, unknown>;
}

export declare class GatewayError extends Error {
  constructor(code: string, message?: string, frame?: ErrorFrame | null, status?: number | null);
  /** An HTTP call's: the error reply's code, or "timeout", "network", "aborted", "http_error". */
  readonly code: ErrorCode | "not_connected" | "disconnected" | "timeout" | "network" | "aborted"
    | "unauthorized" | "http_error" | "token_callback" | "token_unchanged";
  readonly frame: ErrorFrame | null;
  /** The HTTP status of an HTTP call's error reply; null otherwise. */
  readonly status: number | null;
  /** A refused tree operation: the head now (null: none); undefined when not said. */
  readonly head: string | null | undefined;
}

export declare function newClientMsgId(): string;
export declare function backoffDelay(attempt: number, initialDelay?: number, maxDelay?: number,
                                     random?: () => number): number;

export declare class GatewayClient {
  constructor(options?: GatewayClientOptions);
  readonly url: string;
  /** The HTTP API's origin. */
  readonly httpUrl: string;
  readonly state: ConnectionState;
  /** True once `hello` arrived on the current socket. */
  readonly connected: boolean;
  readonly hello: HelloFrame | null;
  /** Messages and cancels not answered yet (queued or in flight). */
  readonly outboxSize: number;
  /** Chats the app wants live. */
  readonly subscriptions: string[];
  /** Durable events dropped because their seq was already delivered. */
  readonly duplicatesDropped: number;

  on<K extends keyof GatewayClientEvents>(type: K, listener: (event: GatewayClientEvents[K]) => void): () => void;
  off<K extends keyof GatewayClientEvents>(type: K, listener: (event: GatewayClientEvents[K]) => void): void;

  connect(): void;
  close(): void;
  reconnectNow(): void;
  setToken(token: TokenSource): void;
  /** Round-trip time in ms. */
  ping(): Promise<number>;
  /**
   * An HTTP API call with the client's token and a timeout; resolves with the JSON reply
   * (null for none). Rejects with a GatewayError (the reply's code and status, or "timeout",
   * "network", "aborted").
   */
  request(method: string, path: string, options?: RequestOptions): Promise<any>;
  /**
   * `GET /v1/conversations`, each attempt with a timeout, retried after a backoff until it
   * succeeds (an error reply or the signal rejects). On load and on every `feed_gap`.
   */
  listConversations(options?: ListConversationsOptions): Promise<ConversationPage>;
  /**
   * `POST /v1/conversations`, once (never retried by itself); resolves with the
   * conversation. Rejects with a GatewayError (409 "conflict": the chat_id is taken).
   */
  createConversation(options?: CreateConversationOptions): Promise<Conversation>;
  /** `GET /v1/agents`: the agents with a live worker now. */
  listAgents(options?: ListAgentsOptions): Promise<AgentList>;
  /**
   * `PATCH /v1/conversations/{chat_id}/members` (its owner or a service), once: resolves
   * with the list after the change (members() keeps it). Rejects with a GatewayError (403
   * "forbidden", 400 "invalid_request", 404 "not_found").
   */
  setMembers(chatId: string, change: MembersChange, options?: SetMembersOptions): Promise<MembersResult>;
  /** Who shares a conversation, as last heard (feed, `members` frames, setMembers()); null: not known. */
  members(chatId: string): Members | null;
  /** A user's role in it (default: this connection's user); null: none, or not known. */
  role(chatId: string, userId?: string | null): Role | null;

  /**
   * Resolves with the `subscribed` frame, or null if unsubscribed, left or deleted before it
   * came. Rejects with a GatewayError when the gateway refuses (e.g. code "forbidden",
   * "not_found", "too_many_subscriptions"); the client then forgets the chat.
   */
  subscribe(chatId: string, options?: SubscribeOptions): Promise<SubscribedFrame | null>;
  unsubscribe(chatId: string): Promise<UnsubscribedFrame | null>;
  leave(chatId: string): Promise<LeftFrame | null>;
  position(chatId: string): Since | null;
  /** The chat's open streams (answers being written) with their text so far. */
  streams(chatId: string): StreamState[];

  /** Rejects with a GatewayError (e.g. code "turn_in_progress", "text_too_long"). */
  sendMessage(chatId: string, text: string, options?: SendMessageOptions): Promise<AckFrame>;
  /** Resolves with the ack, or null when a retry found the turn already cancelled. */
  cancel(chatId: string, turnId?: string): Promise<AckFrame | null>;

  /** The chat's tree (read only), or null for a chat the client does not hold. */
  tree(chatId: string): ConversationTree | null;
  /** The node the next message follows; null for none, undefined when not known. */
  head(chatId: string): string | null | undefined;
  /** The active path's node ids, root first. */
  activePath(chatId: string): string[];
  siblings(chatId: string, nodeId: string): Siblings;
  /** Fill the chat's tree from a history page (events, forks, head). */
  loadHistory(chatId: string, page: HistoryPage): void;

  /** Tree operations; each rejects with a GatewayError carrying `head` when refused. */
  retry(chatId: string, options?: TreeOpOptions): Promise<AckFrame>;
  edit(chatId: string, msgId: string, text: string, options?: EditOptions): Promise<AckFrame>;
  /** The ack's `text` is the message taken back. */
  undo(chatId: string, options?: TreeOpOptions): Promise<AckFrame>;
  switch(chatId: string, nodeId: string, options?: TreeOpOptions): Promise<AckFrame>;

  /**
   * A person's answer to a client tool call that waits for one: resolves with the ack (the
   * new turn's `turn_id`, `head`, the answer's `msg_id`). Rejects with a GatewayError:
   * "conflict" (another answer won, or the question was left unanswered), "invalid_request"
   * (it does not fit the tool's `result` schema), "disconnected" (written, then the
   * connection dropped: it is not sent again), "not_found", "forbidden".
   */
  answer(chatId: string, callId: string, result: unknown): Promise<AckFrame>;
  /**
   * The chat's client tool calls waiting for a person's answer, {call_id: tool name}, from
   * the last snapshot and live since; null until a snapshot told.
   */
  awaiting(chatId: string): Record<string, string> | null;

  /**
   * Who is connected to a live chat now (users with their connections, the agents running
   * a turn in it): the newest list (highest `v`) since it went live on this connection;
   * null before the first and while it is not live (unsubscribed, disconnected).
   */
  presence(chatId: string): PresenceList | null;
  /**
   * The users typing in a live chat now, sorted: heard within three `typing_interval`s, not
   * since sent a message or left. This client's own user is in it when another of their
   * devices types.
   */
  typing(chatId: string): string[];
  /**
   * The person is typing: call it on every change of the message box. At most one `typing`
   * per `typing_interval` goes out per chat (sooner, or not connected: false at once);
   * resolves with the `typed` reply's `sent` (false if the connection drops first). Rejects
   * with a GatewayError "not_subscribed" for a chat not live on this connection.
   */
  sendTyping(chatId: string): Promise<boolean>;
}

export default GatewayClient;
