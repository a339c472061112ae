-- Append a batch of events to one conversation, atomically, in one round trip.
-- gateway/redis/scripts.py (PublishScript) builds these arguments and decodes the reply.
--
-- KEYS[1] meta hash, KEYS[2] event log (a Redis Stream), KEYS[3] the tree (tree.lua)
-- KEYS[4] the turn starts: the seq of every user message still in the log
-- KEYS[5 .. 4+k] the text key of each streamed type, in ARGV[9]'s order
-- KEYS[5+k] the sub-conversations (a sorted set: chat id -> created ms)
-- KEYS[6+k] idempotency key (optional)
-- ARGV[1] room channel (a sharded channel in the conversation's slot)
-- ARGV[2] log max length (trimmed at turn boundaries)
-- ARGV[3] idempotency ttl (s)
-- ARGV[4] owner to create the conversation for when it does not exist ("" = must exist)
-- ARGV[5] a fresh unique name: the epoch of a newly created conversation, and the prefix of
--         the id of a stream this batch opens
-- ARGV[6] chat id             ARGV[7] number of events
-- ARGV[8] writer: the user who must own the conversation ("" = anyone, e.g. a service)
-- ARGV[9] streamed types, comma-separated (k of them)
-- ARGV[10] most bytes of text one stream may hold
-- ARGV[11] the tree operation this batch is ("" none, or message, retry, edit, undo,
--          switch, answer)
-- ARGV[12] the head the operation expects ("" any, "^" none, else a node id)
-- ARGV[13] "1": cancel a running turn first (else the operation is refused while one runs)
-- ARGV[14] the operation's node: the message an edit replaces, the node a switch goes to,
--          the tool call an answer answers
-- ARGV[15] who asks (the head event's "by")   ARGV[16] the msg_id of this batch's message
-- ARGV[17] the turn the publisher writes for ("" = whichever runs): the batch is refused
--          (no_active_turn, turn_mismatch) unless that turn is the running one, so a turn
--          that ended never writes into the next
-- ARGV[18] the agent that answers the conversation, when this batch creates it
-- then 4 per event: type, durable ("1"/"0"), data (JSON, or raw text for title), and one
-- argument whose meaning depends on the type (OutEvent.script_arg):
--   user_message  the preview (<= 120 chars), remembered for the conversation list
--   turn_start    the new turn's id; needs an idle conversation
--   turn_end      the turn it ends, or "" for the running one; data {"reason":..} gets
--                 turn_id, latency_ms and the goal_state snapshot spliced in; every stream
--                 still open is committed first, as a durable partial event; its
--                 data's usage is kept on the turn's node and added to the totals
--                 (meta usage_billed; usage_active when the turn is on the active path).
--                 Alone in a batch, a turn_end for a turn already over is refused, but
--                 its usage is counted (once per turn) and the refusal carries the feed.
--   cancel_requested  the turn it cancels, or "" for the running one; needs a running turn
--   goal_state    (none) data is stored as the conversation's goal snapshot
--   state         the snapshot (JSON), stored as the conversation's agent state (meta state)
--   client_tools  the tools (JSON), stored as the conversation's client tools (meta tools)
--   tool_call     "?<call id> <name>" when the agent asks a person (a client tool, awaiting
--                 an answer: meta awaiting), else the run's attempt
--   tool_result   with the operation answer: the list's preview; the result is a node of
--                 the person's side, like a user message, and a new turn follows it
--   title         the title's source; data is the new title (raw text)
--   child         the sub-conversation's chat id, added to KEYS[5+k]; data {chat_id, title}
--   a streamed type (ephemeral, while a turn runs)  the run's attempt: the delta joins its
--                 type's open stream ("stream":{"id","pos"}), or opens one; an open stream
--                 of another attempt is discarded first
--   its commit type (durable `message` for `delta`, `X` for `X_delta`)  "<attempt>" or
--                 "<attempt> fill": closes the open stream (data gets "stream_id", and
--                 "text" with fill). Replayed with the same idempotency key, it discards the
--                 stream its attempt opened since: the first commit holds the answer.
--
-- A stream that refused a delta for size refuses every later delta of its run (meta field
-- "full:<type>" = "<turn id> <attempt>", until a commit or the turn's end): its text stays a
-- prefix of what the agent sent, never a text with a hole in the middle.
--
-- A tree operation (tree.lua has the tree): `message` adds a user_message under the head
-- and its turn under it; `retry` a new turn answering the head turn's message; `edit` a
-- new user message beside the one it replaces, and its turn; `undo` moves the head to the
-- parent of the path's last user message; `switch` to the leaf last active under a node.
-- The head moves to the new turn (or there), as one durable `head` event after the rest;
-- meta msgs (the active path's node count) and usage_active follow it.
-- With a turn running and ARGV[13] = "1", that turn ends first (reason cancelled, its open
-- streams committed as partials on its branch).
--
-- Every durable event of a node is stored with its node id (log field "n"; "" for the
-- conversation-level types title, goal_state, state, head and child) and its frame
-- carries "node".
--
-- Replies {"epoch", "seqs" (one per event, null for ephemeral), "last_seq", "owner",
-- "duplicate", "ts", "listed" (the conversation-list entry changed), "turn_id" (the turn
-- this batch started or cancelled), "filed" (the turn its other durable events belong to),
-- "agent" (the agent that answers the conversation), "created", "head" (the head after), "cancelled" (the
-- turn a cancel: true ended), "message" (retry and undo: {msg_id, seq, frame} of the
-- message answered again or taken back), "msg_id" (the user
-- message this batch added), "feed" (the feed
-- frame to announce, when listed)} or {"error": {"code", "message", "head"}, and "owner"
-- and "feed" when a refused late turn_end's usage was counted}. The feed lives in the owner's slot: the store
-- publishes it after the script. Every durable event is stored as entry "<seq>-0".
--
-- Two short paths come first, with the same effects and reply for less Lua: one plain
-- durable event (not a type named above, not streamed) with no operation, and an
-- idempotency key not seen yet if any; and one delta that goes on with its open stream.
-- This file ends after them. Every other batch goes on in publish_batch.lua, which the
-- store loads after meta.lua and tree.lua: Lua defines a script's functions on each call,
-- and the short paths need none of theirs.

local meta, log = KEYS[1], KEYS[2]
local channel, chat = ARGV[1], ARGV[6]
local maxlen = tonumber(ARGV[2])
local n = tonumber(ARGV[7])
local max_text = tonumber(ARGV[10])
local base = 19  -- ARGV index of the first event
local named = ARGV[17]
local op, expected, cancel, target, by, msg_id =
  ARGV[11], ARGV[12], ARGV[13] == '1', ARGV[14], ARGV[15], ARGV[16]
local tree, starts = KEYS[3], KEYS[4]

-- The durable type that commits a streamed type's text: `message` for `delta`, X for X_delta.
local function commit_of(typ)
  return typ == 'delta' and 'message' or string.sub(typ, 1, -7)
end

-- The streamed types (ARGV[9]) counted, and what the short paths ask of the batch's first
-- type: its text key when it is streamed, whether it commits a streamed type. The general
-- path (publish_batch.lua) maps them all.
local k, first_text_key, first_commits = 0, nil, false
for typ in string.gmatch(ARGV[9], '[^,]+') do
  k = k + 1
  if typ == ARGV[base] then first_text_key = KEYS[4 + k] end
  if commit_of(typ) == ARGV[base] then first_commits = true end
end
local idem = KEYS[6 + k]

local now, now_text = now_ms()

-- A durable event, stored as log entry "<seq>-0" and published: the one writer of both.
local function append(typ, node, at, data, epoch)
  local seq = tostring(at)
  local head = '{"type":' .. cjson.encode(typ) .. ',"chat_id":' .. cjson.encode(chat)
  if node ~= '' then head = head .. ',"node":' .. cjson.encode(node) end
  local frame = head .. ',"seq":' .. seq .. ',"ts":' .. now_text .. ',"data":' .. data .. '}'
  redis.call('XADD', log, seq .. '-0', 'f', frame, 'n', node)
  redis.call('SPUBLISH', channel, envelope(epoch, seq, nil, nil, frame))
end

-- History is trimmed at turn boundaries only: what is kept starts with a user message.
-- The cut is the first user message an exact trim to ARGV[2] events would keep; inside a
-- turn longer than that, the turn's own start (what is kept then passes the bound by at
-- most that turn's events). A log with no user message is cut exactly.
local function trim(seq, head)
  -- Entries are "<seq>-0", trimmed from the front: the log never holds more than seq.
  if seq <= maxlen or redis.call('XLEN', log) <= maxlen then return end
  local exact = seq - maxlen + 1
  if redis.call('EXISTS', starts) == 0 and (head or '') ~= '' then
    -- a tree from before the turn starts were kept: index its user messages once
    local flat = redis.call('HGETALL', tree)
    for i = 1, #flat, 2 do
      local node = cjson.decode(flat[i + 1])
      if node.k == 'user' and node.s then redis.call('ZADD', starts, node.s, node.s) end
    end
  end
  local cut = redis.call('ZRANGEBYSCORE', starts, exact, '+inf', 'LIMIT', 0, 1)[1]
    or redis.call('ZREVRANGEBYSCORE', starts, '(' .. exact, '-inf', 'LIMIT', 0, 1)[1]
    or exact
  redis.call('XTRIM', log, 'MINID', cut .. '-0')
  redis.call('ZREMRANGEBYSCORE', starts, '-inf', '(' .. cut)
end

-- Field ``name`` of an event's JSON data when it is of Lua type ``kind``, else nil.
local function data_field(data, name, kind)
  local ok, decoded = pcall(cjson.decode, data)
  if ok and type(decoded) == 'table' and type(decoded[name]) == kind then
    return decoded[name]
  end
  return nil
end

-- The text a streamed delta carries ("" when it has none).
local function delta_text(data)
  return data_field(data, 'text', 'string') or ''
end

-- A piece of a streamed answer (ephemeral, no seq): its stream's id and its position in it.
local function publish_piece(typ, stream_id, pos, data)
  local frame = '{"type":' .. cjson.encode(typ) .. ',"chat_id":' .. cjson.encode(chat) ..
    ',"seq":null,"ts":' .. now_text .. ',"stream":{"id":' .. cjson.encode(stream_id) ..
    ',"pos":' .. pos .. '},"data":' .. data .. '}'
  redis.call('SPUBLISH', channel, envelope(nil, nil, stream_id, pos, frame))
end

-- The types this script completes: the conversation's own (stored with node "") and the
-- turn's. Every other durable type that is not streamed is plain: its node is the running
-- turn's (node_of).
local CONVERSATION_LEVEL = {title = true, goal_state = true, head = true, child = true,
                            state = true, client_tools = true}
local TURN_LEVEL = {user_message = true, turn_start = true, turn_end = true,
                    cancel_requested = true}

-- The hot path: one plain durable event (a note, a tool call, a status) in a conversation
-- that exists, with no tree operation, and a new idempotency key if any (the worker SDK
-- sends one with each). It has the effects and the reply the general path below would
-- have, reading only the five fields it needs; a key seen before is the general path's.
if n == 1 and op == '' and ARGV[base + 1] == '1' then
  local typ = ARGV[base]
  if not (CONVERSATION_LEVEL[typ] or TURN_LEVEL[typ] or first_text_key or first_commits)
      and not (typ == 'tool_call' and string.sub(ARGV[base + 3], 1, 1) == '?')
      and not (idem and redis.call('EXISTS', idem) == 1) then
    local f = redis.call('HMGET', meta, 'epoch', 'owner', 'seq', 'turn_id', 'head')
    local epoch, owner, head, running = f[1], f[2], f[5] or '', f[4] or ''
    if epoch and (ARGV[8] == '' or ARGV[8] == owner) and (named == '' or named == running) then
      local at = tonumber(f[3]) + 1
      local seq = tostring(at)
      append(typ, running, seq, ARGV[base + 2], epoch)
      trim(at, head)
      redis.call('HSET', meta, 'seq', seq, 'updated_at', now_text)
      -- written out: cjson.encode of the reply's table costs as much as the append
      local reply = '{"epoch":' .. cjson.encode(epoch) .. ',"seqs":[' .. seq ..
        '],"last_seq":' .. seq .. ',"owner":' .. cjson.encode(owner) ..
        ',"duplicate":false,"ts":' .. now_text .. ',"head":' .. cjson.encode(head) ..
        (running ~= '' and (',"filed":' .. cjson.encode(running)) or '') .. '}'
      if idem then redis.call('SET', idem, reply, 'EX', ARGV[3]) end
      return reply
    end
  end
end

-- The hot path of an answer being written: one delta that goes on with its type's open
-- stream (the running turn's, the same attempt, with room left). Opening a stream,
-- discarding another attempt's and refusing one for size are the general path's.
if n == 1 and op == '' and ARGV[base + 1] == '0' and first_text_key then
  local typ, data = ARGV[base], ARGV[base + 2]
  local f = redis.call('HMGET', meta, 'epoch', 'owner', 'seq', 'status', 'turn_id', 'head',
                       'st:' .. typ, 'full:' .. typ)
  local epoch, owner = f[1], f[2]
  local s = parse_stream(f[7])
  if epoch and (ARGV[8] == '' or ARGV[8] == owner) and f[4] == 'running' and not f[8]
      and s and s.turn == f[5] and s.attempt == ARGV[base + 3] and (named == '' or named == f[5]) then
    local text = delta_text(data)
    if redis.call('STRLEN', first_text_key) + #text <= max_text then
      redis.call('APPEND', first_text_key, text)
      publish_piece(typ, s.id, s.pos, data)
      s.pos = s.pos + 1
      redis.call('HSET', meta, 'st:' .. typ, stream_header(s))
      return '{"epoch":' .. cjson.encode(epoch) .. ',"seqs":[null],"last_seq":' .. f[3] ..
        ',"owner":' .. cjson.encode(owner) .. ',"duplicate":false,"ts":' .. now_text ..
        ',"head":' .. cjson.encode(f[6] or '') .. '}'
    end
  end
end

-- Not a short path: publish_batch.lua goes on (after meta.lua and tree.lua).
