// Answers being written (protocol.md, "Streams"): snapshot first, deltas at exactly their
// position, a skipped position resyncs, commit / discard / gone end a stream.

import assert from "node:assert/strict";
import { test } from "node:test";

import { answerSubscribe, ev, roundTrip, setup } from "./fake-server.mjs";

const snapshot = (streams) => ({
  title: null, status: "running", turn_id: "t1", started_at: 1, goal_state: null, streams,
});
const delta = (chatId, id, pos, text, type = "delta") => ({
  type, chat_id: chatId, seq: null, ts: 1, stream: { id, pos }, data: { text },
});

/** Record the client's "stream" events as compact strings. */
function streamLog(client) {
  const log = [];
  client.on("stream", (e) => log.push(e.stream
    ? `${e.id}${e.reset ? " reset" : ""} ${JSON.stringify(e.stream.text)} pos ${e.stream.pos}`
    : `${e.id} ended ${e.ended}${e.frame ? " by seq " + e.frame.seq : ""}`));
  return log;
}

test("a snapshot's stream continues with deltas at exactly its position", async (t) => {
  const { server, client } = await setup(t);
  const log = streamLog(client);
  const events = [];
  client.on("event", (f) => events.push(f.type + (f.stream ? "@" + f.stream.pos : "")));
  client.subscribe("c1");
  client.connect();
  const conn = await server.accept(client, 1);
  await answerSubscribe(client, conn, {
    seq: 3, snapshot: snapshot([{ id: "s1", type: "delta", turn_id: "t1", text: "Hello", pos: 2 }]),
  });
  assert.deepEqual(client.streams("c1"),
    [{ id: "s1", type: "delta", turnId: "t1", text: "Hello", pos: 2 }], "whole text at once");
  conn.push(delta("c1", "s1", 2, ","), delta("c1", "s1", 1, "llo"), delta("c1", "s1", 3, " world"));
  await roundTrip(client);
  assert.deepEqual(log, ['s1 reset "Hello" pos 2', 's1 "Hello," pos 3', 's1 "Hello, world" pos 4']);
  assert.deepEqual(events, ["delta@2", "delta@3"], "the repeated position is skipped");
  assert.equal(client.duplicatesDropped, 1);

  // A second stream of the turn, from position 0; then the commits.
  conn.push(delta("c1", "r1", 0, "thinking", "reasoning_delta"));
  conn.push(ev("c1", 4, "reasoning", { text: "thinking", stream_id: "r1" }));
  conn.push(ev("c1", 5, "message", { text: "Hello, world", stream_id: "s1" }));
  await roundTrip(client);
  assert.deepEqual(log.slice(3), ['r1 "thinking" pos 1', "r1 ended committed by seq 4",
    "s1 ended committed by seq 5"]);
  assert.deepEqual(client.streams("c1"), []);
  assert.deepEqual(events.slice(2), ["reasoning_delta@0", "reasoning", "message"]);
});

test("a skipped position resyncs with since; the new snapshot replaces the text", async (t) => {
  const { server, client } = await setup(t);
  const log = streamLog(client);
  const gaps = [];
  client.on("gap", (g) => gaps.push(g));
  const modes = [];
  client.on("subscribed", (s) => modes.push(s.mode));
  client.subscribe("c1");
  client.connect();
  const conn = await server.accept(client, 1);
  await answerSubscribe(client, conn, {
    seq: 3, snapshot: snapshot([{ id: "s1", type: "delta", turn_id: "t1", text: "ab", pos: 2 }]),
  });
  conn.push(delta("c1", "s1", 3, "d")); // position 2 never came
  const resync = await conn.next("subscribe");
  assert.deepEqual(gaps, [{ chatId: "c1", stream: "s1", expected: 2, got: 3 }]);
  assert.deepEqual(resync.since, { seq: 3, epoch: "e1" }, "resubscribed from the last seq");
  conn.push(delta("c1", "s1", 4, "e")); // before the reply: the snapshot will hold it
  conn.subscribed(resync, {
    seq: 3, replayed: 0,
    snapshot: snapshot([{ id: "s1", type: "delta", turn_id: "t1", text: "abcde", pos: 5 }]),
  });
  conn.push(delta("c1", "s1", 5, "f"));
  await roundTrip(client);
  assert.deepEqual(log, ['s1 reset "ab" pos 2', 's1 reset "abcde" pos 5', 's1 "abcdef" pos 6']);
  assert.deepEqual(modes, ["fresh", "since"]);
  assert.equal(gaps.length, 1, "one resync, not one per delta");

  // An unknown stream that starts past position 0: resync too.
  conn.push(delta("c1", "s2", 2, "x"));
  const again = await conn.next("subscribe");
  assert.deepEqual(gaps[1], { chatId: "c1", stream: "s2", expected: 0, got: 2 });
  assert.deepEqual(again.since, { seq: 3, epoch: "e1" });
});

test("stream_discarded and streams missing from a snapshot end them", async (t) => {
  const { server, client } = await setup(t);
  const log = streamLog(client);
  const events = [];
  client.on("event", (f) => events.push(f.type));
  client.subscribe("c1");
  client.connect();
  let conn = await server.accept(client, 1);
  await answerSubscribe(client, conn, {
    seq: 3, snapshot: snapshot([
      { id: "s1", type: "delta", turn_id: "t1", text: "first try", pos: 1 },
      { id: "r1", type: "reasoning_delta", turn_id: "t1", text: "hmm", pos: 1 },
    ]),
  });
  // The turn is redelivered: its open stream is discarded, a new attempt streams anew.
  conn.push({ type: "stream_discarded", chat_id: "c1", seq: null, ts: 1,
    data: { stream_id: "s1", type: "delta", turn_id: "t1" } });
  conn.push(delta("c1", "s2", 0, "second"));
  await roundTrip(client);
  assert.deepEqual(log.slice(2), ["s1 ended discarded", 's2 "second" pos 1']);
  assert.deepEqual(events, ["stream_discarded", "delta"]);

  // Reconnected after r1 was committed while away: the snapshot no longer lists it.
  conn.drop(1006);
  conn = await server.accept(client, 2);
  const req = await answerSubscribe(client, conn, {
    seq: 5, replayed: 2,
    snapshot: snapshot([{ id: "s2", type: "delta", turn_id: "t1", text: "second try", pos: 2 }]),
  });
  assert.deepEqual(req.since, { seq: 3, epoch: "e1" });
  assert.deepEqual(log.slice(4), ["r1 ended gone", 's2 reset "second try" pos 2']);
  assert.deepEqual(client.streams("c1").map((s) => s.id), ["s2"]);
});

test("a stream from position 0 to its commit; another chat's deltas are not shown", async (t) => {
  const { server, client } = await setup(t);
  const log = streamLog(client);
  client.subscribe("c1");
  client.connect();
  const conn = await server.accept(client, 1);
  await answerSubscribe(client, conn, { seq: 0 });
  conn.push(delta("c1", "s1", 0, "a"), delta("c1", "s1", 1, "b"));
  conn.push(ev("c1", 1, "message", { text: "ab", stream_id: "s1" }));
  conn.push(delta("other", "x", 0, "not mine"));
  await roundTrip(client);
  assert.deepEqual(log, ['s1 "a" pos 1', 's1 "ab" pos 2', "s1 ended committed by seq 1"]);
  assert.deepEqual(client.streams("other"), []);
});
