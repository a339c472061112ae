-- Shared by every script: the store prepends this file to each one when it loads it, so
-- a conversation is created, saved, announced and published the same way everywhere.
--
-- Every script replies with one JSON object (cjson), decoded by gateway/redis/scripts.py.
-- cjson cannot tell an empty array from an empty object, so an empty list is left out of
-- a reply and the Python side defaults it to [].

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- The meta hash as a table, or nil when the conversation does not exist.
local function load_meta(key)
  local flat = redis.call('HGETALL', key)
  if #flat == 0 then return nil end
  local m = {}
  for i = 1, #flat, 2 do m[flat[i]] = flat[i + 1] end
  if not m.epoch then return nil end
  return m
end

-- A new conversation's state.
local function new_meta(owner, epoch, now)
  return {owner = owner, epoch = epoch, seq = '0', status = 'idle', title = '', turn_id = '',
          started_at = '', goal = '', preview = '', created_at = tostring(now),
          updated_at = tostring(now)}
end

-- The meta table as HSET arguments.
local function flatten(m)
  local flat = {}
  for k, v in pairs(m) do flat[#flat + 1] = k; flat[#flat + 1] = v end
  return flat
end

local function save_meta(key, m)
  redis.call('HSET', key, unpack(flatten(m)))
end

-- The open stream of a streamed type: meta field "st:<type>" holds its header,
-- "<id> <turn id> <next pos> <attempt>", and its text lives in its own key. Returns
-- {id, turn, pos, attempt}, or nil when none is open. The one parser of the header.
local function parse_stream(header)
  if not header or header == '' then return nil end
  local id, turn, pos, attempt = string.match(header, '^(%S+) (%S*) (%d+) (%S*)$')
  return {id = id, turn = turn, pos = tonumber(pos), attempt = attempt}
end

local function open_stream(m, typ)
  return parse_stream(m['st:' .. typ])
end

local function stream_header(s)
  return s.id .. ' ' .. s.turn .. ' ' .. s.pos .. ' ' .. s.attempt
end

-- Usage totals (meta fields usage_billed, usage_active): JSON objects of summed numbers.
local function usage_decode(raw)
  if not raw or raw == '' then return {} end
  return cjson.decode(raw)
end

local function usage_add(total, usage)
  for name, value in pairs(usage) do total[name] = (total[name] or 0) + value end
  return total
end

-- The pub/sub envelope of every room frame: "<epoch>|<seq>|<stream id>:<pos>|<frame>",
-- the parts that do not apply left empty. The one writer; gateway/redis/envelope.py is
-- the one reader.
local function envelope(epoch, seq, stream_id, pos, frame)
  local position = stream_id and (stream_id .. ':' .. pos) or ''
  return (seq and epoch or '') .. '|' .. (seq or '') .. '|' .. position .. '|' .. frame
end

-- The frame that tells the owner's devices (their conversation feed) about the
-- conversation's state. The feed channel lives in the owner's slot, so the store publishes
-- it after the script (a script may touch only its own slot).
local function announce(chat, m, now, created)
  return '{"type":"conversation","chat_id":' .. cjson.encode(chat) ..
    ',"title":' .. (m.title ~= '' and cjson.encode(m.title) or 'null') ..
    ',"status":"' .. m.status .. '","updated_at":' .. now .. ',"last_seq":' .. m.seq ..
    ',"goal_state":' .. (m.goal ~= '' and m.goal or 'null') ..
    ',"preview":' .. (m.preview ~= '' and cjson.encode(m.preview) or 'null') ..
    ',"head":' .. ((m.head or '') ~= '' and cjson.encode(m.head) or 'null') ..
    ',"usage":{"billed":' .. ((m.usage_billed or '') ~= '' and m.usage_billed or '{}') ..
    ',"active":' .. ((m.usage_active or '') ~= '' and m.usage_active or '{}') .. '}' ..
    ',"message_count":' .. (m.msgs or '0') ..
    ',"parent":' .. ((m.parent or '') ~= '' and cjson.encode(m.parent) or 'null') ..
    ',"created":' .. (created and 'true' or 'false') .. ',"deleted":false}'
end
