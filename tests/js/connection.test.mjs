// The connection: close codes, tokens, backoff, the silent-socket watchdog, online/offline.

import assert from "node:assert/strict";
import { test } from "node:test";

import {
  backoffDelay, GatewayError, TERMINAL_CLOSE_CODES,
} from "../../gateway/static/gateway-client.js";
import { FakeGateway, makeClient, roundTrip, setup, until } from "./fake-server.mjs";

/** Record the client's "closed" events; resolve `next()` with the next one. */
function closes(client) {
  const seen = [];
  client.on("closed", (c) => seen.push(c));
  return {
    seen,
    async next(what = "a close") {
      const n = seen.length + 1;
      await until(() => seen.length >= n, what);
      return seen[n - 1];
    },
  };
}

test("terminal close codes stop the client; 4011 gets a fresh token", async (t) => {
  let n = 0;
  const asked = [];
  const { server, client } = await setup(t, {
    token: async (req) => { asked.push(req.reason); return "t" + ++n; },
  });
  const states = [];
  client.on("state", (s) => states.push(s));
  const closed = closes(client);
  client.connect();
  let conn = await server.accept(client, 1);
  assert.equal(conn.token, "t1");
  conn.drop(4011, "token expired");
  conn = await server.accept(client, 2);
  assert.equal(conn.token, "t2", "fresh token");
  assert.equal(conn.path, "/v1/ws?token=t2");
  assert.deepEqual(asked, ["connect", "expired"]);
  assert.deepEqual(closed.seen, [{ code: 4011, reason: "token expired", terminal: false }]);

  conn.drop(4029, "too many");
  await server.accept(client, 3);
  const waited = states.filter((s) => s.state === "reconnecting" && s.code === 4029);
  assert.equal(waited.length, 1, "backs off after 4029");
  assert.ok(waited[0].delay >= 4, "never an instant retry after 4029: " + waited[0].delay);
  assert.equal(waited[0].reason, "too many");

  for (const code of [4001, 4003, 4004, 4005]) {
    assert.ok(TERMINAL_CLOSE_CODES.has(code), "terminal " + code);
    const before = server.connections.length;
    const seen = states.length;
    server.latest.drop(code, "no");
    assert.deepEqual(await closed.next(), { code, reason: "no", terminal: true });
    assert.equal(client.state, "closed", "closed after " + code);
    // The client decides while it handles the close: a retry is scheduled through
    // "reconnecting", on its one retry timer; an attempt starts with "connecting". None of it.
    assert.deepEqual(states.slice(seen), [{ state: "closed", attempt: 0, code, reason: "no", terminal: true }],
      "no reconnect after " + code);
    assert.equal(client._timer, undefined, "no retry timer after " + code);
    assert.equal(server.connections.length, before, "no reconnect after " + code);
    client.connect();
    await server.accept(client, before + 1);
  }
  assert.deepEqual(asked.slice(2), ["reconnect", "connect", "connect", "connect", "connect"]);
});

test("4005, disconnected by an administrator, stops the client with its reason", async (t) => {
  const { server, client } = await setup(t);
  const closed = closes(client);
  const states = [];
  client.on("state", (s) => states.push(s));
  client.connect();
  const conn = await server.accept(client, 1);
  const sub = client.subscribe("trip");
  const req = await conn.next("subscribe");
  conn.subscribed(req);
  await sub;
  conn.drop(4005, "account suspended");
  assert.deepEqual(await closed.next(), { code: 4005, reason: "account suspended", terminal: true });
  assert.equal(client.state, "closed");
  assert.deepEqual(states.at(-1), { state: "closed", attempt: 0, code: 4005, reason: "account suspended", terminal: true });
  assert.equal(client._timer, undefined, "no retry timer");
  // Longer than any backoff of this client (maxDelay 20 ms): still one connection.
  await new Promise((resolve) => setTimeout(resolve, 100));
  assert.equal(server.connections.length, 1, "no reconnect");
  assert.equal(client.state, "closed");
});

test("backoff is exponential with full jitter, reset by a hello", async (t) => {
  const caps = [0, 1, 2, 3, 4, 10].map((n) => backoffDelay(n, 500, 15000, () => 0.999999));
  assert.deepEqual(caps, [499, 999, 1999, 3999, 7999, 14999]);
  assert.equal(backoffDelay(3, 500, 15000, () => 0), 0, "full jitter reaches 0");
  assert.equal(backoffDelay(1000, 500, 15000, () => 0.5), 7500, "capped at maxDelay");
  for (let i = 0; i < 100; i++) {
    const d = backoffDelay(2);
    assert.ok(d >= 0 && d < 2000 && Number.isInteger(d), "defaults: 500 ms doubled: " + d);
  }

  const { server, client } = await setup(t, {
    initialDelay: 100, maxDelay: 1000, reconnectJitter: 30, random: () => 0.5,
  });
  const delays = [];
  client.on("state", (s) => { if (s.state === "reconnecting") delays.push(s.delay); });
  client.connect();
  for (let i = 1; i <= 4; i++) {
    const conn = await server.connection(i);
    conn.drop(1006); // before any hello
  }
  await until(() => delays.length === 4, "four waits");
  assert.deepEqual(delays, [50, 100, 200, 400], "grows");
  let conn = await server.accept(client, 5);
  conn.drop(1006);
  await until(() => delays.length === 5, "a fifth wait");
  assert.equal(delays[4], 15, "an open socket lost: back at once, within reconnectJitter");
  conn = await server.connection(6);
  conn.drop(1006); // that attempt failed: the backoff again, from its start
  await until(() => delays.length === 6, "a sixth wait");
  assert.equal(delays[5], 100, "then a failure backs off");
});

test("busy close codes (4029, 1013) wait at least initialDelay", async (t) => {
  const { server, client } = await setup(t, { initialDelay: 40, maxDelay: 1000, random: () => 0 });
  const waits = [];
  client.on("state", (s) => { if (s.state === "reconnecting") waits.push([s.code, s.delay]); });
  client.connect();
  (await server.accept(client, 1)).drop(1013, "backend unavailable");
  (await server.accept(client, 2)).drop(1012, "restart");
  await server.connection(3);
  assert.deepEqual(waits, [[1013, 40], [1012, 0]]);
});

test("a silent socket is dropped after idlePing + pongTimeout and replaced", async (t) => {
  const { server, client } = await setup(t, {
    server: { answerPings: false }, idlePing: 150, pongTimeout: 150,
  });
  const closed = closes(client);
  client.connect();
  const opened = Date.now(); // before the hello: the client hears it later, never earlier
  const conn = await server.accept(client, 1);
  const ping = await conn.next("ping", 2000);
  assert.equal(typeof ping.id, "number");
  assert.deepEqual(await closed.next("the watchdog"), { code: 1006, reason: "no answer to ping", terminal: false });
  const took = Date.now() - opened;
  assert.ok(took >= 300 && took < 1500, "noticed after idlePing + pongTimeout: " + took + " ms");
  await until(() => conn.closed, "the socket closed");
  await server.accept(client, 2);
});

test("a socket that answers pings is kept, and anything received counts as an answer", async (t) => {
  // (A pongTimeout well above the heartbeat's 100 ms tick: a loaded machine must not fail it.)
  const { server, client } = await setup(t, { idlePing: 100, pongTimeout: 300 });
  const closed = closes(client);
  /** The client's n-th ping on `conn`; fails at once if the client dropped the socket first. */
  const nthPing = async (conn, n) => {
    await until(() => conn.of("ping").length >= n || closed.seen.length > 0, `${conn.id}: ping #${n}`);
    assert.deepEqual(closed.seen, [], `kept until ping #${n}`);
    return conn.of("ping")[n - 1];
  };
  client.connect();
  const conn = await server.accept(client, 1);
  // Pinged when idle. The heartbeat sends no ping while one is unanswered (it drops the
  // socket instead): a second ping on the same socket means the pong answered the first.
  await nthPing(conn, 1);
  await nthPing(conn, 2);
  assert.equal(client.connected, true);

  // Any frame is an answer too: the gateway stops answering pings (the 2nd was answered on
  // arrival) and answers the 3rd with a feed frame instead.
  conn.answerPings = false;
  /** What the heartbeat consults, as the client handled each feed frame. */
  const heard = [];
  client.on("conversation", () => heard.push({ pingSent: client._pingSent, lastRx: client._lastRx }));
  await nthPing(conn, 3);
  const answered = Date.now();
  conn.push({
    type: "conversation", chat_id: "c1", title: null, status: "idle", updated_at: 1, last_seq: 0,
    goal_state: null, preview: null, created: false, deleted: false,
  });
  await until(() => heard.length === 1, "the feed frame handled");
  assert.equal(heard[0].pingSent, 0, "the feed frame answered the ping");
  assert.ok(heard[0].lastRx >= answered, "the feed frame counts as traffic: the idle time starts over");
  await nthPing(conn, 4); // kept: the heartbeat pings again when idle, rather than dropping it
  // Nothing answers the 4th: the watchdog drops the socket.
  assert.deepEqual(await closed.next("the watchdog"), { code: 1006, reason: "no answer to ping", terminal: false });
  assert.equal(conn.of("ping").length, 4, "no ping after the unanswered one");
});

test("no hello within connectTimeout: the attempt fails and the client retries", async (t) => {
  const { server, client } = await setup(t, { connectTimeout: 100 });
  const closed = closes(client);
  client.connect();
  const conn = await server.connection(1);
  assert.deepEqual(await closed.next("connect timeout"), { code: 1006, reason: "connect timeout", terminal: false });
  await until(() => conn.closed, "the abandoned socket closed");
  await server.accept(client, 2);
});

test("nothing listening: the client keeps retrying with backoff until a gateway is there", async (t) => {
  const server = await FakeGateway.start();
  const url = server.url;
  await server.close();
  const client = makeClient({ url }, { initialDelay: 4, maxDelay: 20 });
  t.after(() => client.close());
  const closed = closes(client);
  client.connect();
  await until(() => closed.seen.length >= 3, "three failed attempts");
  assert.ok(closed.seen.every((c) => c.code === 1006 && !c.terminal), JSON.stringify(closed.seen));
  assert.notEqual(client.state, "closed");
});

test("the token callback failing counts as a failed attempt", async (t) => {
  let calls = 0;
  const { server, client } = await setup(t, {
    token: () => { if (++calls === 1) throw new Error("auth server down"); return "ok"; },
  });
  const states = [];
  client.on("state", (s) => states.push(s));
  client.connect();
  const conn = await server.accept(client, 1);
  assert.equal(conn.token, "ok");
  assert.equal(states[1].state, "reconnecting");
  assert.equal(states[1].reason, "token callback failed: auth server down");
});

test("setToken replaces the token for the next attempt; no token, no query", async (t) => {
  const { server, client } = await setup(t, { token: null });
  client.connect();
  let conn = await server.accept(client, 1);
  assert.equal(conn.path, "/v1/ws");
  client.setToken("new token");
  conn.drop(1012);
  conn = await server.accept(client, 2);
  assert.equal(conn.path, "/v1/ws?token=new%20token");
});

test("ping() measures the round trip and fails without a connection", async (t) => {
  const { server, client } = await setup(t);
  await assert.rejects(client.ping(), (e) => e instanceof GatewayError && e.code === "not_connected");
  client.connect();
  const conn = await server.accept(client, 1);
  const rtt = await client.ping();
  assert.ok(typeof rtt === "number" && rtt >= 0 && rtt < 1000, "rtt " + rtt);
  conn.answerPings = false;
  const lost = client.ping();
  await conn.next("ping");
  await conn.next("ping");
  conn.drop(1006);
  await assert.rejects(lost, (e) => e instanceof GatewayError && e.code === "disconnected");
});

test("close() stops for good (queued messages stay queued) until connect()", async (t) => {
  const { server, client } = await setup(t);
  const states = [];
  client.on("state", (s) => states.push(s.state));
  client.connect();
  const conn = await server.accept(client, 1);
  const ws = client._ws; // the client's socket, read only: to wait for its close event
  client.close();
  assert.equal(client.state, "closed");
  assert.equal(states.at(-1), "closed");
  await until(() => conn.closed && ws.readyState === ws.CLOSED, "the socket closed, at both ends");
  client.sendMessage("c1", "later");
  assert.equal(client.outboxSize, 1);
  // The socket's close event has been dispatched; a retry is scheduled through
  // "reconnecting", on the one retry timer; an attempt starts with "connecting". None of it.
  assert.deepEqual(states, ["connecting", "open", "closed"], "no reconnect after close()");
  assert.equal(client._timer, undefined, "no retry timer after close()");
  assert.equal(server.connections.length, 1, "no reconnect after close()");
  client.connect();
  const conn2 = await server.accept(client, 2);
  assert.equal((await conn2.next("message")).text, "later");
});

test("offline drops the socket at once; online reconnects at once", async (t) => {
  // Node has no window: give globalThis the browser's addEventListener for this test.
  const target = new EventTarget();
  const saved = {};
  for (const name of ["addEventListener", "removeEventListener", "dispatchEvent"]) {
    saved[name] = Object.getOwnPropertyDescriptor(globalThis, name);
    globalThis[name] = target[name].bind(target);
  }
  t.after(() => {
    for (const [name, desc] of Object.entries(saved)) {
      if (desc) Object.defineProperty(globalThis, name, desc);
      else delete globalThis[name];
    }
  });
  // A backoff far longer than the test: only the online event can bring it back in time.
  const { server, client } = await setup(t, { initialDelay: 60_000, maxDelay: 60_000, random: () => 0.5 });
  const events = [];
  const waits = []; // the delay of each retry the client scheduled
  client.on("offline", () => events.push("offline"));
  client.on("online", () => events.push("online"));
  client.on("state", (s) => {
    events.push(s.state);
    if (s.state === "reconnecting") waits.push(s.delay);
  });
  client.connect();
  let conn = await server.accept(client, 1);

  // Online while connected: a ping checks the socket (the network may have changed).
  globalThis.dispatchEvent(new Event("online"));
  await conn.next("ping");

  events.length = 0;
  globalThis.dispatchEvent(new Event("offline"));
  assert.deepEqual(events, ["offline", "reconnecting"], "dropped at once");
  // Waiting for the network: the one retry scheduled is the backoff's (random 0.5 of 60 s),
  // not the at-once retry (0.5 of reconnectJitter) after an open socket went.
  assert.deepEqual(waits, [30_000], "waiting for the network");
  await until(() => conn.closed, "the socket closed");
  assert.equal(server.connections.length, 1, "waiting for the network");
  globalThis.dispatchEvent(new Event("online"));
  conn = await server.accept(client, 2);
  // No attempt before the online event: every attempt starts with "connecting".
  assert.deepEqual(events, ["offline", "reconnecting", "online", "connecting", "open"]);
  assert.deepEqual(waits, [30_000], "online: no wait");

  client.close();
  events.length = 0;
  globalThis.dispatchEvent(new Event("offline"));
  assert.deepEqual(events, [], "close() removed the listeners");
});

test("after a 1012 the first reconnect goes out at once, within reconnectJitter", async (t) => {
  let r = 0.25;
  const { server, client } = await setup(t, {
    initialDelay: 100, maxDelay: 1000, reconnectJitter: 400, random: () => r,
  });
  const waits = [];
  client.on("state", (s) => { if (s.state === "reconnecting") waits.push([s.code, s.attempt, s.delay]); });
  client.connect();
  (await server.accept(client, 1)).drop(1012, "server restarting");
  await server.connection(2);
  assert.deepEqual(waits, [[1012, 1, 100]], "the real wait: 0.25 of 400 ms");
  r = 0.999;
  (await server.connection(2)).drop(1006); // the gateway is not back yet
  (await server.connection(3)).drop(1006);
  await server.connection(4);
  assert.deepEqual(waits.slice(1), [[1006, 2, 199], [1006, 3, 399]], "failures back off");
});

test("while an answer streams, silence is noticed within activePing + activePongTimeout", async (t) => {
  const { server, client } = await setup(t, {
    server: { answerPings: false }, idlePing: 60_000, pongTimeout: 60_000,
    activePing: 150, activePongTimeout: 150,
  });
  const closed = closes(client);
  client.connect();
  const conn = await server.accept(client, 1);
  const subscribed = client.subscribe("c1");
  const req = await conn.next("subscribe");
  conn.subscribed(req);
  await subscribed;
  // What the heartbeat asks before it picks idlePing or activePing (no wait for an absence).
  assert.equal(client._expecting(), false, "idle: the long idlePing applies");
  // A delta opens a stream: tokens are expected now.
  conn.push({ type: "delta", chat_id: "c1", seq: null, ts: 1, stream: { id: "s1", pos: 0 }, data: { text: "Hi" } });
  const sent = Date.now();
  await conn.next("ping", 2000);
  assert.deepEqual(await closed.next("the watchdog"), { code: 1006, reason: "no answer to ping", terminal: false });
  const took = Date.now() - sent;
  assert.ok(took >= 300 && took < 1500, "noticed after activePing + activePongTimeout: " + took + " ms");
});

test("a running turn counts as active; its turn_end makes the connection idle again", async (t) => {
  const { server, client } = await setup(t, { idlePing: 60_000, activePing: 100, activePongTimeout: 5000 });
  client.connect();
  const conn = await server.accept(client, 1);
  client.subscribe("c1");
  conn.subscribed(await conn.next("subscribe"), {
    snapshot: { title: null, status: "running", turn_id: "t1", started_at: 1, goal_state: null },
  });
  await conn.next("ping", 2000);
  assert.equal(client._expecting(), true, "a running turn: activePing");
  conn.push({ type: "turn_end", chat_id: "c1", seq: 1, ts: 1, data: { turn_id: "t1", reason: "complete" } });
  await roundTrip(client);
  assert.equal(client._expecting(), false, "idle again: the long idlePing applies");
});

test("after a 1012 failed attempts keep to restartMaxDelay; other drops grow to maxDelay", async (t) => {
  const { server, client } = await setup(t, {
    initialDelay: 10, maxDelay: 400, restartMaxDelay: 40, reconnectJitter: 10, random: () => 0.999,
  });
  const waits = [];
  client.on("state", (s) => { if (s.state === "reconnecting") waits.push(s.delay); });
  client.connect();
  (await server.accept(client, 1)).drop(1012, "server restarting");
  for (let n = 2; n <= 6; n++) (await server.connection(n)).drop(1006); // still restarting
  let conn = await server.accept(client, 7);
  assert.deepEqual(waits, [9, 19, 39, 39, 39, 39], "capped at 40 ms while the gateway restarts");
  waits.length = 0;
  conn.drop(1006); // a plain drop: the full backoff
  for (let n = 8; n <= 12; n++) (await server.connection(n)).drop(1006);
  await server.connection(13);
  assert.deepEqual(waits, [9, 19, 39, 79, 159, 319]);
});
