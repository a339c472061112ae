-- Append a batch of events to one conversation, atomically, in one round trip.
--
-- KEYS[1] meta hash, KEYS[2] event stream, KEYS[3] idempotency key (optional)
-- ARGV[1] room channel        ARGV[2] feed channel prefix (the owner's id is appended)
-- ARGV[3] stream max length   ARGV[4] idempotency ttl (s)
-- ARGV[5] owner to create the conversation for when it does not exist ("" = must exist)
-- ARGV[6] epoch for a newly created conversation
-- ARGV[7] chat id             ARGV[8] number of events
-- ARGV[9] note: returned as is, and again on an idempotent retry (the message's turn id);
--         a cancel_requested sets it to the cancelled turn's id
-- ARGV[10] writer: the user who must own the conversation ("" = anyone, e.g. a service)
-- then 4 per event: type, durable ("1"/"0"), data (JSON, or raw text for title), extra
--
-- Semantic types are completed here, where the conversation state lives:
--   user_message  extra = preview (<= 120 chars), remembered for the conversation list
--   turn_start    extra = turn id; needs an idle conversation
--   turn_end      extra = expected turn id or ""; data {"reason":..} gets turn_id,
--                 latency_ms and the goal_state snapshot spliced in
--   cancel_requested  extra = expected turn id or ""; needs a running turn
--   goal_state    data stored as the conversation's goal snapshot
--   title         data = the new title (raw), extra = source
--
-- Returns {"ok", epoch, seqs (comma list, "" for ephemeral), last_seq, owner, duplicate ("0"/"1"),
-- now (ms), feed ("1" when the conversation-list entry changed), note, created ("1"/"0")}
-- or {"err", code, message}. Every durable event is stored as entry "<seq>-0" and
-- PUBLISHed as "<epoch>|<seq>|<frame>"; ephemeral ones as "||<frame>".

local meta, stream = KEYS[1], KEYS[2]
local idem = KEYS[3]
local channel, chat = ARGV[1], ARGV[7]
local maxlen = tonumber(ARGV[3])
local n = tonumber(ARGV[8])
local note = ARGV[9]

local now = now_ms()

local m = load_meta(meta)
local created = false
if not m then
  if ARGV[5] == '' then return {'err', 'not_found', 'conversation does not exist'} end
  m = new_meta(ARGV[5], ARGV[6], now)
  created = true
end
if ARGV[10] ~= '' and ARGV[10] ~= m.owner then
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

-- First pass: check every precondition against the state the batch would create,
-- so a rejected batch writes nothing.
local status, turn = m.status, m.turn_id
for i = 0, n - 1 do
  local typ, extra = ARGV[11 + i * 4], ARGV[14 + i * 4]
  if typ == 'turn_start' then
    if status == 'running' then return {'err', 'turn_in_progress', 'turn ' .. turn .. ' is still running'} end
    status, turn = 'running', extra
  elseif typ == 'turn_end' or typ == 'cancel_requested' then
    if status ~= 'running' then return {'err', 'no_active_turn', 'no turn is running'} end
    if extra ~= '' and extra ~= turn then
      return {'err', 'turn_mismatch', 'turn ' .. extra .. ' is not the running turn ' .. turn}
    end
    if typ == 'turn_end' then status, turn = 'idle', '' end
  end
end

local seq = tonumber(m.seq)
local seqs = {}
local feed = created
local changed = created  -- fields other than seq and updated_at changed
for i = 0, n - 1 do
  local typ, durable, data, extra = ARGV[11 + i * 4], ARGV[12 + i * 4], ARGV[13 + i * 4], ARGV[14 + i * 4]
  if typ == 'user_message' then
    m.preview = extra
    changed = true
  elseif typ == 'turn_start' then
    m.status, m.turn_id, m.started_at = 'running', extra, tostring(now)
    changed = true
    data = '{"turn_id":' .. cjson.encode(extra) .. ',"started_at":' .. now .. '}'
    feed = true
  elseif typ == 'turn_end' then
    local latency = now - tonumber(m.started_at)
    local goal = m.goal ~= '' and m.goal or 'null'
    data = '{"turn_id":' .. cjson.encode(m.turn_id) .. ',"latency_ms":' .. latency ..
           ',"goal_state":' .. goal .. ',' .. string.sub(data, 2)
    m.status, m.turn_id, m.started_at = 'idle', '', ''
    changed = true
    feed = true
  elseif typ == 'cancel_requested' then
    data = '{"turn_id":' .. cjson.encode(m.turn_id) .. '}'
    note = m.turn_id
  elseif typ == 'goal_state' then
    m.goal = data
    changed = true
    feed = true
  elseif typ == 'title' then
    local previous = m.title ~= '' and cjson.encode(m.title) or 'null'
    data = '{"title":' .. cjson.encode(data) .. ',"previous":' .. previous ..
           ',"source":' .. cjson.encode(extra) .. '}'
    m.title = ARGV[13 + i * 4]
    changed = true
    feed = true
  end
  local head = '{"type":' .. cjson.encode(typ) .. ',"chat_id":' .. cjson.encode(chat)
  if durable == '1' then
    seq = seq + 1
    local frame = head .. ',"seq":' .. seq .. ',"ts":' .. now .. ',"data":' .. data .. '}'
    redis.call('XADD', stream, 'MAXLEN', '~', maxlen, seq .. '-0', 'f', frame)
    redis.call('PUBLISH', channel, m.epoch .. '|' .. seq .. '|' .. frame)
    seqs[#seqs + 1] = tostring(seq)
  else
    local frame = head .. ',"seq":null,"ts":' .. now .. ',"data":' .. data .. '}'
    redis.call('PUBLISH', channel, '||' .. frame)
    seqs[#seqs + 1] = ''
  end
end

-- Ephemeral-only batches (token deltas: the hot path) leave the state untouched.
if seq ~= tonumber(m.seq) or changed then
  m.seq = tostring(seq)
  m.updated_at = tostring(now)
  if changed then
    save_meta(meta, m)
  else  -- a plain event: write only what moved
    redis.call('HSET', meta, 'seq', m.seq, 'updated_at', m.updated_at)
  end
end

if feed then
  announce(ARGV[2], chat, m, now, created)
end

local result = {'ok', m.epoch, table.concat(seqs, ','), tostring(seq), m.owner, '0',
                tostring(now), feed and '1' or '0', note, created and '1' or '0'}
if idem then
  redis.call('SET', idem, cjson.encode(result), 'EX', tonumber(ARGV[4]))
end
return result
