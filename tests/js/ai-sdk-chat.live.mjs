// The `ai` package's Chat over DefaultChatTransport against a running gateway and agent.
//
// Not one of the `npm test` files (it needs a gateway): tests/test_ai_sdk.py starts one,
// with an agent whose answers these tests know, and runs
//   GATEWAY_HTTP=... GATEWAY_WS=... GATEWAY_TOKEN=... SLOW_ANSWER=... node --test ai-sdk-chat.live.mjs
// The agent answers "slow" with SLOW_ANSWER, word by word (about 2 s), "wait" with "waiting"
// and a dot every 50 ms until stopped, anything else with reasoning, "Hello world", a tool
// call and its result, a goal, a title and usage.

import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import { test } from 'node:test';

import { AbstractChat, DefaultChatTransport } from 'ai';
import WebSocket from 'ws';

const HTTP = process.env.GATEWAY_HTTP;
const WS = process.env.GATEWAY_WS;
const TOKEN = process.env.GATEWAY_TOKEN;
const SLOW = process.env.SLOW_ANSWER;
const API = `${HTTP}/v1/ai-sdk/chat`;
const AUTH = { Authorization: `Bearer ${TOKEN}` };

if (!HTTP || !WS || !TOKEN || !SLOW) {
  throw new Error('run by tests/test_ai_sdk.py: GATEWAY_HTTP, GATEWAY_WS, GATEWAY_TOKEN, SLOW_ANSWER');
}

/** The framework-free Chat: AbstractChat over a plain state, as @ai-sdk/react's does over React's. */
class Chat extends AbstractChat {
  constructor({ messages = [], ...init }) {
    const state = {
      status: 'ready',
      error: undefined,
      messages,
      pushMessage(message) { this.messages = [...this.messages, message]; },
      popMessage() { this.messages = this.messages.slice(0, -1); },
      replaceMessage(index, message) {
        this.messages = [...this.messages.slice(0, index), this.snapshot(message),
          ...this.messages.slice(index + 1)];
      },
      snapshot: (thing) => structuredClone(thing),
    };
    super({ ...init, state });
  }
}

const transport = () => new DefaultChatTransport({ api: API, headers: AUTH });
const chatId = () => `aisdk-${randomUUID().slice(0, 12)}`;
const textOf = (message) =>
  (message?.parts ?? []).filter((p) => p.type === 'text').map((p) => p.text).join('');
const assistants = (chat) => chat.messages.filter((m) => m.role === 'assistant');
const lastAnswer = (chat) => textOf(assistants(chat).at(-1));

async function until(check, what, ms = 15000) {
  const deadline = Date.now() + ms;
  while (!check()) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((resolve) => setTimeout(resolve, 10));
  }
}

async function getJson(path) {
  const response = await fetch(`${API}/${path}`, { headers: AUTH });
  assert.equal(response.status, 200, await response.clone().text());
  return response.json();
}

/** A second device on the WebSocket protocol: every frame of the chat, until a turn_end. */
function socketDevice(id) {
  const ws = new WebSocket(`${WS}?token=${TOKEN}`);
  const frames = [];
  let done = false;
  let subscribed;
  const ready = new Promise((resolve) => { subscribed = resolve; });
  const ended = new Promise((resolve, reject) => {
    ws.on('message', (raw) => {
      const frame = JSON.parse(raw.toString());
      if (frame.type === 'hello') ws.send(JSON.stringify({ type: 'subscribe', chat_id: id }));
      if (frame.type === 'subscribed') subscribed();
      if (frame.chat_id !== id || frame.type === 'conversation' || done) return;
      frames.push(frame);
      if (frame.type === 'turn_end') {
        done = true;
        resolve(frames);
      }
    });
    ws.on('error', reject);
  });
  return { ready, ended, close: () => ws.close() };
}

test('send and stream: the answer, its parts, and a WebSocket device sees the same turn',
  async () => {
    const id = chatId();
    const device = socketDevice(id);
    await device.ready;
    const data = [];
    let finished;
    const chat = new Chat({ id, transport: transport(), onData: (part) => data.push(part.type),
      onFinish: (result) => { finished = result; } });
    await chat.sendMessage({ text: 'hello gateway' });
    assert.equal(chat.status, 'ready');
    assert.equal(chat.error, undefined);
    assert.deepEqual(chat.messages.map((m) => m.role), ['user', 'assistant']);
    const answer = chat.messages[1];
    assert.match(answer.id, /^t_/);
    assert.equal(textOf(answer), 'Hello world');
    const reasoning = answer.parts.find((p) => p.type === 'reasoning');
    assert.equal(reasoning.text, 'thinking');
    const tool = answer.parts.find((p) => p.type === 'tool-search');
    assert.equal(tool.state, 'output-available');
    assert.deepEqual(tool.input, { q: 'hello gateway' });
    assert.deepEqual(tool.output, { hits: 3 });
    const usage = answer.parts.find((p) => p.type === 'data-usage');
    assert.deepEqual(usage.data, { input_tokens: 5, output_tokens: 7 });
    assert.deepEqual(data.sort(), ['data-goal_state', 'data-title', 'data-usage']);
    assert.equal(finished.finishReason, 'stop');
    assert.equal(finished.isError, false);

    const frames = await device.ended;
    device.close();
    const message = frames.find((f) => f.type === 'user_message');
    assert.equal(message.data.client_msg_id, chat.messages[0].id); // the UI id, the key
    assert.equal(frames.at(-1).data.turn_id, answer.id);
    assert.equal(frames.filter((f) => f.type === 'delta').map((f) => f.data.text).join(''),
      'Hello world');

    // What a reload renders first: the same messages.
    const shown = await getJson(`${id}/messages`);
    assert.deepEqual(shown.map((m) => m.id), chat.messages.map((m) => m.id));
    assert.equal(textOf(shown[1]), 'Hello world');
  });

test('regenerate: a new answer beside the old one', async () => {
  const id = chatId();
  const chat = new Chat({ id, transport: transport() });
  await chat.sendMessage({ text: 'hi' });
  const first = chat.messages[1].id;
  await chat.regenerate();
  assert.equal(chat.status, 'ready');
  assert.equal(chat.messages.length, 2);
  assert.notEqual(chat.messages[1].id, first);
  assert.equal(lastAnswer(chat), 'Hello world');
  const tree = await (await fetch(`${HTTP}/v1/conversations/${id}/tree`, { headers: AUTH }))
    .json();
  assert.deepEqual(tree.nodes.filter((n) => n.kind === 'turn').map((n) => n.id),
    [first, chat.messages[1].id]);
});

test('stop: the stop route ends the answer, which stays as it was', async () => {
  const id = chatId();
  const chat = new Chat({ id, transport: transport() });
  const sent = chat.sendMessage({ text: 'wait' });
  await until(() => lastAnswer(chat).startsWith('waiting.'), 'the answer to start');
  const stopped = await fetch(`${API}/${id}/stop`, { method: 'POST', headers: AUTH });
  assert.equal(stopped.status, 200);
  await sent;
  assert.equal(chat.status, 'ready');
  assert.equal(chat.error, undefined);
  const text = lastAnswer(chat);
  assert.match(text, /^waiting\.+$/);
  const shown = await getJson(`${id}/messages`);
  assert.equal(textOf(shown.at(-1)), text); // kept as the partial answer, whole
  // Nothing runs now: a resume finds nothing.
  const resumed = await fetch(`${API}/${id}/stream`, { headers: AUTH });
  assert.equal(resumed.status, 204);
});

test('a reload mid-answer resumes it: the exact answer, each character once', async () => {
  const id = chatId();
  const before = new Chat({ id, transport: transport() });
  const sent = before.sendMessage({ text: 'slow' });
  await until(() => lastAnswer(before).length >= 10, 'some of the answer');
  // The page goes away: its request is aborted (the turn goes on on the server).
  await before.stop();
  await sent;
  const seen = lastAnswer(before);
  assert.ok(seen.length >= 10 && seen.length < SLOW.length, seen);

  // The reloaded page: its first render from /messages, then useChat's `resume: true`.
  const initial = await getJson(`${id}/messages`);
  assert.deepEqual(initial.map((m) => m.role), ['user', 'assistant']);
  const after = new Chat({ id, messages: initial, transport: transport() });
  const device = new Chat({ id, transport: transport() }); // another device, empty
  await Promise.all([after.resumeStream(), device.resumeStream()]);
  for (const chat of [after, device]) {
    assert.equal(chat.status, 'ready');
    assert.equal(assistants(chat).length, 1);
    assert.equal(lastAnswer(chat), SLOW);
    const parts = assistants(chat)[0].parts.filter((p) => p.type === 'text');
    assert.equal(parts.length, 1);
    assert.equal(parts[0].state, 'done');
  }
  assert.equal(after.messages.length, 2);
  assert.equal(assistants(after)[0].id, initial[1].id);

  // Reloaded again once it is over: nothing to resume, the history stays.
  const later = new Chat({ id, messages: await getJson(`${id}/messages`), transport: transport() });
  await later.resumeStream();
  assert.equal(later.status, 'ready');
  assert.equal(lastAnswer(later), SLOW);
});

test('a message the gateway refuses is the chat\'s error', async () => {
  const id = chatId();
  const chat = new Chat({ id, transport: transport() });
  const running = chat.sendMessage({ text: 'wait' });
  await until(() => lastAnswer(chat).startsWith('waiting'), 'the answer to start');
  const other = new Chat({ id, transport: transport() }); // a second tab, same chat
  await other.sendMessage({ text: 'hi' });
  assert.equal(other.status, 'error');
  assert.match(other.error.message, /turn_in_progress/);
  await fetch(`${API}/${id}/stop`, { method: 'POST', headers: AUTH });
  await running;
});
