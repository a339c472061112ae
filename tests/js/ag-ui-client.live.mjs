// @ag-ui/client's HttpAgent against a running gateway and agent (POST /v1/ag-ui).
//
// Not one of the `npm test` files (it needs a gateway): tests/test_ag_ui_frontend.py starts
// one, with an agent whose answers these tests know, and runs
//   GATEWAY_HTTP=... GATEWAY_TOKEN=... SLOW_ANSWER=... node --test ag-ui-client.live.mjs
// The agent answers "slow" with SLOW_ANSWER, word by word (about 2 s), "pay ..." by asking
// the person with the client tool `approve` (and an answer's turn with "paid: <answer>"),
// "ponder" with PONDER as reasoning, word by word, then "pondered", anything else with
// reasoning, "Hello world", a tool call `search` and its result.

import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import { test } from 'node:test';

import { HttpAgent } from '@ag-ui/client';

const HTTP = process.env.GATEWAY_HTTP;
const TOKEN = process.env.GATEWAY_TOKEN;
const SLOW = process.env.SLOW_ANSWER;
const PONDER = process.env.PONDER;
const AUTH = { Authorization: `Bearer ${TOKEN}` };

if (!HTTP || !TOKEN || !SLOW || !PONDER) {
  throw new Error('run by tests/test_ag_ui_frontend.py: GATEWAY_HTTP, GATEWAY_TOKEN, SLOW_ANSWER, PONDER');
}

const threadId = () => `agui-${randomUUID().slice(0, 12)}`;
const agentFor = (id) => new HttpAgent({ url: `${HTTP}/v1/ag-ui`, headers: AUTH, threadId: id });
const say = (agent, content) => agent.addMessage({ id: randomUUID(), role: 'user', content });
const texts = (agent) => agent.messages.filter((m) => m.role === 'assistant' && m.content)
  .map((m) => m.content);

/** Every event type the run applied, in order. */
function recorder() {
  const types = [];
  return { types, subscriber: { onEvent: ({ event }) => { types.push(event.type); } } };
}

test('a run: the answer, its reasoning, and a tool call with its result', async () => {
  const agent = agentFor(threadId());
  say(agent, 'hi there');
  const { types, subscriber } = recorder();
  const { newMessages } = await agent.runAgent({}, subscriber);
  assert.deepEqual(types.slice(0, 2), ['RUN_STARTED', 'MESSAGES_SNAPSHOT']);
  assert.equal(types.at(-1), 'RUN_FINISHED');
  assert.deepEqual(texts(agent), ['Hello world']);
  assert.deepEqual(agent.messages.filter((m) => m.role === 'reasoning').map((m) => m.content),
    ['thinking']);
  const [call] = agent.messages.flatMap((m) => m.toolCalls ?? []);
  assert.equal(call.function.name, 'search');
  assert.deepEqual(JSON.parse(call.function.arguments), { q: 'hi there' });
  const [result] = agent.messages.filter((m) => m.role === 'tool');
  assert.equal(result.toolCallId, call.id);
  assert.deepEqual(JSON.parse(result.content), { hits: 3 });
  assert.ok(newMessages.length >= 4, JSON.stringify(newMessages));

  // A second run on the same thread: the snapshot keeps the first answer where it was.
  say(agent, 'and again');
  await agent.runAgent();
  assert.deepEqual(texts(agent), ['Hello world', 'Hello world']);
  assert.deepEqual(agent.messages.filter((m) => m.role === 'user').map((m) => m.content),
    ['hi there', 'and again']);
});

test('a client tool: the question finishes the run; a tool message answers it', async () => {
  const id = threadId();
  const created = await fetch(`${HTTP}/v1/conversations`, {
    method: 'POST', headers: { ...AUTH, 'Content-Type': 'application/json' },
    body: JSON.stringify({ chat_id: id }),
  });
  assert.equal(created.status, 201);
  const declared = await fetch(`${HTTP}/v1/conversations/${id}`, {
    method: 'PATCH', headers: { ...AUTH, 'Content-Type': 'application/json' },
    body: JSON.stringify({ client_tools: [{ name: 'approve', parameters: { type: 'object' } }] }),
  });
  assert.equal(declared.status, 200);
  const agent = agentFor(id);
  say(agent, 'pay the bill');
  let pending;
  await agent.runAgent({}, {
    onRunFinishedEvent: ({ pendingToolCallIds }) => { pending = pendingToolCallIds; },
  });
  const [call] = agent.messages.flatMap((m) => m.toolCalls ?? []);
  assert.equal(call.function.name, 'approve');
  assert.deepEqual(JSON.parse(call.function.arguments), { amount: 5 });
  assert.deepEqual(pending, [call.id]);
  agent.addMessage({ id: randomUUID(), role: 'tool', toolCallId: call.id, content: '"yes"' });
  await agent.runAgent();
  assert.deepEqual(texts(agent), ['Let me ask.', 'paid: yes']);
});

test('a reconnect mid-answer: the whole answer, each character once, on any device', async () => {
  const id = threadId();
  const agent = agentFor(id);
  say(agent, 'slow');
  let seen = '';
  let dropped;
  const dropping = new Promise((resolve) => { dropped = resolve; });
  const first = agent.runAgent({}, {
    onTextMessageContentEvent: ({ event }) => {
      seen += event.delta;
      if (seen.length >= 12) dropped();
    },
  }).catch(() => undefined); // an aborted run may reject
  await dropping;
  agent.abortRun(); // the network drops: the turn goes on
  await first;
  assert.ok(texts(agent).join('').length < SLOW.length, 'dropped before the end');

  // The same page runs again with what it holds; another device, with nothing.
  const other = agentFor(id);
  await Promise.all([agent.runAgent(), other.runAgent()]);
  for (const device of [agent, other]) {
    assert.deepEqual(texts(device), [SLOW]);
    assert.deepEqual(device.messages.filter((m) => m.role === 'user').map((m) => m.content),
      ['slow']);
  }
});

test('a reconnect mid-reasoning: the reasoning once', async () => {
  const agent = agentFor(threadId());
  say(agent, 'ponder');
  let seen = '';
  let dropped;
  const dropping = new Promise((resolve) => { dropped = resolve; });
  const first = agent.runAgent({}, {
    onReasoningMessageContentEvent: ({ event }) => {
      seen += event.delta;
      if (seen.length >= 6) dropped();
    },
  }).catch(() => undefined);
  await dropping;
  agent.abortRun();
  await first;
  await agent.runAgent();
  const reasoning = agent.messages.filter((m) => m.role === 'reasoning').map((m) => m.content);
  assert.deepEqual(reasoning, [PONDER]);
  assert.deepEqual(texts(agent), ['pondered']);
});
