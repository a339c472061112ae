// In-band token refresh (protocol.md, "`refresh`: a fresh token, in band"): on
// `token_expiring` the client asks its token callback and sends `refresh`; the connection
// goes on as it is. A refused refresh leaves the 4011 at expiry to reconnect as before.

import assert from "node:assert/strict";
import { test } from "node:test";

import { answerSubscribe, ev, roundTrip, setup, until } from "./fake-server.mjs";

/** Record a client event; `next()` returns the first one no earlier next() returned. */
function heard(client, type) {
  const seen = [];
  let taken = 0;
  client.on(type, (e) => seen.push(e));
  return {
    seen,
    async next() {
      const n = ++taken;
      await until(() => seen.length >= n, type + " #" + n);
      return seen[n - 1];
    },
  };
}

test("a token about to expire is refreshed in band: no reconnect, no replay", async (t) => {
  let n = 0;
  const asked = [];
  const { server, client } = await setup(t, {
    token: async (req) => { asked.push(req.reason); return "t" + ++n; },
    useTicket: true,
  });
  const states = [];
  client.on("state", (s) => states.push(s.state));
  const refreshed = heard(client, "token_refreshed");
  const failed = heard(client, "token_refresh_failed");
  const events = [];
  client.on("event", (f) => events.push(f.seq));
  client.connect();
  const conn = await server.accept(client, 1);
  assert.equal(conn.ticket, "tk1");
  const sub = client.subscribe("trip");
  await answerSubscribe(client, conn);
  await sub;
  conn.push(ev("trip", 1));

  const soon = Date.now() + 30000;
  conn.tokenExpiring(soon);
  const later = Date.now() + 3600000;
  const req = await conn.answerRefresh({ expiresAt: later });
  assert.equal(req.token, "t2", "a fresh token from the callback");
  assert.ok(req.id != null, "a request id");
  const done = await refreshed.next();
  assert.equal(done.expiresAt, later);
  assert.deepEqual(done.frame, { type: "refreshed", expires_at: later, id: req.id });
  assert.deepEqual(asked, ["connect", "refresh"]);

  // The same socket goes on: events keep coming, nothing was resubscribed or replayed.
  conn.push(ev("trip", 2));
  await roundTrip(client);
  assert.deepEqual(events, [1, 2]);
  assert.equal(server.connections.length, 1, "no reconnect");
  assert.equal(conn.of("subscribe").length, 1, "no resubscribe");
  assert.equal(server.requests.length, 1, "no new ticket: the socket stays");
  assert.deepEqual(states, ["connecting", "open"]);
  assert.equal(failed.seen.length, 0);

  // The new token expires in turn: refreshed again, with the next one.
  conn.tokenExpiring(later);
  const again = await conn.answerRefresh({ expiresAt: later + 3600000 });
  assert.equal(again.token, "t3");
  assert.equal((await refreshed.next()).expiresAt, later + 3600000);
  assert.equal(server.connections.length, 1);
});

test("a refused refresh is told; the 4011 at expiry reconnects with a fresh token", async (t) => {
  let n = 0;
  const asked = [];
  const { server, client } = await setup(t, {
    token: async (req) => { asked.push(req.reason); return "t" + ++n; },
  });
  const refreshed = heard(client, "token_refreshed");
  const failed = heard(client, "token_refresh_failed");
  const errors = heard(client, "error");
  client.connect();
  const conn = await server.accept(client, 1);
  const sub = client.subscribe("trip");
  await answerSubscribe(client, conn, { seq: 4 });
  await sub;

  const expiresAt = Date.now() + 1000;
  conn.tokenExpiring(expiresAt);
  const req = await conn.answerRefresh({ refuse: "unauthorized" });
  assert.equal(req.token, "t2");
  const failure = await failed.next();
  assert.equal(failure.expiresAt, expiresAt);
  assert.equal(failure.error.code, "unauthorized");
  assert.equal(failure.error.frame.id, req.id);
  assert.equal((await errors.next()).code, "unauthorized", "the refusal is an error event too");
  // Nothing else happens until the gateway closes at expiry; the same expiry is not retried.
  conn.tokenExpiring(expiresAt);
  await roundTrip(client);
  assert.equal(conn.of("refresh").length, 1, "tried once per expiry");
  assert.equal(client.state, "open");
  assert.equal(server.connections.length, 1);

  conn.drop(4011, "token expired");
  const next = await server.accept(client, 2);
  assert.equal(next.token, "t3", "a fresh token for the new connection");
  assert.deepEqual(asked, ["connect", "refresh", "expired"]);
  const resub = await next.next("subscribe");
  assert.deepEqual(resub.since, { seq: 4, epoch: "e1" }, "resumes where it was");
  assert.equal(refreshed.seen.length, 0);
});

test("no fresh token (the same one, or a failing callback): nothing is sent", async (t) => {
  // A page with one token (a string): refreshing with it again would change nothing.
  const { server, client } = await setup(t, { token: "tok" });
  const failed = heard(client, "token_refresh_failed");
  client.connect();
  const conn = await server.accept(client, 1);
  conn.tokenExpiring(Date.now() + 5000);
  assert.equal((await failed.next()).error.code, "token_unchanged");
  await roundTrip(client);
  assert.equal(conn.of("refresh").length, 0, "no refresh sent");

  // setToken() gives a fresh one: the next expiry sends it.
  client.setToken("tok2");
  conn.tokenExpiring(Date.now() + 4000);
  assert.equal((await conn.answerRefresh()).token, "tok2");

  let calls = 0;
  client.setToken(async () => { calls++; throw new Error("signed out"); });
  conn.tokenExpiring(Date.now() + 3000);
  const failure = await failed.next();
  assert.equal(failure.error.code, "token_callback");
  assert.match(failure.error.message, /signed out/);
  assert.equal(calls, 1);
  assert.equal(client.state, "open", "the connection goes on until its token expires");
  assert.equal(server.connections.length, 1);
});
