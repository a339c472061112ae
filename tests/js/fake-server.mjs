// A fake gateway for the tests of gateway-client.js: a real WebSocket server (the `ws`
// package) on 127.0.0.1 that speaks only what each test scripts, frame by frame, from the
// gateway side of protocol.md. The client under test is the real gateway-client.js, with
// `ws` as its WebSocket.

import { once } from "node:events";
import { createServer } from "node:http";
import { setTimeout as sleep } from "node:timers/promises";
import { WebSocket, WebSocketServer } from "ws";

import { GatewayClient, JSON_SUBPROTOCOL } from "../../gateway/static/gateway-client.js";

/**
 * Wait until `cond()` holds: checked now, then every 2 ms; throws naming `what` when it still
 * does not hold after `ms`. The tests' one polling primitive: they wait for an event or a
 * state with it (or for a promise, with a timeout), never for a fixed time.
 */
export async function until(cond, what, ms = 5000) {
  const end = Date.now() + ms;
  while (!cond()) {
    if (Date.now() > end) throw new Error(`timed out after ${ms} ms waiting for: ${what}`);
    await sleep(2);
  }
}

/**
 * `ws` as a browser-like WebSocket. ws emits an "error" event when a socket is closed before
 * its handshake finished (the client's close() while connecting), and an EventEmitter
 * "error" without a listener is thrown; a browser (or Node 22's WebSocket) reports it as an
 * error event and moves on. The client detaches its handlers before closing, so listen here.
 */
export class NodeWebSocket extends WebSocket {
  constructor(url, protocols) {
    super(url, protocols);
    this.on("error", () => {});
  }
}

/** One connection the fake gateway accepted: what the client sent, and the server's side. */
export class FakeConnection {
  constructor(server, ws, req) {
    this.server = server;
    this.ws = ws;
    this.index = server.connections.length + 1;
    this.id = "conn-" + this.index;
    this.path = req.url; // "/v1/ws?token=..."
    const query = new URL(req.url, "http://gateway.test").searchParams;
    this.token = query.get("token");
    this.ticket = query.get("ticket");
    this.protocol = ws.protocol; // the subprotocol the server selected
    this.received = []; // every frame the client sent, parsed, in order
    this._taken = new Map(); // type -> how many of its frames next() returned
    this.answerPings = server.answerPings;
    this.closed = false;
    ws.on("message", (data, isBinary) => {
      const frame = JSON.parse(isBinary ? Buffer.from(data).toString() : data.toString());
      this.received.push(frame);
      if (frame.type === "ping" && this.answerPings) this.push({ type: "pong", id: frame.id, ts: Date.now() });
    });
    ws.on("close", () => { this.closed = true; });
  }

  /** The first frame of a connection (`limits` override the defaults). */
  hello(user = "u1", limits = {}) {
    this.push({
      type: "hello", connection_id: this.id, user_id: user, role: "user", heartbeat_interval: 25,
      protocol: "v1", limits: {
        max_frame_bytes: 65536, max_text_bytes: 32768, max_subscriptions: 256, replay_limit: 1000,
        rate_limit: 50, buffer_max_frames: 1000, buffer_max_bytes: 1048576, buffer_ttl: 900,
        typing_interval: 2, ...limits,
      },
    });
  }

  /** Send frames to the client, in order. */
  push(...frames) {
    for (const frame of frames) this.ws.send(JSON.stringify(frame));
  }

  /** Answer a `subscribe` request (fields override the defaults). */
  subscribed(req, fields = {}) {
    this.push({
      type: "subscribed", chat_id: req.chat_id, id: req.id, epoch: "e1", seq: 0, recovered: true,
      replayed: 0,
      snapshot: { title: null, status: "idle", turn_id: null, started_at: null, goal_state: null },
      ...fields,
    });
  }

  /** Say the connection's token expires at `expiresAt` (ms): the client should `refresh`. */
  tokenExpiring(expiresAt) {
    this.push({ type: "token_expiring", expires_at: expiresAt });
  }

  /**
   * Answer the client's next `refresh` on this connection: `refreshed` with `expiresAt`, or,
   * with `refuse` set, an `error` of that code (as the gateway refuses an invalid token or
   * one of another user). Returns the request.
   */
  async answerRefresh({ expiresAt = Date.now() + 3600000, refuse = null } = {}) {
    const req = await this.next("refresh");
    if (refuse) this.push({ type: "error", code: refuse, message: "refresh refused", id: req.id });
    else this.push({ type: "refreshed", expires_at: expiresAt, id: req.id });
    return req;
  }

  /**
   * End the connection: a close frame with `code`, or for 1006 (which no close frame may
   * carry) the TCP connection cut without one, as a network drop does.
   */
  drop(code = 1006, reason = "") {
    if (code === 1006) this.ws.terminate();
    else this.ws.close(code, reason);
  }

  /** Frames of one type the client sent, in order. */
  of(type) { return this.received.filter((f) => f.type === type); }
  /** The last frame of a type the client sent. */
  last(type) { return this.of(type).at(-1); }
  /** What the client sent, as "type:text-or-chat", pings left out (tests use them to sync). */
  sequence() {
    return this.received.filter((f) => f.type !== "ping").map((f) => f.type + ":" + (f.text ?? f.chat_id));
  }

  /**
   * The client's next frame of `type` that no earlier next() returned (waiting for it if it
   * has not arrived yet): the 1st, then the 2nd, ...
   */
  async next(type, ms = 5000) {
    const n = (this._taken.get(type) ?? 0) + 1;
    await until(() => this.of(type).length >= n, `${this.id}: ${type} #${n}`, ms);
    this._taken.set(type, n);
    return this.of(type)[n - 1];
  }
}

export class FakeGateway {
  /** Listen on a free port of 127.0.0.1. `answerPings: false`: a gateway that went silent. */
  static async start({ answerPings = true } = {}) {
    const server = new FakeGateway(answerPings);
    server.http.listen(0, "127.0.0.1");
    await once(server.http, "listening");
    return server;
  }

  constructor(answerPings) {
    this.answerPings = answerPings;
    this.connections = [];
    // The HTTP side: every request recorded as {method, url, authorization} (and `body`, its
    // JSON body parsed, when it has one); `onHttp(req)` answers it ({status, body}, or null to
    // never answer) once its body is in; by default a ticket for `POST /v1/ws-ticket` with a
    // bearer token, and 404 otherwise.
    this.requests = [];
    this.tickets = []; // every ticket issued, in order
    this.onHttp = (req) => this.defaultHttp(req);
    this.http = createServer((req, res) => {
      const entry = { method: req.method, url: req.url, authorization: req.headers.authorization ?? null };
      this.requests.push(entry);
      // The client gave up on it (aborted: its connection closed) before any reply.
      res.on("close", () => { if (!res.writableFinished) entry.abandoned = true; });
      const chunks = [];
      req.on("data", (chunk) => chunks.push(chunk));
      req.on("end", () => {
        if (chunks.length) entry.body = JSON.parse(Buffer.concat(chunks).toString());
        const reply = this.onHttp(entry);
        if (!reply) return; // a request that never completes (a dead keep-alive connection)
        res.writeHead(reply.status, { "content-type": "application/json" });
        res.end(reply.body === undefined ? "" : JSON.stringify(reply.body));
      });
    });
    this.wss = new WebSocketServer({
      server: this.http, perMessageDeflate: false,
      handleProtocols: (protocols) => (protocols.has(JSON_SUBPROTOCOL) ? JSON_SUBPROTOCOL : false),
    });
    this.wss.on("connection", (ws, req) => this.connections.push(new FakeConnection(this, ws, req)));
  }

  defaultHttp({ method, url, authorization }) {
    if (method === "POST" && url === "/v1/ws-ticket" && authorization?.startsWith("Bearer ")) {
      const ticket = "tk" + (this.tickets.length + 1);
      this.tickets.push({ ticket, token: authorization.slice(7) });
      return { status: 200, body: { ticket, expires_in: 30 } };
    }
    return { status: 404, body: { error: { code: "not_found", message: "no such route" } } };
  }

  get port() { return this.http.address().port; }
  get url() { return `ws://127.0.0.1:${this.port}/v1/ws`; }
  get latest() { return this.connections.at(-1); }

  /** Wait until the client opened its n-th connection; return it. */
  async connection(n, ms = 5000) {
    await until(() => this.connections.length >= n, `connection #${n}`, ms);
    return this.connections[n - 1];
  }

  /** Wait for the client's n-th connection, say hello on it, and wait until it is open. */
  async accept(client, n, user = "u1", limits = {}) {
    const conn = await this.connection(n);
    conn.hello(user, limits);
    await until(() => client.connected && client.hello?.connection_id === conn.id, `${conn.id} open`);
    return conn;
  }

  async close() {
    for (const conn of this.connections) conn.ws.terminate();
    await new Promise((resolve) => this.wss.close(resolve));
    this.http.closeAllConnections();
    await new Promise((resolve) => this.http.close(resolve));
  }
}

/**
 * The real client against `server`, with `ws` as its WebSocket and tiny delays
 * (initialDelay 4 ms, maxDelay 20 ms, rateLimitRetry 5 ms) unless `options` says otherwise.
 */
export function makeClient(server, options = {}) {
  return new GatewayClient({
    url: server.url, token: "tok", WebSocket: NodeWebSocket, useTicket: false,
    initialDelay: 4, maxDelay: 20, rateLimitRetry: 5, ...options,
  });
}

/**
 * Wait until the client and the fake gateway have each handled everything the other sent
 * before this call: a ping and its pong travel behind it, in order, on the one socket.
 */
export async function roundTrip(client) {
  await client.ping();
}

/**
 * Answer the client's next `subscribe` on `conn` (fields override the reply's defaults) and
 * wait until the client handled the reply. Returns the request.
 */
export async function answerSubscribe(client, conn, fields = {}) {
  const req = await conn.next("subscribe");
  conn.subscribed(req, fields);
  await roundTrip(client);
  return req;
}

/** A conversation event frame (durable when seq is a number). */
export function ev(chatId, seq, type = "note", data = {}) {
  return { type, chat_id: chatId, seq, ts: 1, data };
}

/**
 * A started fake gateway and a client for one test, both closed after it (t.after).
 * Returns {server, client}.
 */
export async function setup(t, { server: serverOptions = {}, ...clientOptions } = {}) {
  const server = await FakeGateway.start(serverOptions);
  const client = makeClient(server, clientOptions);
  t.after(async () => {
    client.close();
    await server.close();
  });
  return { server, client };
}
