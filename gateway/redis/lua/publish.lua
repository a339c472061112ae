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
-- ARGV[11] the tree operation this batch is ("" none, or message, retry, edit, undo, switch)
-- ARGV[12] the head the operation expects ("" any, "^" none, else a node id)
-- ARGV[13] "1": cancel a running turn first (else the operation is refused while one runs)
-- ARGV[14] the operation's node: the message an edit replaces, the node a switch goes to
-- ARGV[15] who asks (the head event's "by")   ARGV[16] the msg_id of this batch's message
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
-- conversation-level types title, goal_state, head and child) and its frame carries "node".
--
-- Replies {"epoch", "seqs" (one per event, null for ephemeral), "last_seq", "owner",
-- "duplicate", "ts", "listed" (the conversation-list entry changed), "turn_id" (the turn
-- this batch started or cancelled), "created", "head" (the head after), "cancelled" (the
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

local meta, log = KEYS[1], KEYS[2]
local channel, chat = ARGV[1], ARGV[6]
local maxlen = tonumber(ARGV[2])
local n = tonumber(ARGV[7])
local max_text = tonumber(ARGV[10])
local base = 17  -- ARGV index of the first event
local op, expected, cancel, target, by, msg_id =
  ARGV[11], ARGV[12], ARGV[13] == '1', ARGV[14], ARGV[15], ARGV[16]
local tree, starts = KEYS[3], KEYS[4]

local text_key, commit_type, streamed_type = {}, {}, {}
local k = 0
for typ in string.gmatch(ARGV[9], '[^,]+') do
  k = k + 1
  text_key[typ] = KEYS[4 + k]
  local commit = typ == 'delta' and 'message' or string.sub(typ, 1, -7)
  commit_type[typ], streamed_type[commit] = commit, typ
end
local children = KEYS[5 + k]
local idem = KEYS[6 + k]

local now = now_ms()
local now_text = tostring(now)  -- once: a number's text costs more than the rest of a frame

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
local CONVERSATION_LEVEL = {title = true, goal_state = true, head = true, child = true}
local TURN_LEVEL = {user_message = true, turn_start = true, turn_end = true,
                    cancel_requested = true}

-- The hot path: one plain durable event (a note, a tool call, a status) in a conversation
-- that exists, with no tree operation, and a new idempotency key if any (the worker SDK
-- sends one with each). It has the effects and the reply the general path below would
-- have, reading only the five fields it needs; a key seen before is the general path's.
if n == 1 and op == '' and ARGV[base + 1] == '1' then
  local typ = ARGV[base]
  if not (CONVERSATION_LEVEL[typ] or TURN_LEVEL[typ] or text_key[typ] or streamed_type[typ])
      and not (idem and redis.call('EXISTS', idem) == 1) then
    local f = redis.call('HMGET', meta, 'epoch', 'owner', 'seq', 'turn_id', 'head')
    local epoch, owner, head = f[1], f[2], f[5] or ''
    if epoch and (ARGV[8] == '' or ARGV[8] == owner) then
      local at = tonumber(f[3]) + 1
      local seq = tostring(at)
      append(typ, f[4] or '', seq, ARGV[base + 2], epoch)
      trim(at, head)
      redis.call('HSET', meta, 'seq', seq, 'updated_at', now_text)
      -- written out: cjson.encode of the reply's table costs as much as the append
      local reply = '{"epoch":' .. cjson.encode(epoch) .. ',"seqs":[' .. seq ..
        '],"last_seq":' .. seq .. ',"owner":' .. cjson.encode(owner) ..
        ',"duplicate":false,"ts":' .. now_text .. ',"head":' .. cjson.encode(head) .. '}'
      if idem then redis.call('SET', idem, reply, 'EX', ARGV[3]) end
      return reply
    end
  end
end

-- The hot path of an answer being written: one delta that goes on with its type's open
-- stream (the running turn's, the same attempt, with room left). Opening a stream,
-- discarding another attempt's and refusing one for size are the general path's.
if n == 1 and op == '' and ARGV[base + 1] == '0' and text_key[ARGV[base]] then
  local typ, data = ARGV[base], ARGV[base + 2]
  local f = redis.call('HMGET', meta, 'epoch', 'owner', 'seq', 'status', 'turn_id', 'head',
                       'st:' .. typ, 'full:' .. typ)
  local epoch, owner = f[1], f[2]
  local s = parse_stream(f[7])
  if epoch and (ARGV[8] == '' or ARGV[8] == owner) and f[4] == 'running' and not f[8]
      and s and s.turn == f[5] and s.attempt == ARGV[base + 3] then
    local text = delta_text(data)
    if redis.call('STRLEN', text_key[typ]) + #text <= max_text then
      redis.call('APPEND', text_key[typ], text)
      publish_piece(typ, s.id, s.pos, data)
      s.pos = s.pos + 1
      redis.call('HSET', meta, 'st:' .. typ, stream_header(s))
      return '{"epoch":' .. cjson.encode(epoch) .. ',"seqs":[null],"last_seq":' .. f[3] ..
        ',"owner":' .. cjson.encode(owner) .. ',"duplicate":false,"ts":' .. now_text ..
        ',"head":' .. cjson.encode(f[6] or '') .. '}'
    end
  end
end

local m_owner = nil
local late_feed = nil  -- a refused late turn_end's usage was counted: the feed tells it
local function refuse(code, message, head)
  local reply = {error = {code = code, message = message, head = head}}
  if late_feed then reply.owner, reply.feed = m_owner, late_feed end
  return cjson.encode(reply)
end

-- The batch's events: {type, durable, data, arg}; a cancel puts a turn_end in front.
local events = {}
for i = 0, n - 1 do
  local at = base + i * 4
  events[#events + 1] = {ARGV[at], ARGV[at + 1] == '1', ARGV[at + 2], ARGV[at + 3]}
end

local function event(i)
  local e = events[i + 1]
  return e[1], e[2], e[3], e[4]
end

-- A commit's argument: "<attempt>" or "<attempt> fill".
local function commit_arg(arg)
  local attempt, fill = string.match(arg, '^(%S*) ?(%S*)$')
  return attempt or '', fill == 'fill'
end

local m = load_meta(meta)
local created = false
if not m then
  if ARGV[4] == '' then return refuse('not_found', 'conversation does not exist') end
  m = new_meta(ARGV[4], ARGV[5], now)
  created = true
end
if ARGV[8] ~= '' and ARGV[8] ~= m.owner then
  return refuse('forbidden', 'conversation belongs to another user')
end

local function close_stream(typ)
  redis.call('DEL', text_key[typ])
  redis.call('HDEL', meta, 'st:' .. typ, 'full:' .. typ)
  m['st:' .. typ], m['full:' .. typ] = nil, nil
end

local function discard(typ, s)
  local frame = '{"type":"stream_discarded","chat_id":' .. cjson.encode(chat) ..
    ',"seq":null,"ts":' .. now .. ',"data":{"stream_id":' .. cjson.encode(s.id) ..
    ',"type":' .. cjson.encode(typ) .. ',"turn_id":' .. cjson.encode(s.turn) .. '}}'
  redis.call('SPUBLISH', channel, envelope(nil, nil, nil, nil, frame))
  close_stream(typ)
end

if idem then
  local prior = redis.call('GET', idem)
  if prior then
    local r = cjson.decode(prior)
    if r[1] == 'ok' then  -- stored by a gateway before replies were objects
      r = {epoch = r[2], last_seq = tonumber(r[4]), owner = r[5], ts = tonumber(r[7]),
           turn_id = r[9], created = false, listed = false}
    end
    r.duplicate, r.created, r.listed = true, false, false
    -- A commit replayed by a redelivered run: the answer is in history already, so the
    -- stream this run opened since is dropped on every device (never a second message).
    for i = 0, n - 1 do
      local typ, durable, _, arg = event(i)
      local streamed = durable and streamed_type[typ]
      local s = streamed and open_stream(m, streamed)
      if s and s.turn == m.turn_id and s.attempt == commit_arg(arg) then
        discard(streamed, s)
      end
    end
    return cjson.encode(r)
  end
end

-- The usage a turn_end's data reports (a table, maybe empty). The gateway validated it.
local function usage_of(data)
  return data_field(data, 'usage', 'table') or {}
end

-- A turn_end that comes after its turn ended (cancelled by a tree operation, or timed out)
-- is refused, but what the turn cost was paid for: count it, once per turn.
local function count_late_usage(turn_id, data)
  local node = turn_id ~= '' and node_get(tree, turn_id)
  local usage = usage_of(data)
  if not node or node.k ~= 'turn' or node.u or next(usage) == nil then return false end
  node.u = usage
  node_put(tree, turn_id, node)
  m.usage_billed = cjson.encode(usage_add(usage_decode(m.usage_billed), usage))
  local _, on_path = path_to(tree, m.head or '')
  local fields = {'usage_billed', m.usage_billed}
  if on_path[turn_id] then
    m.usage_active = cjson.encode(usage_add(usage_decode(m.usage_active), usage))
    fields[3], fields[4] = 'usage_active', m.usage_active
  end
  redis.call('HSET', meta, unpack(fields))
  m_owner, late_feed = m.owner, announce(chat, m, now, false)
  return true
end

-- The tree operation's preconditions, against the state before the batch.
local head_before = m.head or ''
local new_head, cause = nil, op
local answered = nil  -- the user message a new turn answers (retry), or that undo takes back
local parent_of_message = head_before  -- where this batch's user_message goes
local edit_of = nil
local cancelled = nil
local function shown(id) return id == '' and 'none' or id end
-- A user message as the reply gives it back: its frame as stored (not decoded here: a
-- Lua table cannot tell an empty array from an empty object).
local function read_message(id, node)
  local entry = redis.call('XRANGE', log, node.s .. '-0', node.s .. '-0')[1]
  return {msg_id = id, seq = node.s, frame = entry and entry[2][2] or '{}'}
end
if op ~= '' then
  if expected ~= '' and (expected == '^' and '' or expected) ~= head_before then
    return refuse('conflict', 'the head is ' .. shown(head_before) .. ', not ' ..
                  shown(expected == '^' and '' or expected), head_before)
  end
  if m.status == 'running' then
    if not cancel then
      return refuse('turn_in_progress', 'turn ' .. m.turn_id .. ' is still running; send ' ..
                    'cancel: true to stop it first', head_before)
    end
    cancelled = m.turn_id
    table.insert(events, 1, {'turn_end', true, '{"reason":"cancelled"}', ''})
    n = n + 1
  end
  if op == 'retry' then
    local node = head_before ~= '' and node_get(tree, head_before)
    if not node or node.k ~= 'turn' or node.p == '' then
      return refuse('nothing_to_retry', 'the head is not an answer to retry', head_before)
    end
    answered = read_message(node.p, node_get(tree, node.p))
  elseif op == 'edit' then
    local node = node_get(tree, target)
    if not node or node.k ~= 'user' then
      return refuse('not_found', 'no user message ' .. target .. ' in this conversation', head_before)
    end
    local _, on_path = path_to(tree, head_before)
    if not on_path[target] then
      return refuse('not_on_path', 'message ' .. target .. ' is not on the active path', head_before)
    end
    parent_of_message, edit_of = node.p, target
  elseif op == 'undo' then
    local id, node = last_user(tree, head_before)
    if not id then return refuse('nothing_to_undo', 'no message to undo', head_before) end
    answered = read_message(id, node)
    new_head = node.p
  elseif op == 'switch' then
    if target == ROOT or not node_get(tree, target) then
      return refuse('not_found', 'no node ' .. target .. ' in this conversation', head_before)
    end
    new_head = last_leaf(tree, target)
  end
end

-- First pass: check every precondition against the state the batch would create,
-- so a refused batch writes nothing (but the mark of a stream refused for size).
local status, turn = m.status, m.turn_id
local streamed_bytes = {}
local started = nil  -- type -> bytes the open stream would hold
for i = 0, n - 1 do
  local typ, durable, data, arg = event(i)
  if typ == 'turn_start' then
    if status == 'running' then
      return refuse('turn_in_progress', 'turn ' .. turn .. ' is still running')
    end
    status, turn = 'running', arg
    started = arg
  elseif typ == 'turn_end' or typ == 'cancel_requested' then
    local over = status ~= 'running' or (arg ~= '' and arg ~= turn)
    local counted = over and typ == 'turn_end' and n == 1 and count_late_usage(arg, data)
    local note = counted and '; its usage was counted' or ''
    if status ~= 'running' then return refuse('no_active_turn', 'no turn is running' .. note) end
    if arg ~= '' and arg ~= turn then
      return refuse('turn_mismatch', 'turn ' .. arg .. ' is not the running turn ' .. turn ..
                    note)
    end
    if typ == 'turn_end' then
      status, turn = 'idle', ''
      streamed_bytes = {}
    end
  elseif text_key[typ] and not durable and status == 'running' then
    local size = streamed_bytes[typ]
    local run = turn .. ' ' .. arg
    if size == nil then
      local s = open_stream(m, typ)
      size = (s and s.turn == turn and s.attempt == arg) and redis.call('STRLEN', text_key[typ]) or 0
      if m['full:' .. typ] == run then size = math.huge end
    end
    size = size + #delta_text(data)
    if size > max_text then
      redis.call('HSET', meta, 'full:' .. typ, run)
      return refuse('stream_too_large', 'the ' .. typ .. ' stream would pass ' .. max_text ..
                    ' bytes; it takes no more deltas until it is committed')
    end
    streamed_bytes[typ] = size
  elseif streamed_type[typ] and durable then
    streamed_bytes[streamed_type[typ]] = 0  -- committed: a later delta opens a new stream
  end
end

local seq = tonumber(m.seq)
local seqs = {}
local listed = created
local changed = created  -- fields other than seq, updated_at and streams changed
local touched = {}  -- stream headers to write back
local opened = 0
local started_or_cancelled = nil
local message_node = nil  -- the user_message this batch added

-- The node a durable event belongs to ("" for the conversation itself).
local function node_of(typ, arg)
  if CONVERSATION_LEVEL[typ] then return '' end
  if typ == 'user_message' then return msg_id end
  if typ == 'turn_start' then return arg end
  return m.turn_id or ''
end

local function emit(typ, durable, data, stream_part, node)
  if durable then
    seq = seq + 1
    append(typ, node or '', seq, data, m.epoch)
    return seq
  end
  if stream_part then
    publish_piece(typ, stream_part[1], stream_part[2], data)
  else
    local frame = '{"type":' .. cjson.encode(typ) .. ',"chat_id":' .. cjson.encode(chat) ..
      ',"seq":null,"ts":' .. now_text .. ',"data":' .. data .. '}'
    redis.call('SPUBLISH', channel, envelope(nil, nil, nil, nil, frame))
  end
  return cjson.null
end

-- {"a":1} + '"b":2' -> {"b":2,"a":1}
local function splice(data, fields)
  if data == '{}' then return '{' .. fields .. '}' end
  return '{' .. fields .. ',' .. string.sub(data, 2)
end

local function id_or_null(id)
  return (id and id ~= '') and cjson.encode(id) or 'null'
end

for i = 0, n - 1 do
  local typ, durable, data, arg = event(i)
  local stream_part = nil
  local node = durable and node_of(typ, arg) or nil
  if typ == 'user_message' then
    m.preview = arg
    local fields = '"msg_id":' .. cjson.encode(msg_id) .. ',"parent_id":' .. id_or_null(parent_of_message)
    if edit_of then fields = fields .. ',"edit_of":' .. cjson.encode(edit_of) end
    data = splice(data, fields)
    message_node = msg_id
    changed = true
  elseif typ == 'turn_start' then
    local parent = answered and op == 'retry' and answered.msg_id or message_node or ''
    m.status, m.turn_id, m.started_at = 'running', arg, tostring(now)
    data = '{"turn_id":' .. cjson.encode(arg) .. ',"started_at":' .. now .. ',"parent_id":' ..
           id_or_null(parent) .. (op == 'retry' and (',"retry_of":' .. cjson.encode(head_before)) or '') .. '}'
    started_or_cancelled = arg
    listed, changed = true, true
  elseif typ == 'turn_end' then
    -- What users saw stays in history: every stream still open becomes a durable partial.
    for streamed, key in pairs(text_key) do
      local s = open_stream(m, streamed)
      if s then
        local text = redis.call('GET', key) or ''
        emit(commit_type[streamed], true, '{"text":' .. cjson.encode(text) ..
             ',"stream_id":' .. cjson.encode(s.id) .. ',"partial":true}', nil, m.turn_id)
        close_stream(streamed)
      end
      if m['full:' .. streamed] then close_stream(streamed) end
    end
    local usage = usage_of(data)
    if next(usage) ~= nil then
      local node = node_get(tree, m.turn_id)
      if node then
        node.u = usage
        node_put(tree, m.turn_id, node)
      end
      m.usage_billed = cjson.encode(usage_add(usage_decode(m.usage_billed), usage))
      -- The running turn is the head (a tree operation ends it before moving the head).
      if m.turn_id == (m.head or '') then
        m.usage_active = cjson.encode(usage_add(usage_decode(m.usage_active), usage))
      end
    end
    local latency = now - tonumber(m.started_at)
    local goal = m.goal ~= '' and m.goal or 'null'
    data = '{"turn_id":' .. cjson.encode(m.turn_id) .. ',"latency_ms":' .. latency ..
           ',"goal_state":' .. goal .. ',' .. string.sub(data, 2)
    m.status, m.turn_id, m.started_at = 'idle', '', ''
    listed, changed = true, true
  elseif typ == 'cancel_requested' then
    data = '{"turn_id":' .. cjson.encode(m.turn_id) .. '}'
    started_or_cancelled = m.turn_id
  elseif typ == 'goal_state' then
    m.goal = data
    listed, changed = true, true
  elseif typ == 'title' then
    local previous = m.title ~= '' and cjson.encode(m.title) or 'null'
    data = '{"title":' .. cjson.encode(data) .. ',"previous":' .. previous ..
           ',"source":' .. cjson.encode(arg) .. '}'
    m.title = ARGV[base + 2 + i * 4]
    listed, changed = true, true
  elseif typ == 'child' then
    redis.call('ZADD', children, now, arg)
  elseif text_key[typ] and not durable and m.status == 'running' then
    local s = open_stream(m, typ)
    if s and (s.turn ~= m.turn_id or s.attempt ~= arg) then
      -- A redelivered turn streams anew: every device drops the old attempt's partial first.
      discard(typ, s)
      s = nil
    end
    if not s then
      opened = opened + 1
      s = {id = 's' .. ARGV[5] .. '.' .. opened, turn = m.turn_id, pos = 0, attempt = arg}
    end
    redis.call('APPEND', text_key[typ], delta_text(data))
    stream_part = {s.id, s.pos}
    s.pos = s.pos + 1
    m['st:' .. typ] = stream_header(s)
    touched['st:' .. typ] = m['st:' .. typ]
  elseif streamed_type[typ] and durable then
    local streamed = streamed_type[typ]
    local s = open_stream(m, streamed)
    if s then
      local fields = '"stream_id":' .. cjson.encode(s.id)
      local _, fill = commit_arg(arg)
      if fill then
        fields = fields .. ',"text":' .. cjson.encode(redis.call('GET', text_key[streamed]) or '')
      end
      data = splice(data, fields)
    end
    if s or m['full:' .. streamed] then
      close_stream(streamed)
      touched['st:' .. streamed] = nil
    end
  end
  local at = emit(typ, durable, data, stream_part, node)
  if i >= (cancelled and 1 or 0) then seqs[#seqs + 1] = at end  -- not the cancel's turn_end
  if typ == 'user_message' then
    node_add(tree, msg_id, 'user', parent_of_message, at, arg)
    redis.call('ZADD', starts, at, at)
  elseif typ == 'turn_start' then
    node_add(tree, arg, 'turn', answered and op == 'retry' and answered.msg_id or message_node or '', at, '')
  end
end

-- The head moves last, as one durable event: to the turn the batch started, or where an
-- undo or a switch goes.
if started and (op == '' or op == 'message' or op == 'retry' or op == 'edit') then
  new_head = started
  if op == '' then cause = 'message' end
end
if new_head ~= nil and new_head ~= head_before then
  mark_active(tree, new_head)
  m.head = new_head
  m.msgs = tostring(depth(tree, new_head))
  -- A message grows the path by itself and a turn with no usage yet: the total stands.
  if op ~= 'message' then m.usage_active = cjson.encode(path_usage(tree, new_head)) end
  if op == 'undo' or op == 'switch' then
    local _, last = last_user(tree, new_head)
    m.preview = last and last.v or ''
  end
  emit('head', true, '{"head_id":' .. id_or_null(new_head) .. ',"prev_head_id":' ..
       id_or_null(head_before) .. ',"cause":' .. cjson.encode(cause) .. ',"by":' ..
       cjson.encode(by) .. '}', nil, '')
  listed, changed = true, true
end

if seq ~= tonumber(m.seq) then trim(seq, m.head) end

-- Ephemeral-only batches (plain deltas: the hot path) leave the state untouched.
if seq ~= tonumber(m.seq) or changed then
  m.seq = tostring(seq)
  m.updated_at = tostring(now)
  if changed then
    save_meta(meta, m)
  else  -- a plain event: write only what moved
    redis.call('HSET', meta, 'seq', m.seq, 'updated_at', m.updated_at)
  end
end
if not changed then  -- save_meta wrote them otherwise
  for field, value in pairs(touched) do redis.call('HSET', meta, field, value) end
end

local result = {epoch = m.epoch, last_seq = seq, owner = m.owner, duplicate = false, ts = now,
                listed = listed, turn_id = started_or_cancelled, created = created,
                head = m.head or '', cancelled = cancelled, message = answered,
                msg_id = message_node}
if #seqs > 0 then result.seqs = seqs end
if idem then
  redis.call('SET', idem, cjson.encode(result), 'EX', tonumber(ARGV[3]))
end
if listed then result.feed = announce(chat, m, now, created) end
return cjson.encode(result)
