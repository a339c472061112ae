// A minimal page on @ai-sdk/react's useChat, pointed at the gateway as the README shows.
//
// Not one of the `npm test` files: tests/test_browser_ai_sdk.py bundles it with esbuild
// (React, @ai-sdk/react and ai from node_modules here) and opens it in Chromium as
//   page.html?gateway=<http base>&token=<token>&chat=<chat id>&agent=<agent name>
// Its first render is the chat's active path (GET .../messages), then `resume: true` picks up
// an answer still running. The test reads the data-testid and data-* attributes.

import { useChat } from '@ai-sdk/react';
import { DefaultChatTransport } from 'ai';
import { useState } from 'react';
import { createRoot } from 'react-dom/client';

const params = new URLSearchParams(location.search);
const GATEWAY = params.get('gateway');
const TOKEN = params.get('token');
const CHAT = params.get('chat');
const AGENT = params.get('agent');
const API = `${GATEWAY}/v1/ai-sdk/chat`;
const auth = () => ({ Authorization: `Bearer ${TOKEN}` });

const textOf = (message) => message.parts.filter((part) => part.type === 'text');

function Chat({ initial }) {
  const [input, setInput] = useState('');
  const { messages, sendMessage, status, error } = useChat({
    id: CHAT,
    messages: initial,
    resume: true,
    transport: new DefaultChatTransport({ api: API, headers: auth, body: { agent: AGENT } }),
  });
  const send = (event) => {
    event.preventDefault();
    sendMessage({ text: input });
    setInput('');
  };
  return (
    <main data-testid="app" data-ready="true" data-status={status}>
      <ol data-testid="messages">
        {messages.map((message) => (
          <li key={message.id} data-testid="message" data-role={message.role}
            data-id={message.id} data-text-parts={textOf(message).length}>
            {textOf(message).map((part, i) => <span key={i}>{part.text}</span>)}
          </li>
        ))}
      </ol>
      {error ? <p data-testid="error">{error.message}</p> : null}
      <form onSubmit={send}>
        <input data-testid="input" aria-label="Message" value={input}
          onChange={(event) => setInput(event.target.value)} />
        <button type="submit" data-testid="send">Send</button>
      </form>
    </main>
  );
}

async function main() {
  const root = createRoot(document.getElementById('root'));
  const reply = await fetch(`${API}/${CHAT}/messages`, { headers: auth() });
  if (!reply.ok) {
    root.render(<p data-testid="load-error">{reply.status} {await reply.text()}</p>);
    return;
  }
  root.render(<Chat initial={await reply.json()} />);
}

main();
