-- Append a batch of events to one conversation, atomically, in one round trip.
--
-- KEYS[1] meta hash, KEYS[2] event stream
-- KEYS[3 .. 2+k] the text key of each streamed type, in ARGV[10]'s order
-- KEYS[3+k] idempotency key (optional)
-- ARGV[1] room channel (a sharded channel in the conversation's slot)
-- ARGV[2] stream max length   ARGV[3] idempotency ttl (s)
-- ARGV[4] owner to create the conversation for when it does not exist ("" = must exist)
-- ARGV[5] a fresh unique name: the epoch of a newly created conversation, and the prefix of
--         the id of a stream this batch opens
-- ARGV[6] chat id             ARGV[7] number of events
-- ARGV[8] note: returned as is, and again on an idempotent retry (the message's turn id);
--         a cancel_requested sets it to the cancelled turn's id
-- ARGV[9] writer: the user who must own the conversation ("" = anyone, e.g. a service)
-- ARGV[10] streamed types, comma-separated (k of them)
-- ARGV[11] most bytes of text one stream may hold
-- then 4 per event: type, durable ("1"/"0"), data (JSON, or raw text for title), extra
--
-- Semantic types are completed here, where the conversation state lives:
--   user_message  extra = preview (<= 120 chars), remembered for the conversation list
--   turn_start    extra = turn id; needs an idle conversation
--   turn_end      extra = expected turn id or ""; data {"reason":..} gets turn_id,
--                 latency_ms and the goal_state snapshot spliced in; every stream still
--                 open is committed first, as a durable partial event
--   cancel_requested  extra = expected turn id or ""; needs a running turn
--   goal_state    data stored as the conversation's goal snapshot
--   title         data = the new title (raw), extra = source
--   a streamed type (ephemeral, while a turn runs)  extra = the worker's attempt id; the
--                 delta joins its type's open stream ("stream":{"id","pos"}), or opens one;
--                 an open stream of another attempt is discarded first
--   its commit type (durable `message` for `delta`, `X` for `X_delta`)  closes the open
--                 stream: data gets "stream_id", and "text" when extra = "fill"
--
-- An open stream lives in the meta hash as field "st:<type>" = "<id> <turn id> <pos>
-- <attempt>" and its text in its text key.
--
-- Returns {"ok", epoch, seqs (one per event: comma list, "" for ephemeral), last_seq, owner,
-- duplicate ("0"/"1"), now (ms), feed ("1" when the conversation-list entry changed), note,
-- created ("1"/"0"), the feed frame to announce ("" when none)} or {"err", code, message}.
-- The feed lives in the owner's slot, not this one: the store publishes it after the
-- script. Every durable event is stored as entry "<seq>-0". Each frame is SPUBLISHed as "<epoch>|<seq>|<stream id>:<pos>|<frame>", the
-- parts that do not apply left empty (hub.py reads this envelope).

local meta, stream = KEYS[1], KEYS[2]
local channel, chat = ARGV[1], ARGV[6]
local maxlen = tonumber(ARGV[2])
local n = tonumber(ARGV[7])
local note = ARGV[8]
local max_text = tonumber(ARGV[11])
local base = 12  -- ARGV index of the first event

local text_key, commit_type, streamed_type = {}, {}, {}
local k = 0
for typ in string.gmatch(ARGV[10], '[^,]+') do
  k = k + 1
  text_key[typ] = KEYS[2 + k]
  local commit = typ == 'delta' and 'message' or string.sub(typ, 1, -7)
  commit_type[typ], streamed_type[commit] = commit, typ
end
local idem = KEYS[3 + k]

local now = now_ms()

local m = load_meta(meta)
local created = false
if not m then
  if ARGV[4] == '' then return {'err', 'not_found', 'conversation does not exist'} end
  m = new_meta(ARGV[4], ARGV[5], now)
  created = true
end
if ARGV[9] ~= '' and ARGV[9] ~= m.owner then
  return {'err', 'forbidden', 'conversation belongs to another user'}
end

if idem then
  local prior = redis.call('GET', idem)
  if prior then
    local r = cjson.decode(prior)
    r[6] = '1'
    return r
  end
end

-- The open stream of a type: {id, turn, pos, attempt}, or nil.
local function open_stream(typ)
  local header = m['st:' .. typ]
  if not header or header == '' then return nil end
  local id, turn, pos, attempt = string.match(header, '^(%S+) (%S*) (%d+) (%S*)$')
  return {id = id, turn = turn, pos = tonumber(pos), attempt = attempt}
end

-- The text a streamed delta carries ("" when it has none).
local function delta_text(data)
  local ok, decoded = pcall(cjson.decode, data)
  if ok and type(decoded) == 'table' and type(decoded.text) == 'string' then
    return decoded.text
  end
  return ''
end

-- First pass: check every precondition against the state the batch would create,
-- so a rejected batch writes nothing.
local status, turn = m.status, m.turn_id
local streamed_bytes = {}  -- type -> bytes the open stream would hold
for i = 0, n - 1 do
  local typ, durable, extra = ARGV[base + i * 4], ARGV[base + 1 + i * 4], ARGV[base + 3 + i * 4]
  if typ == 'turn_start' then
    if status == 'running' then return {'err', 'turn_in_progress', 'turn ' .. turn .. ' is still running'} end
    status, turn = 'running', extra
  elseif typ == 'turn_end' or typ == 'cancel_requested' then
    if status ~= 'running' then return {'err', 'no_active_turn', 'no turn is running'} end
    if extra ~= '' and extra ~= turn then
      return {'err', 'turn_mismatch', 'turn ' .. extra .. ' is not the running turn ' .. turn}
    end
    if typ == 'turn_end' then
      status, turn = 'idle', ''
      streamed_bytes = {}
    end
  elseif text_key[typ] and durable == '0' and status == 'running' then
    local size = streamed_bytes[typ]
    if size == nil then
      local s = open_stream(typ)
      size = (s and s.turn == turn and s.attempt == extra) and redis.call('STRLEN', text_key[typ]) or 0
    end
    size = size + #delta_text(ARGV[base + 2 + i * 4])
    if size > max_text then
      return {'err', 'stream_too_large', 'the ' .. typ .. ' stream would pass ' .. max_text .. ' bytes'}
    end
    streamed_bytes[typ] = size
  elseif streamed_type[typ] and durable == '1' then
    streamed_bytes[streamed_type[typ]] = 0  -- committed: a later delta opens a new stream
  end
end

local seq = tonumber(m.seq)
local seqs = {}
local feed = created
local feed_frame = ''
local changed = created  -- fields other than seq, updated_at and streams changed
local touched = {}  -- stream fields to write back ("" = delete)
local opened = 0

local function emit(typ, durable, data, stream_part)
  local head = '{"type":' .. cjson.encode(typ) .. ',"chat_id":' .. cjson.encode(chat)
  if durable then
    seq = seq + 1
    local frame = head .. ',"seq":' .. seq .. ',"ts":' .. now .. ',"data":' .. data .. '}'
    redis.call('XADD', stream, 'MAXLEN', '~', maxlen, seq .. '-0', 'f', frame)
    redis.call('SPUBLISH', channel, m.epoch .. '|' .. seq .. '||' .. frame)
    return tostring(seq)
  end
  local frame
  if stream_part then
    frame = head .. ',"seq":null,"ts":' .. now .. ',"stream":{"id":' .. cjson.encode(stream_part[1]) ..
            ',"pos":' .. stream_part[2] .. '},"data":' .. data .. '}'
    redis.call('SPUBLISH', channel, '||' .. stream_part[1] .. ':' .. stream_part[2] .. '|' .. frame)
  else
    frame = head .. ',"seq":null,"ts":' .. now .. ',"data":' .. data .. '}'
    redis.call('SPUBLISH', channel, '|||' .. frame)
  end
  return ''
end

local function close_stream(typ)
  redis.call('DEL', text_key[typ])
  m['st:' .. typ] = nil
  touched['st:' .. typ] = ''
end

-- {"a":1} + '"b":2' -> {"b":2,"a":1}
local function splice(data, fields)
  if data == '{}' then return '{' .. fields .. '}' end
  return '{' .. fields .. ',' .. string.sub(data, 2)
end

for i = 0, n - 1 do
  local typ, durable, data, extra = ARGV[base + i * 4], ARGV[base + 1 + i * 4], ARGV[base + 2 + i * 4], ARGV[base + 3 + i * 4]
  local stream_part = nil
  if typ == 'user_message' then
    m.preview = extra
    changed = true
  elseif typ == 'turn_start' then
    m.status, m.turn_id, m.started_at = 'running', extra, tostring(now)
    data = '{"turn_id":' .. cjson.encode(extra) .. ',"started_at":' .. now .. '}'
    feed, changed = true, true
  elseif typ == 'turn_end' then
    -- What users saw stays in history: every stream still open becomes a durable partial.
    for streamed, key in pairs(text_key) do
      local s = open_stream(streamed)
      if s then
        local text = redis.call('GET', key) or ''
        emit(commit_type[streamed], true, '{"text":' .. cjson.encode(text) ..
             ',"stream_id":' .. cjson.encode(s.id) .. ',"partial":true}')
        close_stream(streamed)
      end
    end
    local latency = now - tonumber(m.started_at)
    local goal = m.goal ~= '' and m.goal or 'null'
    data = '{"turn_id":' .. cjson.encode(m.turn_id) .. ',"latency_ms":' .. latency ..
           ',"goal_state":' .. goal .. ',' .. string.sub(data, 2)
    m.status, m.turn_id, m.started_at = 'idle', '', ''
    feed, changed = true, true
  elseif typ == 'cancel_requested' then
    data = '{"turn_id":' .. cjson.encode(m.turn_id) .. '}'
    note = m.turn_id
  elseif typ == 'goal_state' then
    m.goal = data
    feed, changed = true, true
  elseif typ == 'title' then
    local previous = m.title ~= '' and cjson.encode(m.title) or 'null'
    data = '{"title":' .. cjson.encode(data) .. ',"previous":' .. previous ..
           ',"source":' .. cjson.encode(extra) .. '}'
    m.title = ARGV[base + 2 + i * 4]
    feed, changed = true, true
  elseif text_key[typ] and durable == '0' and m.status == 'running' then
    local s = open_stream(typ)
    if s and (s.turn ~= m.turn_id or s.attempt ~= extra) then
      -- A redelivered turn streams anew: every device drops the old attempt's partial first.
      emit('stream_discarded', false, '{"stream_id":' .. cjson.encode(s.id) ..
           ',"type":' .. cjson.encode(typ) .. ',"turn_id":' .. cjson.encode(s.turn) .. '}')
      close_stream(typ)
      s = nil
    end
    if not s then
      opened = opened + 1
      s = {id = 's' .. ARGV[5] .. '.' .. opened, turn = m.turn_id, pos = 0, attempt = extra}
    end
    redis.call('APPEND', text_key[typ], delta_text(data))
    stream_part = {s.id, s.pos}
    m['st:' .. typ] = s.id .. ' ' .. s.turn .. ' ' .. (s.pos + 1) .. ' ' .. s.attempt
    touched['st:' .. typ] = m['st:' .. typ]
  elseif streamed_type[typ] and durable == '1' then
    local streamed = streamed_type[typ]
    local s = open_stream(streamed)
    if s then
      local fields = '"stream_id":' .. cjson.encode(s.id)
      if extra == 'fill' then
        fields = fields .. ',"text":' .. cjson.encode(redis.call('GET', text_key[streamed]) or '')
      end
      data = splice(data, fields)
      close_stream(streamed)
    end
  end
  seqs[#seqs + 1] = emit(typ, durable == '1', data, stream_part)
end

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
for field, value in pairs(touched) do
  if value == '' then
    redis.call('HDEL', meta, field)
  elseif not changed then  -- save_meta wrote it otherwise
    redis.call('HSET', meta, field, value)
  end
end

if feed then
  feed_frame = announce(chat, m, now, created)
end

local result = {'ok', m.epoch, table.concat(seqs, ','), tostring(seq), m.owner, '0',
                tostring(now), feed and '1' or '0', note, created and '1' or '0'}
if idem then
  redis.call('SET', idem, cjson.encode(result), 'EX', tonumber(ARGV[3]))
end
result[#result + 1] = feed_frame
return result
