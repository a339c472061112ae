// Client tools: the agent asks a person, any device answers. awaiting() from the snapshot and
// live, answer()'s frame, its ack and its refusals, and an answer never written twice.

import assert from "node:assert/strict";
import { test } from "node:test";

import { GatewayError } from "../../gateway/static/gateway-client.js";
import { answerSubscribe, roundTrip, setup } from "./fake-server.mjs";

function snapshot(fields = {}) {
  return { title: null, status: "idle", turn_id: null, started_at: null, goal_state: null, ...fields };
}

function event(seq, type, data, node) {
  const frame = { type, chat_id: "c1", seq, ts: 1, data };
  if (node) frame.node = node;
  return frame;
}

/** A request frame without its id. */
function strip(frame) {
  const { id: _id, ...rest } = frame;
  return rest;
}

/** `promise`, or a failure naming `what` after `ms`. */
function within(promise, ms, what) {
  let timer;
  const timeout = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error("timed out waiting for " + what)), ms);
  });
  return Promise.race([promise, timeout]).finally(() => clearTimeout(timer));
}

test("awaiting(): from the snapshot, then live; the replay's older news changes nothing", async (t) => {
  const { server, client } = await setup(t);
  client.subscribe("c1");
  assert.equal(client.awaiting("c1"), null, "not known before a snapshot");
  client.connect();
  let conn = await server.accept(client, 1);
  await answerSubscribe(client, conn, { seq: 3, snapshot: snapshot({ head: "t1", awaiting: { call_a: "approve" } }) });
  assert.deepEqual(client.awaiting("c1"), { call_a: "approve" }, "a device that comes later sees the question");
  const copy = client.awaiting("c1");
  copy.call_x = "mine";
  assert.deepEqual(client.awaiting("c1"), { call_a: "approve" }, "a copy: the app cannot change it");

  // Another device answers: its node, the new turn, the head moves; nothing waits any more.
  conn.push(
    event(4, "tool_result", { call_id: "call_a", result: { approved: true }, by: "u1", msg_id: "a1", parent_id: "t1" }, "a1"),
    event(5, "turn_start", { turn_id: "t2", started_at: 1, parent_id: "a1" }, "t2"),
    event(6, "head", { head_id: "t2", prev_head_id: "t1", cause: "answer", by: "u1" }),
  );
  await roundTrip(client);
  assert.deepEqual(client.awaiting("c1"), {});
  assert.deepEqual(client.activePath("c1").slice(-2), ["a1", "t2"]);
  // The new turn asks again: live.
  conn.push(event(7, "tool_call", { call_id: "call_b", name: "pick", args: {}, awaiting: true }, "t2"),
    event(8, "tool_call", { call_id: "call_c", name: "search", args: {} }, "t2"), // a server-side tool
    event(9, "turn_end", { turn_id: "t2", reason: "awaiting_input" }, "t2"));
  await roundTrip(client);
  assert.deepEqual(client.awaiting("c1"), { call_b: "pick" });

  // Offline, the question was answered and asked again; the resume's snapshot tells the end
  // state and the replay (older) does not undo it.
  conn.drop(1006);
  conn = await server.accept(client, 2);
  const resub = await conn.next("subscribe");
  assert.deepEqual(resub.since, { seq: 9, epoch: "e1" });
  conn.subscribed(resub, { seq: 13, replayed: 4, snapshot: snapshot({ head: "t3", awaiting: { call_d: "pick" } }) });
  conn.push(
    event(10, "tool_result", { call_id: "call_b", result: "red", by: "u1", msg_id: "a2", parent_id: "t2" }, "a2"),
    event(11, "turn_start", { turn_id: "t3", started_at: 1, parent_id: "a2" }, "t3"),
    event(12, "head", { head_id: "t3", prev_head_id: "t2", cause: "answer", by: "u1" }),
    event(13, "tool_call", { call_id: "call_d", name: "pick", args: {}, awaiting: true }, "t3"),
  );
  await roundTrip(client);
  assert.deepEqual(client.awaiting("c1"), { call_d: "pick" });
  // A new message instead of an answer: the question stands unanswered.
  conn.push(event(14, "user_message", { text: "never mind", client_msg_id: "x", user_id: "u1", msg_id: "m2", parent_id: "t3" }, "m2"),
    event(15, "turn_start", { turn_id: "t4", started_at: 1, parent_id: "m2" }, "t4"),
    event(16, "head", { head_id: "t4", prev_head_id: "t3", cause: "message", by: "u1" }));
  await roundTrip(client);
  assert.deepEqual(client.awaiting("c1"), {});
  // A snapshot without `awaiting`: none waits.
  conn.push({ type: "subscribed", chat_id: "c1", epoch: "e1", seq: 16, recovered: true, replayed: 0, snapshot: snapshot() });
  await roundTrip(client);
  assert.deepEqual(client.awaiting("c1"), {});
});

test("answer(): the tool_result frame, its ack, conflict and invalid_request", async (t) => {
  const { server, client } = await setup(t);
  const heads = [];
  client.on("head", (h) => heads.push(h.head));
  client.subscribe("c1");
  client.connect();
  const conn = await server.accept(client, 1);
  await answerSubscribe(client, conn, { seq: 3, snapshot: snapshot({ head: "t1", awaiting: { call_a: "approve" } }) });

  // Refused: the answer does not fit the schema. Nothing changes.
  const bad = client.answer("c1", "call_a", { amount: 500 });
  const badReq = await conn.next("tool_result");
  assert.deepEqual(strip(badReq), { type: "tool_result", chat_id: "c1", call_id: "call_a", result: { amount: 500 } });
  assert.equal(typeof badReq.id, "number", "a request id, for its ack");
  conn.push({ type: "error", code: "invalid_request", id: badReq.id, chat_id: "c1",
    message: "tool_result: the answer to approve at ['amount'] do not fit its schema: 500 is greater than the maximum of 100" });
  await assert.rejects(bad, (err) => err instanceof GatewayError && err.code === "invalid_request"
    && /maximum of 100/.test(err.message));
  assert.deepEqual(client.awaiting("c1"), { call_a: "approve" });

  // Answered: the ack has the new turn, the head, the answer's node.
  const ok = client.answer("c1", "call_a", { approved: true });
  const req = await conn.next("tool_result");
  assert.deepEqual(strip(req), { type: "tool_result", chat_id: "c1", call_id: "call_a", result: { approved: true } });
  conn.push(
    event(4, "tool_result", { call_id: "call_a", result: { approved: true }, by: "u1", msg_id: "a1", parent_id: "t1" }, "a1"),
    event(5, "turn_start", { turn_id: "t2", started_at: 1, parent_id: "a1" }, "t2"),
    event(6, "head", { head_id: "t2", prev_head_id: "t1", cause: "answer", by: "u1" }),
    { type: "ack", chat_id: "c1", id: req.id, seq: 4, client_msg_id: null, turn_id: "t2", duplicate: false, head: "t2", msg_id: "a1" },
  );
  const ack = await ok;
  assert.deepEqual([ack.turn_id, ack.head, ack.msg_id], ["t2", "t2", "a1"]);
  assert.deepEqual(heads, ["t1", "t2"]);
  assert.deepEqual(client.awaiting("c1"), {});

  // Another device was first: conflict, and the winning answer comes as an event.
  const late = client.answer("c1", "call_a", { approved: false });
  const lateReq = await conn.next("tool_result");
  conn.push({ type: "error", code: "conflict", id: lateReq.id, chat_id: "c1", message: "tool call call_a is not awaiting an answer" });
  await assert.rejects(late, (err) => err instanceof GatewayError && err.code === "conflict");
  assert.equal(client.outboxSize, 0);

  // A chat this connection does not get live: the ack's head ends what waited.
  const other = client.answer("c2", "call_z", "yes");
  const otherReq = await conn.next("tool_result");
  conn.push({ type: "ack", chat_id: "c2", id: otherReq.id, seq: 8, client_msg_id: null, turn_id: "t9", duplicate: false, head: "t9", msg_id: "a9" });
  assert.equal((await other).turn_id, "t9");
  assert.equal(client.head("c2"), "t9");
});

test("an answer written before a drop is not sent again; one made while offline is", async (t) => {
  const { server, client } = await setup(t);
  client.connect();
  let conn = await server.accept(client, 1);
  const written = client.answer("c1", "call_a", { approved: true });
  await conn.next("tool_result");
  conn.drop(1006);
  await assert.rejects(within(written, 2000, "the written answer to fail"),
    (err) => err instanceof GatewayError && err.code === "disconnected" && /answer/.test(err.message));
  const queued = client.answer("c1", "call_b", "red");
  conn = await server.accept(client, 2);
  const req = await conn.next("tool_result");
  assert.equal(req.call_id, "call_b");
  await roundTrip(client);
  assert.equal(conn.of("tool_result").length, 1, "the first answer is not repeated");
  conn.push({ type: "ack", chat_id: "c1", id: req.id, seq: 4, client_msg_id: null, turn_id: "t2", duplicate: false, head: "t2", msg_id: "a1" });
  assert.equal((await queued).msg_id, "a1");
  assert.equal(client.outboxSize, 0);
});
