// Shared conversations: who shares each chat (the feed's owner/members, `members` frames,
// setMembers()), and `removed`, which ends a chat's subscription for good.

import assert from "node:assert/strict";
import { test } from "node:test";

import { GatewayError } from "../../gateway/static/gateway-client.js";
import { answerSubscribe, ev, roundTrip, setup } from "./fake-server.mjs";

function feed(chatId, fields = {}) {
  return {
    type: "conversation", chat_id: chatId, title: null, status: "idle", updated_at: 1,
    last_seq: 1, goal_state: null, preview: null, created: false, deleted: false, ...fields,
  };
}

test("members() and role() follow the feed's owner and members, and `members` frames", async (t) => {
  const { server, client } = await setup(t);
  const heard = [];
  client.on("members", (e) => heard.push(e));
  client.connect();
  const conn = await server.accept(client, 1, "bob");
  assert.equal(client.members("c1"), null);
  assert.equal(client.role("c1"), null, "not known");
  conn.push(feed("c1", { owner: "alice", members: { bob: "member" } }));
  await roundTrip(client);
  assert.deepEqual(client.members("c1"), { owner: "alice", members: { bob: "member" } });
  assert.equal(client.role("c1"), "member");
  assert.equal(client.role("c1", "alice"), "owner");
  assert.equal(client.role("c1", "dave"), null);
  conn.push({ type: "members", chat_id: "c1", owner: "alice", members: { bob: "viewer", carol: "member" }, ts: 2 });
  await roundTrip(client);
  assert.equal(client.role("c1"), "viewer", "made a viewer");
  assert.equal(heard.length, 1);
  assert.deepEqual({ ...heard[0], frame: undefined },
    { chatId: "c1", owner: "alice", members: { bob: "viewer", carol: "member" }, frame: undefined });
  assert.equal(heard[0].frame.type, "members");
  // A copy: changing what members() returned changes nothing kept.
  client.members("c1").members.bob = "member";
  assert.equal(client.role("c1"), "viewer");
  conn.push(feed("c1", { deleted: true, removed: true }));
  await roundTrip(client);
  assert.equal(client.members("c1"), null, "a deletion forgets it");
});

test("`removed` ends the chat's subscription, forgets it, and never resubscribes", async (t) => {
  const { server, client } = await setup(t);
  const removed = [];
  const events = [];
  client.on("removed", (e) => removed.push(e));
  client.on("event", (f) => events.push(f.type));
  client.subscribe("c1", { create: false });
  client.subscribe("c2");
  client.connect();
  const conn = await server.accept(client, 1, "bob");
  await answerSubscribe(client, conn, { seq: 3 });
  await answerSubscribe(client, conn, { seq: 1 });
  conn.push(feed("c1", { owner: "alice", members: { bob: "member" } }));
  conn.push({ type: "removed", chat_id: "c1", user_id: "bob",
    reason: "removed from the conversation by its owner", ts: 5 });
  conn.push(ev("c1", 4)); // nothing more of it reaches the app
  await roundTrip(client);
  assert.equal(removed.length, 1);
  assert.equal(removed[0].chatId, "c1");
  assert.equal(removed[0].userId, "bob");
  assert.equal(removed[0].reason, "removed from the conversation by its owner");
  assert.deepEqual(events, [], "the removal is no conversation event; later frames are dropped");
  assert.deepEqual(client.subscriptions, ["c2"]);
  assert.equal(client.position("c1"), null);
  assert.equal(client.tree("c1"), null);
  assert.equal(client.members("c1"), null);
  // A reconnect resubscribes c2 only.
  conn.drop(1012, "restart");
  const again = await server.accept(client, 2, "bob");
  const sub = await again.next("subscribe");
  assert.equal(sub.chat_id, "c2");
  again.subscribed(sub, { seq: 1 });
  await roundTrip(client);
  assert.deepEqual(again.of("subscribe").map((f) => f.chat_id), ["c2"]);
});

test("`removed` while a message waits in the outbox rejects it with the reason", async (t) => {
  const { server, client } = await setup(t);
  client.subscribe("c1");
  client.connect();
  const conn = await server.accept(client, 1, "bob");
  await answerSubscribe(client, conn, { seq: 1 });
  const sent = client.sendMessage("c1", "hello");
  await conn.next("message"); // written, not answered yet
  conn.push({ type: "removed", chat_id: "c1", user_id: "bob", reason: "removed by its owner", ts: 2 });
  await assert.rejects(sent, (e) => e instanceof GatewayError && e.code === "forbidden"
    && e.message === "removed by its owner");
  assert.equal(client.outboxSize, 0);
});

test("setMembers() patches once with the change, and members() keeps the reply", async (t) => {
  const { server, client } = await setup(t);
  const reply = { chat_id: "c 1", owner: "alice", members: { bob: "member", carol: "viewer" }, removed: ["dave"] };
  server.onHttp = (req) => (req.method === "PATCH" ? { status: 200, body: reply } : server.defaultHttp(req));
  const got = await client.setMembers("c 1", { set: { bob: "member", carol: "viewer" }, remove: ["dave"] });
  assert.deepEqual(got, reply);
  assert.deepEqual(server.requests, [{
    method: "PATCH", url: "/v1/conversations/c%201/members", authorization: "Bearer tok",
    body: { set: { bob: "member", carol: "viewer" }, remove: ["dave"] },
  }]);
  assert.deepEqual(client.members("c 1"), { owner: "alice", members: { bob: "member", carol: "viewer" } });
  assert.equal(client.role("c 1", "carol"), "viewer");
  server.onHttp = () => ({ status: 403, body: { error: { code: "forbidden", message: "only its owner" } } });
  await assert.rejects(client.setMembers("c 1", { remove: ["bob"] }),
    (e) => e instanceof GatewayError && e.code === "forbidden" && e.status === 403);
  assert.equal(server.requests.length, 2, "asked once");
  assert.deepEqual(server.requests[1].body, { remove: ["bob"] }, "only the fields given");
});
