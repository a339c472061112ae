// Conversations as trees: the ConversationTree bookkeeping, `head` events live and across a
// resume, history pages with their forks, and the tree operations' frames, acks and refusals.

import assert from "node:assert/strict";
import { test } from "node:test";

import { ConversationTree, GatewayError } from "../../gateway/static/gateway-client.js";
import { answerSubscribe, roundTrip, setup } from "./fake-server.mjs";

/** Frames of one conversation as the gateway writes them: contiguous seqs from `start`. */
class Log {
  constructor(chatId = "c1", start = 1) {
    this.chatId = chatId;
    this.next = start;
    this.frames = [];
  }

  add(type, data, node) {
    const frame = { type, chat_id: this.chatId, seq: this.next++, ts: 1, data };
    if (node) frame.node = node;
    this.frames.push(frame);
    return frame;
  }

  head(head, prev, cause) {
    return this.add("head", { head_id: head, prev_head_id: prev, cause, by: "u1" });
  }

  message(msg, parent, turn, prev, editOf) {
    const data = { text: msg, client_msg_id: "x", user_id: "u1", msg_id: msg, parent_id: parent };
    if (editOf) data.edit_of = editOf;
    return [
      this.add("user_message", data, msg),
      this.add("turn_start", { turn_id: turn, started_at: 1, parent_id: msg }, turn),
      this.head(turn, prev, editOf ? "edit" : "message"),
    ];
  }

  answer(turn, text) {
    return [this.add("message", { text }, turn), this.add("turn_end", { turn_id: turn, reason: "complete" }, turn)];
  }

  retry(msg, old, turn) {
    return [
      this.add("turn_start", { turn_id: turn, started_at: 1, parent_id: msg, retry_of: old }, turn),
      this.head(turn, old, "retry"),
    ];
  }
}

/** m1 → t1 (retried as t2) → m2 → t3; m2 edited as m3 → t4, the head. */
function forkedLog() {
  const log = new Log();
  log.message("m1", null, "t1", null);
  log.answer("t1", "first answer");
  log.retry("m1", "t1", "t2");
  log.answer("t2", "second answer");
  log.message("m2", "t2", "t3", "t2");
  log.answer("t3", "an answer to m2");
  log.message("m3", "t2", "t4", "t3", "m2");
  return log;
}

test("a person's answer to a client tool is a node of their side, and the path goes on", () => {
  const log = new Log();
  log.message("m1", null, "t1", null);
  log.add("tool_call", { call_id: "c1", name: "approve", args: {}, awaiting: true }, "t1");
  log.add("turn_end", { turn_id: "t1", reason: "awaiting_input" }, "t1");
  log.add("tool_result", { call_id: "c1", result: { ok: true }, by: "u1", msg_id: "a1",
    parent_id: "t1" }, "a1");
  log.add("turn_start", { turn_id: "t2", started_at: 1, parent_id: "a1" }, "t2");
  log.head("t2", "t1", "answer");
  log.add("tool_result", { call_id: "x", result: 1 }, "t2"); // an agent's own: no node
  const tree = new ConversationTree();
  for (const frame of log.frames) tree.apply(frame);
  assert.deepEqual(tree.path(), ["m1", "t1", "a1", "t2"]);
  assert.equal(tree.head, "t2");
});

test("the tree: nodes from the events, the head, the path, siblings, visibility", () => {
  const log = forkedLog();
  const tree = new ConversationTree();
  const moves = log.frames.map((f) => tree.apply(f)).filter(Boolean);
  assert.deepEqual(moves.map((m) => [m.head, m.previous, m.cause]),
    [["t1", null, "message"], ["t2", "t1", "retry"], ["t3", "t2", "message"], ["t4", "t3", "edit"]]);
  assert.deepEqual(tree.path(), ["m1", "t2", "m3", "t4"]);
  assert.deepEqual(tree.siblings("t2"), { ids: ["t1", "t2"], index: 1 });
  assert.deepEqual(tree.siblings("m3"), { ids: ["m2", "m3"], index: 1 });
  assert.deepEqual(tree.siblings("m1"), { ids: ["m1"], index: 0 });
  assert.deepEqual(Object.keys(tree.forks()), ["t2", "m3"]);
  const byText = Object.fromEntries(log.frames.filter((f) => f.data.text).map((f) => [f.data.text, f]));
  assert.ok(tree.visible(byText["second answer"]));
  assert.ok(!tree.visible(byText["first answer"]), "a retried answer is off the path");
  assert.ok(!tree.visible(byText["an answer to m2"]), "an edited message's answer is off the path");
  assert.ok(tree.visible({ type: "title", seq: 99, data: {} }), "conversation-level events are on every path");
  assert.equal(tree.apply(log.frames[0]), null, "a frame applied twice changes nothing");
  assert.deepEqual(tree.missing(), []);
  // Older news never moves the head back: a snapshot told t4 as of the last seq.
  const resumed = new ConversationTree();
  resumed.setHead("t4", log.frames.length);
  assert.deepEqual(log.frames.map((f) => resumed.apply(f)).filter(Boolean), [], "no move replayed");
  assert.deepEqual(resumed.path(), ["m1", "t2", "m3", "t4"]);
  resumed.reset();
  assert.deepEqual([resumed.path(), resumed.headKnown, resumed.nodes.size], [[], false, 0]);
});

test("a history page with its forks: placeholders for siblings off the path", () => {
  const log = forkedLog();
  const onPath = new Set(["m1", "t2", "m3", "t4"]);
  const page = {
    chat_id: "c1", epoch: "e1", last_seq: log.frames.length, next_after: null, head: "t4",
    forks: { t2: { siblings: ["t1", "t2"], index: 1 }, m3: { siblings: ["m2", "m3"], index: 1 } },
    events: log.frames.filter((f) => !f.node || onPath.has(f.node)),
  };
  const tree = new ConversationTree();
  const move = tree.loadPage(page);
  assert.deepEqual([move.head, move.previous], ["t4", null]);
  assert.deepEqual(tree.siblings("t2"), { ids: ["t1", "t2"], index: 1 });
  assert.deepEqual(tree.siblings("m3"), { ids: ["m2", "m3"], index: 1 });
  assert.equal(tree.nodes.get("t1").seen, false, "known by id only");
  assert.equal(tree.nodes.get("m2").parentId, "t2");
  // A switch to the other branch: the head goes to a node never seen; reload to show it.
  tree.apply(log.head("t3", "t4", "switch"));
  assert.deepEqual(tree.missing(), ["t3"]);
  // A retry arriving live comes after the listed siblings.
  for (const f of log.retry("m1", "t2", "t9")) tree.apply(f);
  assert.deepEqual(tree.siblings("t9"), { ids: ["t1", "t2", "t9"], index: 2 });
  assert.equal(tree.loadPage(page), null, "the same page again: the older head is ignored");
  assert.equal(tree.head, "t9");
});

test("head events reach the app live, and a resume with since does not replay old moves", async (t) => {
  const { server, client } = await setup(t);
  const heads = [];
  client.on("head", (h) => heads.push([h.chatId, h.head, h.previous, h.cause]));
  const order = [];
  client.on("event", (f) => order.push(f.type));
  client.on("head", () => order.push("(head)"));
  client.subscribe("c1");
  client.connect();
  let conn = await server.accept(client, 1);
  await answerSubscribe(client, conn, { seq: 0, snapshot: { ...snapshot(), head: null } });
  assert.equal(client.head("c1"), null, "an empty chat's head is known: none");
  assert.deepEqual(heads, [["c1", null, null, null]], "the head became known");
  heads.length = 0;
  order.length = 0;
  const log = new Log();
  conn.push(...log.message("m1", null, "t1", null), ...log.answer("t1", "hi"));
  await roundTrip(client);
  assert.deepEqual(heads, [["c1", "t1", null, "message"]]);
  assert.deepEqual(order.slice(0, 4), ["user_message", "turn_start", "head", "(head)"],
    "the head event first, then the move");
  assert.deepEqual(client.activePath("c1"), ["m1", "t1"]);

  // Offline, another device retries twice and undoes once.
  conn.drop(1006);
  const missed = [...log.retry("m1", "t1", "t2"), ...log.retry("m1", "t2", "t3"), log.head("t2", "t3", "switch")];
  conn = await server.accept(client, 2);
  const resub = await conn.next("subscribe");
  assert.deepEqual(resub.since, { seq: 5, epoch: "e1" });
  heads.length = 0;
  conn.subscribed(resub, { seq: log.next - 1, replayed: missed.length, snapshot: { ...snapshot(), head: "t2" } });
  conn.push(...missed);
  await roundTrip(client);
  assert.deepEqual(heads, [["c1", "t2", "t1", null]],
    "one move, told by the snapshot: the replayed moves are older");
  assert.equal(client.head("c1"), "t2");
  assert.deepEqual(client.activePath("c1"), ["m1", "t2"]);
  assert.deepEqual(client.siblings("c1", "t2"), { ids: ["t1", "t2", "t3"], index: 1 });

  // recovered: false: the tree goes with the history; a reloaded page fills it again.
  conn.push({ type: "subscribed", chat_id: "c1", epoch: "e2", seq: 3, recovered: false, replayed: 0,
    snapshot: { ...snapshot(), head: "t7" } });
  await roundTrip(client);
  assert.deepEqual(client.activePath("c1"), ["t7"], "only the head is known");
  assert.equal(client.tree("c1").nodes.size, 0);
  const fresh = new Log("c1");
  fresh.message("m7", null, "t7", null);
  client.loadHistory("c1", { chat_id: "c1", epoch: "old", last_seq: 3, next_after: null, head: "t7", events: fresh.frames });
  assert.equal(client.tree("c1").nodes.size, 0, "a page of another epoch is ignored");
  client.loadHistory("c1", { chat_id: "c1", epoch: "e2", last_seq: 3, next_after: null, head: "t7", forks: {}, events: fresh.frames });
  assert.deepEqual(client.activePath("c1"), ["m7", "t7"]);
});

test("the tree operations' frames, acks, and a conflict", async (t) => {
  const { server, client } = await setup(t);
  const heads = [];
  client.on("head", (h) => heads.push(h.head));
  client.subscribe("c1");
  client.connect();
  const conn = await server.accept(client, 1);
  await answerSubscribe(client, conn, { seq: 9, snapshot: { ...snapshot(), head: "t1" } });
  assert.deepEqual(heads, ["t1"]);

  const retry = client.retry("c1");
  const req = await conn.next("retry");
  assert.deepEqual(strip(req), { type: "retry", chat_id: "c1", expected_head: "t1" }, "the known head is expected");
  conn.push({ type: "ack", chat_id: "c1", id: req.id, seq: 10, client_msg_id: null, turn_id: "t2",
    duplicate: false, head: "t2" });
  assert.equal((await retry).turn_id, "t2");
  assert.equal(client.head("c1"), "t1", "a live chat's head moves by its head event, not the ack");
  conn.push({ type: "turn_start", chat_id: "c1", seq: 10, ts: 1, node: "t2", data: { turn_id: "t2", started_at: 1, parent_id: "m1", retry_of: "t1" } },
    { type: "head", chat_id: "c1", seq: 11, ts: 1, data: { head_id: "t2", prev_head_id: "t1", cause: "retry", by: "u1" } });
  await roundTrip(client);
  assert.deepEqual(heads, ["t1", "t2"]);
  assert.equal(client.head("c1"), "t2");

  const edit = client.edit("c1", "m1", "better words", { clientMsgId: "m-e", cancel: true });
  const editReq = await conn.next("edit");
  assert.deepEqual(strip(editReq), { type: "edit", chat_id: "c1", msg_id: "m1", text: "better words",
    client_msg_id: "m-e", expected_head: "t2", cancel: true });
  const log = new Log("c1", 12);
  conn.push(...log.message("m2", null, "t3", "t2", "m1"));
  conn.push({ type: "ack", chat_id: "c1", id: editReq.id, seq: 12, client_msg_id: "m-e", turn_id: "t3",
    duplicate: false, head: "t3", msg_id: "m2" });
  assert.equal((await edit).msg_id, "m2");
  assert.equal(client.head("c1"), "t3");

  const undo = client.undo("c1");
  const undoReq = await conn.next("undo");
  assert.equal(undoReq.expected_head, "t3");
  conn.push(log.head("t2", "t3", "undo"));
  conn.push({ type: "ack", chat_id: "c1", id: undoReq.id, seq: 15, client_msg_id: "m-e", turn_id: null,
    duplicate: false, head: "t2", msg_id: "m2", text: "better words" });
  const undone = await undo;
  assert.equal(undone.text, "better words", "undo gives the text back");
  assert.deepEqual(heads, ["t1", "t2", "t3", "t2"]);

  // Another device moved the head meanwhile: the switch expects t2 and is refused.
  const sw = client.switch("c1", "m2");
  const swReq = await conn.next("switch");
  assert.deepEqual(strip(swReq), { type: "switch", chat_id: "c1", node_id: "m2", expected_head: "t2" });
  conn.push({ type: "error", code: "conflict", message: "the head moved", id: swReq.id, chat_id: "c1", head: "t9" });
  await assert.rejects(sw, (err) => err instanceof GatewayError && err.code === "conflict" && err.head === "t9");
  assert.equal(client.head("c1"), "t2", "a refusal does not move the head: the head event will");

  // A chat this connection does not get live: the ack's head is all it hears.
  const other = client.undo("c2");
  const otherReq = await conn.next("undo");
  assert.equal("expected_head" in otherReq, false, "no head known: none expected");
  conn.push({ type: "ack", chat_id: "c2", id: otherReq.id, seq: 7, client_msg_id: "x", turn_id: null,
    duplicate: false, head: "t5", msg_id: "m6", text: "hi" });
  await other;
  assert.equal(client.head("c2"), "t5");
  assert.deepEqual(heads.at(-1), "t5");

  // expectedHead: false sends none; null expects an empty conversation.
  const unanswered = [client.retry("c1", { expectedHead: false }), client.undo("c1", { expectedHead: null })];
  assert.equal("expected_head" in (await conn.next("retry")), false);
  assert.equal((await conn.next("undo")).expected_head, null);
  const refused = client.undo("c1", { expectedHead: null });
  const refusedReq = await conn.next("undo");
  conn.push({ type: "error", code: "nothing_to_undo", message: "nothing", id: refusedReq.id, chat_id: "c1", head: null });
  await assert.rejects(refused, (err) => err.code === "nothing_to_undo" && err.head === null);
  client.close(); // written, never answered: they fail rather than wait forever
  for (const p of unanswered) {
    await assert.rejects(within(p, 2000, "an unanswered operation to fail"), (err) => err.code === "disconnected");
  }
});

test("an operation written before a drop is not sent again; one queued while offline is", async (t) => {
  const { server, client } = await setup(t);
  client.connect();
  let conn = await server.accept(client, 1);
  const written = client.retry("c1", { expectedHead: "t1" });
  await conn.next("retry");
  conn.drop(1006);
  await assert.rejects(within(written, 2000, "the written retry to fail"),
    (err) => err instanceof GatewayError && err.code === "disconnected");
  const queued = client.undo("c1", { expectedHead: "t1" });
  conn = await server.accept(client, 2);
  const req = await conn.next("undo");
  await roundTrip(client);
  assert.equal(conn.of("retry").length, 0, "the retry is not repeated");
  conn.push({ type: "ack", chat_id: "c1", id: req.id, seq: 4, client_msg_id: "x", turn_id: null,
    duplicate: false, head: null, msg_id: "m1", text: "hi" });
  assert.equal((await queued).text, "hi");
  assert.equal(client.outboxSize, 0);
});

/** `promise`, or a failure naming `what` after `ms`. */
function within(promise, ms, what) {
  let timer;
  const timeout = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error("timed out waiting for " + what)), ms);
  });
  return Promise.race([promise, timeout]).finally(() => clearTimeout(timer));
}

function snapshot() {
  return { title: null, status: "idle", turn_id: null, started_at: null, goal_state: null };
}

/** A request frame without its id. */
function strip(frame) {
  const { id: _id, ...rest } = frame;
  return rest;
}
