// Resuming after a reconnect: `since`, de-duplication by seq, gaps, `recovered: false`.

import assert from "node:assert/strict";
import { test } from "node:test";

import { JSON_SUBPROTOCOL } from "../../gateway/static/gateway-client.js";
import { answerSubscribe, ev, roundTrip, setup } from "./fake-server.mjs";

test("a reconnect resumes with since and every event arrives once", async (t) => {
  const { server, client } = await setup(t);
  const seen = [];
  client.on("event", (f) => seen.push(f.seq));
  const states = [];
  client.on("state", (s) => states.push(s.state + (s.code ? ":" + s.code : "")));
  const first = client.subscribe("c1");
  client.connect();
  let conn = await server.connection(1);
  assert.equal(conn.path, "/v1/ws?token=tok", "token in the URL");
  assert.equal(conn.protocol, JSON_SUBPROTOCOL, "asks for the JSON subprotocol");
  conn = await server.accept(client, 1);
  const sub = await conn.next("subscribe");
  assert.equal(sub.chat_id, "c1");
  assert.equal(sub.since, undefined, "fresh subscribe");
  conn.subscribed(sub, { seq: 5 });
  assert.equal((await first).seq, 5, "subscribe resolves with the frame");
  conn.push(ev("c1", 6), ev("c1", 7), ev("c1", null, "delta"));
  await roundTrip(client);

  states.length = 0;
  conn.drop(1012, "server restarting");
  conn = await server.accept(client, 2);
  assert.deepEqual(states.slice(0, 3), ["reconnecting:1012", "connecting", "open"],
    "reconnecting after 1012, then a new connection");
  const again = await conn.next("subscribe");
  assert.deepEqual(again.since, { seq: 7, epoch: "e1" }, "resumed with since 7");
  conn.subscribed(again, { seq: 8, replayed: 2 });
  conn.push(ev("c1", 7), ev("c1", 8), ev("c1", 9));
  await roundTrip(client);
  assert.deepEqual(seen, [6, 7, null, 8, 9], "each event once");
  assert.equal(client.duplicatesDropped, 1, "one duplicate dropped");
  assert.deepEqual(client.position("c1"), { seq: 9, epoch: "e1" });
});

test("recovered: false is surfaced as a recovery event, live from the new position", async (t) => {
  const { server, client } = await setup(t);
  const recoveries = [];
  client.on("recovery", (r) => recoveries.push(r));
  const modes = [];
  client.on("subscribed", (s) => modes.push(s.mode));
  client.subscribe("c1", { since: { seq: 3, epoch: "old" } });
  client.connect();
  const conn = await server.accept(client, 1);
  const sub = await conn.next("subscribe");
  assert.deepEqual(sub.since, { seq: 3, epoch: "old" }, "the app's since is used");
  conn.subscribed(sub, { epoch: "new", seq: 12, recovered: false });
  await roundTrip(client);
  assert.equal(recoveries.length, 1, "one recovery event");
  assert.equal(recoveries[0].chatId, "c1");
  assert.equal(recoveries[0].seq, 12);
  assert.equal(recoveries[0].epoch, "new");
  assert.equal(recoveries[0].recovered, false);
  assert.deepEqual(modes, ["since"]);
  assert.deepEqual(client.position("c1"), { seq: 12, epoch: "new" }, "new position");
  const seen = [];
  client.on("event", (f) => seen.push(f.seq));
  conn.push(ev("c1", 13));
  await roundTrip(client);
  assert.deepEqual(seen, [13], "live after the reset");
});

test("an unasked subscribed with recovered: false (history lost) resets the position", async (t) => {
  const { server, client } = await setup(t);
  const recoveries = [];
  client.on("recovery", (r) => recoveries.push(r));
  const seen = [];
  client.on("event", (f) => seen.push(f.seq));
  client.subscribe("c1");
  client.connect();
  const conn = await server.accept(client, 1);
  await answerSubscribe(client, conn, { seq: 10 });
  conn.push(ev("c1", 11));
  // Redis lost the history: the gateway says so with no request id, under a new epoch.
  conn.push({
    type: "subscribed", chat_id: "c1", epoch: "e2", seq: 2, recovered: false, replayed: 0,
    snapshot: { title: null, status: "idle", turn_id: null, started_at: null, goal_state: null },
  });
  conn.push(ev("c1", 3));
  await roundTrip(client);
  assert.deepEqual(recoveries.map((r) => [r.chatId, r.epoch, r.seq]), [["c1", "e2", 2]]);
  assert.deepEqual(seen, [11, 3], "seq 3 of the new epoch is not taken for a duplicate");
  assert.deepEqual(client.position("c1"), { seq: 3, epoch: "e2" });
  assert.equal(conn.of("subscribe").length, 1, "nothing to resubscribe");
});

test("a gap in durable seqs is repaired by resubscribing with since", async (t) => {
  const { server, client } = await setup(t);
  const seen = [];
  const gaps = [];
  client.on("event", (f) => seen.push(f.seq));
  client.on("gap", (g) => gaps.push(g));
  client.subscribe("c1");
  client.connect();
  const conn = await server.accept(client, 1);
  await answerSubscribe(client, conn, { seq: 1 });
  conn.push(ev("c1", 2), ev("c1", 4));
  const resync = await conn.next("subscribe");
  assert.equal(gaps.length, 1, "gap reported");
  assert.deepEqual(gaps[0], { chatId: "c1", expected: 3, got: 4 });
  assert.deepEqual(resync.since, { seq: 2, epoch: "e1" }, "resubscribed from 2");
  conn.push(ev("c1", 5)); // still before the reply: covered by the replay
  conn.subscribed(resync, { seq: 5, replayed: 3 });
  conn.push(ev("c1", 3), ev("c1", 4), ev("c1", 5), ev("c1", 6));
  await roundTrip(client);
  assert.deepEqual(seen, [2, 3, 4, 5, 6], "in order, no hole");
  assert.equal(gaps.length, 1);
});

test("a deleted conversation ends its subscription", async (t) => {
  const { server, client } = await setup(t);
  const seen = [];
  client.on("event", (f) => seen.push(f.type));
  client.subscribe("c1");
  client.connect();
  const conn = await server.accept(client, 1);
  await answerSubscribe(client, conn, { seq: 4 });
  conn.push({ type: "deleted", chat_id: "c1", seq: null, ts: 1, data: { epoch: "e1", last_seq: 4 } });
  conn.push(ev("c1", 5)); // a new conversation of that id: not subscribed any more
  await roundTrip(client);
  assert.deepEqual(seen, ["deleted"]);
  assert.deepEqual(client.subscriptions, []);
  assert.equal(client.position("c1"), null, "resume point forgotten");
});

test("subscribe with create: false sends it, and a missing chat rejects with not_found", async (t) => {
  const { server, client } = await setup(t);
  const errors = [];
  client.on("error", (f) => errors.push(f.code + ":" + f.chat_id));
  client.connect();
  const conn = await server.accept(client, 1);
  const missing = client.subscribe("nope", { create: false });
  const req = await conn.next("subscribe");
  assert.deepEqual(req, { type: "subscribe", chat_id: "nope", id: req.id, create: false });
  conn.push({ type: "error", code: "not_found", message: "conversation 'nope' does not exist", id: req.id, chat_id: "nope" });
  await assert.rejects(missing, (e) => e.code === "not_found");
  assert.deepEqual(errors, ["not_found:nope"]);
  assert.deepEqual(client.subscriptions, [], "forgotten");
  // The default creates (no field), and create: false sticks for the chat's resubscribes.
  client.subscribe("new");
  assert.equal("create" in (await conn.next("subscribe")), false);
  client.subscribe("old", { create: false });
  conn.subscribed(await conn.next("subscribe"));
  conn.drop(1006);
  const again = await server.accept(client, 2);
  const resubs = [await again.next("subscribe"), await again.next("subscribe")];
  assert.deepEqual(resubs.map((f) => [f.chat_id, f.create]), [["new", undefined], ["old", false]]);
});
