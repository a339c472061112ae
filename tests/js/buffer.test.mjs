// unsubscribe/subscribe on one connection (the gateway's buffer), and leave.

import assert from "node:assert/strict";
import { test } from "node:test";

import { GatewayError } from "../../gateway/static/gateway-client.js";
import { answerSubscribe, ev, roundTrip, setup } from "./fake-server.mjs";

test("unsubscribe then subscribe drains the buffer; after a reconnect, since", async (t) => {
  const { server, client } = await setup(t);
  const seen = [];
  const modes = [];
  client.on("event", (f) => seen.push(f.type + (f.seq ?? "")));
  client.on("subscribed", (s) => modes.push(s.mode));
  client.subscribe("c1");
  client.connect();
  const conn = await server.accept(client, 1);
  await answerSubscribe(client, conn, { seq: 4 });
  const off = client.unsubscribe("c1");
  const unsub = await conn.next("unsubscribe");
  assert.equal(unsub.chat_id, "c1", "unsubscribe sent");
  conn.push(ev("c1", 5)); // sent before the gateway read our unsubscribe: still counts
  conn.push({ type: "unsubscribed", chat_id: "c1", id: unsub.id });
  assert.equal((await off).type, "unsubscribed", "unsubscribe resolves with the reply");
  assert.deepEqual(client.subscriptions, []);
  client.subscribe("c1");
  const back = await conn.next("subscribe");
  assert.equal(back.since, undefined, "no since: the gateway drains its buffer");
  conn.subscribed(back, { seq: 7, buffered: 3, overflowed: false });
  conn.push(ev("c1", 6), ev("c1", null, "delta"), ev("c1", 7));
  await roundTrip(client);
  assert.deepEqual(seen, ["note5", "note6", "delta", "note7"]);
  assert.deepEqual(modes, ["fresh", "buffer"]);

  // After a reconnect the buffer is gone: the next subscribe resumes with since.
  client.unsubscribe("c1");
  await conn.next("unsubscribe");
  conn.drop(1006);
  const conn2 = await server.accept(client, 2);
  await roundTrip(client);
  assert.equal(conn2.of("subscribe").length, 0, "an unsubscribed chat is not resubscribed");
  client.subscribe("c1");
  const resumed = await conn2.next("subscribe");
  assert.deepEqual(resumed.since, { seq: 7, epoch: "e1" }, "since after a reconnect");
});

test("switching away and back before the first reply still delivers the buffered events", async (t) => {
  // subscribe, unsubscribe and subscribe again within one round trip (a user clicking
  // through chats): the first reply is superseded, but it is the position the buffered
  // frames continue from.
  const { server, client } = await setup(t);
  const seen = [];
  const modes = [];
  client.on("event", (f) => seen.push(f.seq));
  client.on("subscribed", (s) => modes.push(s.mode));
  client.connect();
  const conn = await server.accept(client, 1);
  const first = client.subscribe("c1");
  client.unsubscribe("c1");
  const back = client.subscribe("c1");
  const [req1, req2] = [await conn.next("subscribe"), await conn.next("subscribe")];
  const unsub = await conn.next("unsubscribe");
  assert.equal(req2.since, undefined, "drains the buffer");
  // What the gateway answers: live from seq 4; events 5 and 6 stored while unsubscribed
  // are buffered; the second subscribe drains them.
  conn.subscribed(req1, { seq: 4 });
  conn.push({ type: "unsubscribed", chat_id: "c1", id: unsub.id });
  conn.subscribed(req2, { seq: 6, buffered: 2, overflowed: false });
  conn.push(ev("c1", 5), ev("c1", 6), ev("c1", 7));
  await roundTrip(client);
  assert.equal((await back).id, req2.id);
  assert.equal(await first, null, "the first waiter was let go by the unsubscribe");
  assert.deepEqual(seen, [5, 6, 7], "the buffered events too");
  assert.equal(client.duplicatesDropped, 0);
  assert.deepEqual(modes, ["buffer"]);
});

test("leave then subscribe before the first reply starts fresh from the new reply", async (t) => {
  const { server, client } = await setup(t);
  const seen = [];
  client.on("event", (f) => seen.push(f.seq));
  client.connect();
  const conn = await server.accept(client, 1);
  client.subscribe("c1");
  client.leave("c1");
  client.subscribe("c1");
  const [req1, req2] = [await conn.next("subscribe"), await conn.next("subscribe")];
  const leave = await conn.next("leave");
  conn.subscribed(req1, { seq: 4 });
  conn.push({ type: "left", chat_id: "c1", id: leave.id });
  conn.subscribed(req2, { seq: 6 }); // nothing buffered after a leave: live from 6
  conn.push(ev("c1", 7));
  await roundTrip(client);
  assert.deepEqual(seen, [7]);
  assert.equal(conn.of("subscribe").length, 2, "no gap to repair");
});

test("an overflowed buffer: the gateway replays durable events instead", async (t) => {
  const { server, client } = await setup(t);
  const seen = [];
  client.on("event", (f) => seen.push(f.seq));
  client.subscribe("c1");
  client.connect();
  const conn = await server.accept(client, 1);
  await answerSubscribe(client, conn, { seq: 4 });
  client.unsubscribe("c1");
  client.subscribe("c1");
  const back = await conn.next("subscribe");
  assert.equal(back.since, undefined, "no since: the gateway decides between buffer and replay");
  conn.subscribed(back, { seq: 6, overflowed: true, replayed: 2 });
  conn.push(ev("c1", 5), ev("c1", 6), ev("c1", null, "delta"), ev("c1", 7));
  await roundTrip(client);
  assert.deepEqual(seen, [5, 6, null, 7]);
});

test("subscribe while one is in flight waits for it; on a live chat it subscribes again", async (t) => {
  const { server, client } = await setup(t);
  const modes = [];
  client.on("subscribed", (s) => modes.push(s.mode));
  client.subscribe("c1");
  client.connect();
  const conn = await server.accept(client, 1);
  const first = client.subscribe("c1"); // the first one is in flight
  await roundTrip(client);
  assert.equal(conn.of("subscribe").length, 1, "nothing sent while one is in flight");
  const req = await answerSubscribe(client, conn, { seq: 4 });
  assert.equal((await first).id, req.id, "answered by the same reply");

  const again = client.subscribe("c1");
  const repeat = await conn.next("subscribe");
  assert.equal(repeat.since, undefined, "live already: subscribe again, no since");
  conn.subscribed(repeat, { seq: 4 });
  assert.equal((await again).id, repeat.id);

  conn.push(ev("c1", 5));
  const explicit = client.subscribe("c1", { since: { seq: 2, epoch: "e1" } });
  const withSince = await conn.next("subscribe");
  assert.deepEqual(withSince.since, { seq: 2, epoch: "e1" }, "an explicit since is always sent");
  conn.subscribed(withSince, { seq: 5, replayed: 3 });
  assert.equal((await explicit).id, withSince.id);
  assert.deepEqual(modes, ["fresh", "again", "since"]);
});

test("leave forgets the chat and its resume point", async (t) => {
  const { server, client } = await setup(t);
  const seen = [];
  client.on("event", (f) => seen.push(f.seq));
  client.subscribe("c1");
  client.connect();
  const conn = await server.accept(client, 1);
  await answerSubscribe(client, conn, { seq: 4 });
  const left = client.leave("c1");
  const req = await conn.next("leave");
  assert.equal(req.chat_id, "c1");
  conn.push(ev("c1", 5), { type: "left", chat_id: "c1", id: req.id });
  assert.equal((await left).type, "left");
  assert.deepEqual(seen, [], "nothing of a chat left");
  assert.equal(client.position("c1"), null);
  assert.deepEqual(client.subscriptions, []);
  client.subscribe("c1");
  const fresh = await conn.next("subscribe");
  assert.equal(fresh.since, undefined, "a new subscribe starts fresh");
  assert.equal(await client.leave("unknown"), null, "leaving an unknown chat is a no-op");
});

test("a refused subscribe rejects with the gateway's code and forgets the chat", async (t) => {
  const { server, client } = await setup(t);
  client.connect();
  const conn = await server.accept(client, 1);
  const refused = client.subscribe("theirs");
  const req = await conn.next("subscribe");
  conn.push({ type: "error", code: "forbidden", message: "you may not read this conversation",
    id: req.id, chat_id: "theirs" });
  await assert.rejects(refused, (err) => err instanceof GatewayError && err.code === "forbidden"
    && err.frame?.chat_id === "theirs");
  assert.deepEqual(client.subscriptions, []);
  conn.drop(1006);
  const conn2 = await server.accept(client, 2);
  await roundTrip(client);
  assert.equal(conn2.of("subscribe").length, 0, "not retried after a reconnect");
});
