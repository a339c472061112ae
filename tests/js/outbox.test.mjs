// Messages and cancels: queued while disconnected, sent once in order, retried with the same
// client_msg_id, resent after rate_limited.

import assert from "node:assert/strict";
import { test } from "node:test";

import { GatewayError } from "../../gateway/static/gateway-client.js";
import { roundTrip, setup } from "./fake-server.mjs";

test("the outbox is sent once, in order, after the subscribes, with stable ids", async (t) => {
  const { server, client } = await setup(t);
  client.subscribe("c1");
  const a = client.sendMessage("c1", "first");
  const b = client.sendMessage("c2", "second");
  const c = client.cancel("c1", "t_1");
  assert.equal(client.outboxSize, 3, "queued while disconnected");
  client.connect();
  let conn = await server.accept(client, 1);
  await roundTrip(client);
  assert.deepEqual(conn.sequence(),
    ["subscribe:c1", "message:first", "message:second", "cancel:c1"],
    "subscribes first, then the outbox in order");
  assert.equal(conn.last("cancel").turn_id, "t_1");
  const ids = conn.of("message").map((f) => f.client_msg_id);
  assert.ok(ids[0] && ids[1] && ids[0] !== ids[1], "one client_msg_id per message");
  assert.match(ids[0], /^m-/);

  // The first message was stored but its ack was lost with the connection.
  conn.drop(1006);
  conn = await server.accept(client, 2);
  await roundTrip(client);
  assert.deepEqual(conn.sequence(),
    ["subscribe:c1", "message:first", "message:second", "cancel:c1"], "all again, in order");
  const retry = conn.of("message");
  assert.deepEqual(retry.map((f) => f.client_msg_id), ids, "the retry reuses the client_msg_ids");
  conn.push({ type: "ack", chat_id: "c1", id: retry[0].id, seq: 3, client_msg_id: ids[0],
    turn_id: "t_1", duplicate: true });
  conn.push({ type: "error", code: "turn_in_progress", message: "busy", id: retry[1].id,
    chat_id: "c2" });
  const cancel = conn.last("cancel");
  conn.push({ type: "error", code: "no_active_turn", message: "none", id: cancel.id,
    chat_id: "c1" });
  assert.equal((await a).duplicate, true, "ack of the retry");
  await assert.rejects(b, (err) => err instanceof GatewayError && err.code === "turn_in_progress",
    "rejected with the gateway's code");
  assert.equal(await c, null, "a retried cancel that finds no turn is done");
  assert.equal(client.outboxSize, 0, "outbox empty");

  conn.drop(1006);
  conn = await server.accept(client, 3);
  await roundTrip(client);
  assert.equal(conn.of("message").length, 0, "nothing sent twice once acked");
  assert.equal(conn.of("cancel").length, 0);
});

test("a first-attempt cancel refused with no_active_turn rejects", async (t) => {
  const { server, client } = await setup(t);
  client.connect();
  const conn = await server.accept(client, 1);
  const c = client.cancel("c1");
  const req = await conn.next("cancel");
  assert.equal(req.turn_id, undefined, "no turn_id when none was given");
  conn.push({ type: "error", code: "no_active_turn", message: "none", id: req.id, chat_id: "c1" });
  await assert.rejects(c, (err) => err instanceof GatewayError && err.code === "no_active_turn");
});

test("a message sent while connected goes out at once with its data", async (t) => {
  const { server, client } = await setup(t);
  const acks = [];
  client.on("ack", (f) => acks.push(f.client_msg_id));
  client.connect();
  const conn = await server.accept(client, 1);
  const p = client.sendMessage("c1", "hi", { clientMsgId: "m-mine", data: { lang: "pt" } });
  const req = await conn.next("message");
  assert.deepEqual({ ...req, id: 0 },
    { type: "message", chat_id: "c1", text: "hi", client_msg_id: "m-mine", data: { lang: "pt" }, id: 0 });
  assert.equal(client.outboxSize, 1, "in flight until acked");
  conn.push({ type: "ack", chat_id: "c1", id: req.id, seq: 1, client_msg_id: "m-mine",
    turn_id: "t", duplicate: false });
  assert.equal((await p).seq, 1);
  assert.deepEqual(acks, ["m-mine"], "ack event");
  assert.equal(client.outboxSize, 0);
});

test("frames the gateway dropped as rate_limited are resent with the same ids", async (t) => {
  const { server, client } = await setup(t);
  client.connect();
  const conn = await server.accept(client, 1);
  const p = client.sendMessage("c1", "hi", { clientMsgId: "m-fixed" });
  await conn.next("message");
  conn.push({ type: "error", code: "rate_limited", message: "slow down" });
  const two = await conn.next("message");
  const [one] = conn.of("message");
  assert.equal(one.client_msg_id, "m-fixed");
  assert.equal(two.client_msg_id, "m-fixed", "same id");
  conn.push({ type: "ack", chat_id: "c1", id: two.id, seq: 1, client_msg_id: "m-fixed",
    turn_id: "t", duplicate: false });
  assert.equal((await p).seq, 1, "acked");
});

test("an unanswered subscribe is resent after rate_limited, in its mode", async (t) => {
  const { server, client } = await setup(t);
  const modes = [];
  client.on("subscribed", (s) => modes.push(s.mode));
  client.subscribe("c1", { since: { seq: 3, epoch: "e1" } });
  client.subscribe("c2");
  client.connect();
  const conn = await server.accept(client, 1);
  await roundTrip(client);
  assert.deepEqual(conn.sequence(), ["subscribe:c1", "subscribe:c2"]);
  // Two errors in a row are one resend (one timer).
  conn.push({ type: "error", code: "rate_limited", message: "slow down" },
    { type: "error", code: "rate_limited", message: "slow down" });
  await conn.next("subscribe");
  await conn.next("subscribe");
  const [c1, c2] = [await conn.next("subscribe"), await conn.next("subscribe")];
  assert.deepEqual([c1.chat_id, c1.since], ["c1", { seq: 3, epoch: "e1" }], "c1 again with since");
  assert.deepEqual([c2.chat_id, c2.since], ["c2", undefined], "c2 again fresh");
  conn.subscribed(c1, { seq: 3 });
  conn.subscribed(c2, { seq: 0 });
  await roundTrip(client);
  assert.deepEqual(modes, ["since", "fresh"]);
  assert.equal(conn.of("subscribe").length, 4, "resent once");
});
