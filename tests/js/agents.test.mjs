// Named agents: the live ones (listAgents), a conversation created for one
// (createConversation), and a creating subscribe that names one.

import assert from "node:assert/strict";
import { test } from "node:test";

import { GatewayError } from "../../gateway/static/gateway-client.js";
import { answerSubscribe, roundTrip, setup } from "./fake-server.mjs";

const CONVERSATION = {
  chat_id: "c1", owner: "u1", title: "Trip", status: "idle", turn_id: null, epoch: "e1",
  last_seq: 1, created_at: 1, updated_at: 1, goal_state: null, preview: null, head: null,
  usage: { billed: {}, active: {} }, message_count: 0, parent: null, agent: "planner",
};

test("listAgents() asks GET /v1/agents with the token", async (t) => {
  const { server, client } = await setup(t);
  const agents = { agents: [{ name: "default", kind: "handler", workers: 1 },
    { name: "planner", kind: "ag-ui", workers: 2 }] };
  server.onHttp = (req) => (req.method === "GET" && req.url === "/v1/agents"
    ? { status: 200, body: agents } : server.defaultHttp(req));
  assert.deepEqual(await client.listAgents(), agents);
  assert.deepEqual(server.requests, [{ method: "GET", url: "/v1/agents", authorization: "Bearer tok" }]);
  server.onHttp = () => null; // no reply: the timeout says so
  await assert.rejects(client.listAgents({ timeout: 50 }),
    (e) => e instanceof GatewayError && e.code === "timeout");
});

test("createConversation() posts only the fields given, once; a refusal rejects", async (t) => {
  const { server, client } = await setup(t);
  server.onHttp = (req) => (req.method === "POST" && req.url === "/v1/conversations"
    ? { status: 201, body: { ...CONVERSATION, chat_id: req.body.chat_id ?? "made", agent: req.body.agent ?? "default" } }
    : server.defaultHttp(req));
  const made = await client.createConversation({ chat_id: "c1", title: "Trip", agent: "planner" });
  assert.equal(made.agent, "planner");
  assert.equal(made.chat_id, "c1");
  assert.deepEqual(server.requests[0], {
    method: "POST", url: "/v1/conversations", authorization: "Bearer tok",
    body: { chat_id: "c1", title: "Trip", agent: "planner" },
  });
  const child = await client.createConversation({ parent_chat_id: "c1", agent: undefined });
  assert.equal(child.chat_id, "made");
  assert.deepEqual(server.requests[1].body, { parent_chat_id: "c1" }, "nothing but what was given");
  await client.createConversation();
  assert.deepEqual(server.requests[2].body, {}, "an empty body: the gateway picks the id and the agent");

  server.onHttp = () => ({ status: 409, body: { error: { code: "conflict", message: "c1 exists" } } });
  await assert.rejects(client.createConversation({ chat_id: "c1" }),
    (e) => e instanceof GatewayError && e.code === "conflict" && e.status === 409);
  assert.equal(server.requests.length, 4, "not retried");
});

test("a creating subscribe names its agent, again after a reconnect; create: false never", async (t) => {
  const { server, client } = await setup(t);
  client.connect();
  let conn = await server.accept(client, 1);
  const subscribed = client.subscribe("c1", { agent: "planner" });
  const first = await answerSubscribe(client, conn);
  assert.equal(first.agent, "planner");
  assert.equal((await subscribed).chat_id, "c1");
  client.subscribe("c2");
  assert.equal((await answerSubscribe(client, conn)).agent, undefined, "no agent: the gateway's default");
  client.subscribe("c3", { agent: "planner", create: false });
  const link = await answerSubscribe(client, conn);
  assert.equal(link.create, false);
  assert.equal(link.agent, undefined, "a subscribe that cannot create names no agent");

  conn.drop(1012);
  conn = await server.accept(client, 2);
  const again = [await conn.next("subscribe"), await conn.next("subscribe"), await conn.next("subscribe")];
  await roundTrip(client);
  const byChat = Object.fromEntries(again.map((f) => [f.chat_id, f.agent]));
  assert.deepEqual(byChat, { c1: "planner", c2: undefined, c3: undefined },
    "a resubscribe may create the chat again: it names the same agent");
});
