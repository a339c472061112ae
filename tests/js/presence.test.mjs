// Presence and typing: who is connected to a chat (the snapshot's list, then `presence`
// frames, the highest `v` kept), who is typing (shown for three typing_intervals, or until
// their message), and sendTyping() (one per typing_interval, the `typed` reply's `sent`).

import assert from "node:assert/strict";
import { test } from "node:test";

import { GatewayError } from "../../gateway/static/gateway-client.js";
import { answerSubscribe, ev, roundTrip, setup, until } from "./fake-server.mjs";

const SNAPSHOT = { title: null, status: "idle", turn_id: null, started_at: null, goal_state: null };

function list(v, users, agents = []) {
  return {
    v,
    users: Object.entries(users).map(([user_id, connections]) => ({ user_id, connections })),
    agents: Object.entries(agents).map(([name, workers]) => ({ name, workers })),
  };
}

function presenceFrame(chatId, v, users, agents = {}) {
  return { type: "presence", chat_id: chatId, ts: v, ...list(v, users, agents) };
}

/** Records every `presence` and `typing` event, and every `event`. */
function record(client) {
  const seen = { presence: [], typing: [], events: [] };
  client.on("presence", (e) => seen.presence.push(e));
  client.on("typing", (e) => seen.typing.push(e));
  client.on("event", (f) => seen.events.push(f));
  return seen;
}

/** A client connected as `user` (limits override hello's), subscribed to c1 with `presence`. */
async function live(t, presence, { user = "u1", limits = {} } = {}) {
  const { server, client } = await setup(t);
  const seen = record(client);
  client.connect();
  const conn = await server.accept(client, 1, user, limits);
  client.subscribe("c1");
  await answerSubscribe(client, conn, { snapshot: { ...SNAPSHOT, presence } });
  return { server, client, conn, seen };
}

test("presence: the snapshot's list, then newer frames; an older v is ignored", async (t) => {
  const { client, conn, seen } = await live(t, list(100, { u1: 1 }));
  assert.deepEqual(client.presence("c1"), list(100, { u1: 1 }));
  assert.deepEqual(seen.presence.map((e) => e.presence), [list(100, { u1: 1 })]);
  assert.equal(seen.presence[0].chatId, "c1");
  assert.equal(client.presence("other"), null);

  conn.push(presenceFrame("c1", 200, { u1: 2 }, { default: 1 }));
  await roundTrip(client);
  assert.deepEqual(client.presence("c1"), list(200, { u1: 2 }, { default: 1 }));
  assert.equal(seen.presence.at(-1).frame.v, 200);

  conn.push(presenceFrame("c1", 150, { u1: 5 }), presenceFrame("c1", 200, { u1: 7 }));
  await roundTrip(client);
  assert.deepEqual(client.presence("c1"), list(200, { u1: 2 }, { default: 1 }), "not newer: kept");
  assert.equal(seen.presence.length, 2);

  conn.push(presenceFrame("c1", 201, { u1: 1 }));
  await roundTrip(client);
  assert.deepEqual(client.presence("c1"), list(201, { u1: 1 }));
  // The app gets copies: changing one changes nothing the client holds.
  client.presence("c1").users[0].connections = 99;
  seen.presence.at(-1).presence.users.length = 0;
  assert.deepEqual(client.presence("c1"), list(201, { u1: 1 }));
  // Not conversation events: never given as `event`.
  assert.deepEqual(seen.events, []);
});

test("presence: forgotten while not live, and the next snapshot tells again", async (t) => {
  const { server, client, conn, seen } = await live(t, list(100, { u1: 1, u2: 1 }));
  conn.push(presenceFrame("other", 300, { u1: 1 }));
  await roundTrip(client);
  assert.equal(client.presence("other"), null, "a chat the client does not hold");

  // Unsubscribed: frames are not buffered for it, so what the client held goes stale.
  const off = client.unsubscribe("c1");
  assert.equal(client.presence("c1"), null);
  assert.deepEqual(seen.presence.at(-1), { chatId: "c1", presence: null });
  conn.push({ type: "unsubscribed", chat_id: "c1", id: (await conn.next("unsubscribe")).id });
  await off;
  conn.push(presenceFrame("c1", 400, { u2: 1 }));
  await roundTrip(client);
  assert.equal(client.presence("c1"), null, "a frame for an unsubscribed chat is ignored");

  client.subscribe("c1");
  await answerSubscribe(client, conn, { snapshot: { ...SNAPSHOT, presence: list(90, { u1: 1 }) } });
  assert.deepEqual(client.presence("c1"), list(90, { u1: 1 }), "the snapshot after forgetting");

  // The connection drops: not known meanwhile; the resubscribe's snapshot tells.
  const count = seen.presence.length;
  conn.drop();
  await until(() => client.state === "reconnecting", "reconnecting");
  assert.equal(client.presence("c1"), null);
  assert.deepEqual(seen.presence.slice(count), [{ chatId: "c1", presence: null }]);
  const again = await server.accept(client, 2);
  await answerSubscribe(client, again, { snapshot: { ...SNAPSHOT, presence: list(500, { u1: 2 }) } });
  assert.deepEqual(client.presence("c1"), list(500, { u1: 2 }));
  assert.deepEqual(seen.presence.at(-1).presence, list(500, { u1: 2 }));
});

test("typing: a user shows until their message, or three typing_intervals", async (t) => {
  // typing_interval 0.1 s: a typing shows for about 300 ms.
  const { client, conn, seen } = await live(t, list(100, { u1: 2, u2: 1, u3: 1 }),
    { limits: { typing_interval: 0.1 } });
  assert.deepEqual(client.typing("c1"), []);
  const heard = Date.now();
  conn.push({ type: "typing", chat_id: "c1", user_id: "u2", ts: 1 },
    { type: "typing", chat_id: "c1", user_id: "u1", ts: 2 }); // this user's other device
  await roundTrip(client);
  assert.deepEqual(client.typing("c1"), ["u1", "u2"]);
  assert.deepEqual(seen.typing.map((e) => [e.users, e.frame.user_id]), [[["u2"], "u2"], [["u1", "u2"], "u1"]]);
  assert.deepEqual(seen.events, [], "typing is not a conversation event");

  // u2 sends their message: no longer typing, at once.
  conn.push(ev("c1", 1, "user_message", { text: "hi", client_msg_id: "m1", user_id: "u2", msg_id: "m_1", parent_id: null }));
  await roundTrip(client);
  assert.deepEqual(client.typing("c1"), ["u1"]);
  assert.deepEqual(seen.typing.at(-1), { chatId: "c1", users: ["u1"] });

  // u1 heard nothing more: gone after about 300 ms, told by an event.
  await until(() => client.typing("c1").length === 0, "u1 no longer typing", 2000);
  assert.ok(Date.now() - heard >= 290, `typing ended after ${Date.now() - heard} ms`);
  await until(() => seen.typing.at(-1).users.length === 0, "the typing event of its end", 2000);
  assert.ok(!("frame" in seen.typing.at(-1)));

  // A typing renewed keeps the user shown past the first one's time.
  conn.push({ type: "typing", chat_id: "c1", user_id: "u3", ts: 3 });
  await roundTrip(client);
  const first = Date.now();
  await until(() => Date.now() - first >= 200, "two thirds of the time");
  conn.push({ type: "typing", chat_id: "c1", user_id: "u3", ts: 4 });
  await roundTrip(client);
  await until(() => Date.now() - first >= 350, "past the first typing's time");
  assert.deepEqual(client.typing("c1"), ["u3"], "renewed by the second");
  await until(() => client.typing("c1").length === 0, "u3 no longer typing", 2000);
});

test("typing: a user who leaves the presence list stops typing; none while not live", async (t) => {
  const { server, client, conn, seen } = await live(t, list(100, { u1: 1, u2: 1 }));
  conn.push({ type: "typing", chat_id: "c1", user_id: "u2", ts: 1 },
    { type: "typing", chat_id: "other", user_id: "u2", ts: 1 });
  await roundTrip(client);
  assert.deepEqual(client.typing("c1"), ["u2"]);
  assert.deepEqual(client.typing("other"), []);
  conn.push(presenceFrame("c1", 200, { u1: 1 }));
  await roundTrip(client);
  assert.deepEqual(client.typing("c1"), []);
  assert.deepEqual(seen.typing.at(-1), { chatId: "c1", users: [] });

  conn.push(presenceFrame("c1", 300, { u1: 1, u2: 1 }), { type: "typing", chat_id: "c1", user_id: "u2", ts: 2 });
  await roundTrip(client);
  assert.deepEqual(client.typing("c1"), ["u2"]);
  conn.drop();
  await until(() => client.state === "reconnecting", "reconnecting");
  assert.deepEqual(client.typing("c1"), [], "not known while away");
  assert.deepEqual(seen.typing.at(-1), { chatId: "c1", users: [] });
  await server.accept(client, 2);
});

test("sendTyping(): one per typing_interval, resolving with the typed reply's sent", async (t) => {
  const { client, conn } = await live(t, list(100, { u1: 1 }), { limits: { typing_interval: 0.2 } });
  const first = client.sendTyping("c1");
  const req = await conn.next("typing");
  assert.equal(req.chat_id, "c1");
  assert.ok(req.id != null);
  conn.push({ type: "typed", chat_id: "c1", sent: true, id: req.id });
  assert.equal(await first, true);

  // Sooner than typing_interval: not sent at all.
  const sentAt = Date.now();
  assert.equal(await client.sendTyping("c1"), false);
  await roundTrip(client);
  assert.equal(conn.of("typing").length, 1);

  // After it: sent again; the gateway may still drop it (sent: false).
  await until(() => Date.now() - sentAt >= 200, "typing_interval");
  const second = client.sendTyping("c1");
  const req2 = await conn.next("typing");
  conn.push({ type: "typed", chat_id: "c1", sent: false, id: req2.id });
  assert.equal(await second, false);
});

test("sendTyping(): refused for a chat not subscribed; false when not connected or lost", async (t) => {
  const { server, client, conn } = await live(t, list(100, { u1: 1 }));
  const refused = client.sendTyping("elsewhere");
  const req = await conn.next("typing");
  conn.push({ type: "error", code: "not_subscribed", message: "not subscribed", id: req.id, chat_id: "elsewhere" });
  await assert.rejects(refused, (e) => e instanceof GatewayError && e.code === "not_subscribed");

  // The connection drops before the reply: false (typing is of the moment, never resent).
  const lost = client.sendTyping("c1");
  await conn.next("typing");
  conn.drop();
  assert.equal(await lost, false);
  await until(() => client.state === "reconnecting", "reconnecting");
  assert.equal(await client.sendTyping("c1"), false, "not connected: nothing queued");
  const again = await server.accept(client, 2);
  await answerSubscribe(client, again);
  await roundTrip(client);
  assert.deepEqual(again.of("typing"), [], "nothing sent later");
});
