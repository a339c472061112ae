// The client's HTTP side: connection tickets (no token in any socket URL), request() and
// listConversations() with timeouts and retries, and `feed_gap` after a reconnect.

import assert from "node:assert/strict";
import { test } from "node:test";

import { GatewayError } from "../../gateway/static/gateway-client.js";
import { roundTrip, setup, until } from "./fake-server.mjs";

test("each socket opens with a fresh ticket; the token is in no URL", async (t) => {
  let n = 0;
  const { server, client } = await setup(t, { useTicket: true, token: () => "secret-" + ++n });
  client.connect();
  let conn = await server.accept(client, 1);
  assert.equal(conn.path, "/v1/ws?ticket=tk1");
  assert.equal(conn.token, null);
  assert.deepEqual(server.requests[0], { method: "POST", url: "/v1/ws-ticket", authorization: "Bearer secret-1" });
  conn.drop(1012, "server restarting");
  conn = await server.accept(client, 2);
  assert.equal(conn.path, "/v1/ws?ticket=tk2", "a new ticket for every socket");
  assert.deepEqual(server.tickets.map((x) => x.token), ["secret-1", "secret-2"]);
  assert.ok(server.connections.every((c) => !c.path.includes("secret")));
});

test("tickets are the default where fetch exists; useTicket: false keeps ?token=", async (t) => {
  const { server, client } = await setup(t, { useTicket: undefined });
  client.connect();
  assert.equal((await server.accept(client, 1)).ticket, "tk1");
  const { server: other, client: plain } = await setup(t, { useTicket: false });
  plain.connect();
  const conn = await other.accept(plain, 1);
  assert.equal(conn.path, "/v1/ws?token=tok");
  assert.equal(other.requests.length, 0);
  assert.equal(client.httpUrl, `http://127.0.0.1:${server.port}`);
});

test("a token the ticket endpoint refuses stops the client as 4001 would", async (t) => {
  const { server, client } = await setup(t, { useTicket: true });
  server.onHttp = () => ({ status: 401, body: { error: { code: "unauthorized", message: "token expired" } } });
  const closed = [];
  const states = [];
  client.on("closed", (c) => closed.push(c));
  client.on("state", (s) => states.push(s.state));
  client.connect();
  await until(() => client.state === "closed", "closed");
  assert.deepEqual(closed, [{ code: 4001, reason: "token expired", terminal: true }]);
  // Every retry is scheduled through "reconnecting": none was.
  assert.deepEqual(states, ["connecting", "closed"], "no retry");
  assert.equal(server.requests.length, 1, "no retry");
  assert.equal(server.connections.length, 0, "no socket");
});

test("a ticket endpoint that fails or hangs is retried with backoff, within httpTimeout", async (t) => {
  const { server, client } = await setup(t, { useTicket: true, httpTimeout: 100 });
  const replies = [
    null, // never answers: the timeout ends it
    { status: 503, body: { error: { code: "backend_unavailable", message: "redis: down" } } },
  ];
  server.onHttp = (req) => (replies.length ? replies.shift() : server.defaultHttp(req));
  const waits = [];
  client.on("state", (s) => { if (s.state === "reconnecting") waits.push(s.reason); });
  const started = Date.now();
  client.connect();
  const conn = await server.accept(client, 1);
  assert.equal(conn.ticket, "tk1");
  assert.deepEqual(waits, [
    "no connection ticket: POST /v1/ws-ticket: no reply within 100 ms",
    "no connection ticket: redis: down",
  ]);
  assert.ok(Date.now() - started < 2000, "the hung request was given up on");
});

test("on a reconnect, a ticket request with no reply is sent again beside it at once", async (t) => {
  // The network died under the pooled keep-alive connection the request rides: it would
  // wait out httpTimeout. Another request (on another connection) gets the ticket; the
  // hung one is aborted, which makes a browser drop its connection.
  const { server, client } = await setup(t, { useTicket: true, httpTimeout: 10000, ticketRetryAfter: 50 });
  client.connect();
  const first = await server.accept(client, 1);
  let hang = 2;
  server.onHttp = (req) => (hang-- > 0 ? null : server.defaultHttp(req));
  const dropped = Date.now();
  first.drop(1006);
  const conn = await server.accept(client, 2);
  assert.ok(Date.now() - dropped < 2000, `reconnected ${Date.now() - dropped} ms after the drop`);
  assert.equal(conn.ticket, "tk2");
  const asked = server.requests.slice(1);
  assert.deepEqual(asked.map((r) => r.url), Array(3).fill("/v1/ws-ticket"));
  await until(() => asked.slice(0, 2).every((r) => r.abandoned), "the hung requests aborted");
  // A refusal is final: no request beside it.
  server.onHttp = () => ({ status: 503, body: { error: { code: "backend_unavailable", message: "down" } } });
  const waits = [];
  client.on("state", (s) => {
    if (s.state === "reconnecting") waits.push([s.reason, server.requests.length]);
  });
  const before = server.requests.length;
  conn.drop(1006);
  await until(() => waits.length >= 2, "a reconnect scheduled");
  // The drop, then the refusal after one request.
  assert.deepEqual(waits.slice(0, 2), [["", before], ["no connection ticket: down", before + 1]]);
});

test("request() times out, and says what the gateway refused", async (t) => {
  const { server, client } = await setup(t, { httpTimeout: 5000 });
  server.onHttp = (req) => (req.url === "/slow" ? null
    : req.url === "/v1/conversations/c1" ? { status: 200, body: { chat_id: "c1" } }
    : { status: 403, body: { error: { code: "forbidden", message: "not yours" } } });
  assert.deepEqual(await client.request("GET", "/v1/conversations/c1"), { chat_id: "c1" });
  assert.equal(server.requests[0].authorization, "Bearer tok");
  const started = Date.now();
  await assert.rejects(client.request("GET", "/slow", { timeout: 80 }),
    (e) => e instanceof GatewayError && e.code === "timeout" && e.status === null);
  assert.ok(Date.now() - started < 1000);
  await assert.rejects(client.request("PATCH", "/v1/conversations/c2", { body: { title: "x" } }),
    (e) => e instanceof GatewayError && e.code === "forbidden" && e.status === 403 && e.message === "not yours");
  const controller = new AbortController();
  const pending = client.request("GET", "/slow", { signal: controller.signal });
  controller.abort();
  await assert.rejects(pending, (e) => e.code === "aborted");
});

test("listConversations() retries until it gets the list; an error reply rejects", async (t) => {
  const { server, client } = await setup(t, { httpTimeout: 60 });
  const page = { conversations: [], next_cursor: null };
  const replies = [null, { status: 503, body: { error: { code: "backend_unavailable", message: "x" } } },
    { status: 200, body: page }];
  server.onHttp = () => replies.shift();
  assert.deepEqual(await client.listConversations({ limit: 20 }), page);
  assert.deepEqual(server.requests.map((r) => r.url), Array(3).fill("/v1/conversations?limit=20"));
  server.onHttp = () => ({ status: 401, body: { error: { code: "unauthorized", message: "token expired" } } });
  await assert.rejects(client.listConversations(), (e) => e.code === "unauthorized" && e.status === 401);
  assert.equal(server.requests.length, 4, "not retried");
});

test("feed_gap after a reconnect, once the feed is live; not on the first connect", async (t) => {
  const { server, client } = await setup(t);
  const gaps = [];
  client.on("feed_gap", (g) => gaps.push(g));
  client.connect();
  let conn = await server.accept(client, 1);
  await roundTrip(client);
  assert.deepEqual(gaps, []);
  conn.answerPings = true;
  conn.drop(1006);
  conn = await server.accept(client, 2);
  await until(() => gaps.length === 1, "feed_gap");
  assert.deepEqual(gaps, [{ connectionId: "conn-2" }]);
  // It waited for the answer to its ping: the feed is live by then (protocol.md).
  assert.equal(conn.of("ping").length >= 1, true);
});
