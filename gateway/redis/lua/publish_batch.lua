-- publish.lua's general path: any batch its short paths did not take. The store puts
-- meta.lua and tree.lua between the two, so that a short path does without them.

local text_key, commit_type, streamed_type = {}, {}, {}
local place = 0
for typ in string.gmatch(ARGV[9], '[^,]+') do
  place = place + 1
  text_key[typ] = KEYS[4 + place]
  commit_type[typ], streamed_type[commit_of(typ)] = commit_of(typ), typ
end
local children = KEYS[5 + k]

local m_owner, m_meta = nil, nil
local late_feed = nil  -- a refused late turn_end's usage was counted: the feed tells it
local function refuse(code, message, head)
  local reply = {error = {code = code, message = message, head = head}}
  if late_feed then
    reply.owner, reply.feed = m_owner, late_feed
    local _, users = members_of(m_meta)
    if #users > 0 then reply.members = users end
  end
  return cjson.encode(reply)
end

-- The batch's events: {type, durable, data, arg}; a cancel puts a turn_end in front.
local events = {}
for i = 0, n - 1 do
  local at = base + i * 4
  local typ, arg = ARGV[at], ARGV[at + 3]
  -- A publisher that names its turn ends or cancels that one, never whichever runs.
  if (typ == 'turn_end' or typ == 'cancel_requested') and arg == '' then arg = named end
  events[#events + 1] = {typ, ARGV[at + 1] == '1', ARGV[at + 2], arg}
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
  m = new_meta(ARGV[4], ARGV[5], now_text, ARGV[18])
  created = true
end
local why = write_refused(m, ARGV[8])
if why then return refuse('forbidden', why) end

local function close_stream(typ)
  redis.call('DEL', text_key[typ])
  redis.call('HDEL', meta, 'st:' .. typ, 'full:' .. typ)
  m['st:' .. typ], m['full:' .. typ] = nil, nil
end

local function discard(typ, s)
  local frame = '{"type":"stream_discarded","chat_id":' .. cjson.encode(chat) ..
    ',"seq":null,"ts":' .. now_text .. ',"data":{"stream_id":' .. cjson.encode(s.id) ..
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
  m_owner, m_meta, late_feed = m.owner, m, announce(chat, m, now_text, false)
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
  if op == 'answer' then
    -- A person's answer to a client tool the agent asked: the first one wins.
    local awaiting = m.awaiting and m.awaiting ~= '' and cjson.decode(m.awaiting) or {}
    if not awaiting[target] then
      return refuse('conflict', 'tool call ' .. target .. ' is not awaiting an answer ' ..
                    '(answered already, or a later message left it unanswered)', head_before)
    end
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
  if op ~= '' then m.awaiting = '' end  -- any move of the path leaves a question unanswered
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
  elseif typ == 'tool_call' and string.sub(arg, 1, 1) == '?' then
    -- An agent asks a person: the tool must be one of the conversation's client tools.
    local name = string.match(arg, '^%?%S+ (.+)$')
    local known = false
    for _, tool in ipairs(m.tools and m.tools ~= '' and cjson.decode(m.tools) or {}) do
      if tool.name == name then known = true end
    end
    if not known then
      return refuse('invalid_request', 'tool_call: ' .. tostring(name) ..
                    ' is not a client tool of this conversation')
    end
    if named ~= '' and (status ~= 'running' or turn ~= named) then
      return refuse(status ~= 'running' and 'no_active_turn' or 'turn_mismatch',
                    'turn ' .. named .. ' has ended; its tool_call is refused')
    end
  elseif named ~= '' and (status ~= 'running' or turn ~= named) then
    -- Written for a turn that is over: never filed under the one running now.
    if status ~= 'running' then
      return refuse('no_active_turn', 'turn ' .. named .. ' has ended; its ' .. typ ..
                    ' is refused')
    end
    return refuse('turn_mismatch', 'turn ' .. named .. ' has ended (turn ' .. turn ..
                  ' is running); its ' .. typ .. ' is refused')
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
local filed = nil  -- the turn the batch's other durable events belong to
local function node_of(typ, arg)
  if CONVERSATION_LEVEL[typ] then return '' end
  if typ == 'user_message' or (op == 'answer' and typ == 'tool_result') then return msg_id end
  if typ == 'turn_start' then return arg end
  if not TURN_LEVEL[typ] and (m.turn_id or '') ~= '' then filed = filed or m.turn_id end
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

-- What the conversation list shows of a text: whitespace collapsed, at most 120 characters
-- (whole UTF-8 sequences), as the gateway cuts a user message's.
local function preview_of(text)
  local out, count = {}, 0
  for word in string.gmatch(text, '%S+') do
    for char in string.gmatch(word, '[%z\1-\127\194-\244][\128-\191]*') do
      if count == 120 then return table.concat(out) end
      out[#out + 1], count = char, count + 1
    end
    if count == 120 then return table.concat(out) end
    out[#out + 1], count = ' ', count + 1
  end
  return (string.gsub(table.concat(out), ' $', ''))
end

-- The running turn's answer: its node keeps the preview, and while the turn is the head,
-- so does the list (the latest thing said on the path).
local function answered_with(text)
  if text == nil or text == '' or (m.turn_id or '') == '' then return end
  local node = node_get(tree, m.turn_id)
  if not node then return end
  node.v = preview_of(text)
  node_put(tree, m.turn_id, node)
  if m.turn_id == (m.head or '') then
    m.preview = node.v
    listed, changed = true, true
  end
end

-- The list's preview with the head at ``head``: its answer, else the last user message.
local function preview_at(head)
  local node = head ~= '' and node_get(tree, head)
  if node and node.k == 'turn' and (node.v or '') ~= '' then return node.v end
  local _, last = last_user(tree, head)
  return last and last.v or ''
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
    m.status, m.turn_id, m.started_at = 'running', arg, now_text
    data = '{"turn_id":' .. cjson.encode(arg) .. ',"started_at":' .. now_text .. ',"parent_id":' ..
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
        if commit_type[streamed] == 'message' then answered_with(text) end
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
  elseif typ == 'state' then
    m.state = arg
    changed = true
  elseif typ == 'client_tools' then
    m.tools = arg
    changed = true
  elseif typ == 'tool_call' and string.sub(arg, 1, 1) == '?' then
    local call_id, name = string.match(arg, '^%?(%S+) (.+)$')
    local awaiting = m.awaiting and m.awaiting ~= '' and cjson.decode(m.awaiting) or {}
    awaiting[call_id] = name
    m.awaiting = cjson.encode(awaiting)
    listed, changed = true, true
  elseif typ == 'tool_result' and op == 'answer' then
    -- A node of the person's side, like a user message: its id and parent, for the trees.
    message_node = msg_id
    m.preview = arg
    data = splice(data, '"msg_id":' .. cjson.encode(msg_id) .. ',"parent_id":' ..
                  id_or_null(parent_of_message))
    changed = true
  elseif typ == 'title' then
    local previous = m.title ~= '' and cjson.encode(m.title) or 'null'
    data = '{"title":' .. cjson.encode(data) .. ',"previous":' .. previous ..
           ',"source":' .. cjson.encode(arg) .. '}'
    m.title = ARGV[base + 2 + i * 4]
    listed, changed = true, true
  elseif typ == 'child' then
    redis.call('ZADD', children, now_text, arg)
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
  if durable and typ == 'message' then answered_with(data_field(data, 'text', 'string')) end
  local at = emit(typ, durable, data, stream_part, node)
  if i >= (cancelled and 1 or 0) then seqs[#seqs + 1] = at end  -- not the cancel's turn_end
  if typ == 'user_message' or (typ == 'tool_result' and op == 'answer') then
    node_add(tree, msg_id, 'user', parent_of_message, at, arg)
    redis.call('ZADD', starts, at, at)
  elseif typ == 'turn_start' then
    node_add(tree, arg, 'turn', answered and op == 'retry' and answered.msg_id or message_node or '', at, '')
  end
end

-- The head moves last, as one durable event: to the turn the batch started, or where an
-- undo or a switch goes.
if started and (op == '' or op == 'message' or op == 'retry' or op == 'edit'
    or op == 'answer') then
  new_head = started
  if op == '' then cause = 'message' end
end
if new_head ~= nil and new_head ~= head_before then
  mark_active(tree, new_head)
  m.head = new_head
  m.msgs = tostring(depth(tree, new_head))
  -- A message grows the path by itself and a turn with no usage yet: the total stands.
  if op ~= 'message' then m.usage_active = cjson.encode(path_usage(tree, new_head)) end
  if op ~= 'message' and op ~= '' then m.preview = preview_at(new_head) end
  emit('head', true, '{"head_id":' .. id_or_null(new_head) .. ',"prev_head_id":' ..
       id_or_null(head_before) .. ',"cause":' .. cjson.encode(cause) .. ',"by":' ..
       cjson.encode(by) .. '}', nil, '')
  listed, changed = true, true
end

if seq ~= tonumber(m.seq) then trim(seq, m.head) end

-- Ephemeral-only batches (plain deltas: the hot path) leave the state untouched.
if seq ~= tonumber(m.seq) or changed then
  m.seq = tostring(seq)
  m.updated_at = now_text
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
                msg_id = message_node, filed = filed, agent = agent_of(m)}
if #seqs > 0 then result.seqs = seqs end
if idem then
  redis.call('SET', idem, cjson.encode(result), 'EX', tonumber(ARGV[3]))
end
if listed then
  result.feed = announce(chat, m, now_text, created)
  local _, users = members_of(m)
  if #users > 0 then result.members = users end
end
return cjson.encode(result)
