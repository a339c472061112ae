-- Shared by every script, first: the store puts this file in front of each one when it
-- loads it, so that time is read and room frames are wrapped the same way everywhere.
-- Only what the scripts' short paths need lives here (a function costs its definition on
-- every call of the script); the conversation's state is meta.lua's.
--
-- Every script replies with one JSON object (cjson), decoded by gateway/redis/scripts.py.
-- cjson cannot tell an empty array from an empty object, so an empty list is left out of
-- a reply and the Python side defaults it to [].

-- TIME's reply (seconds, microseconds, as text) in ms, as text: spliced from its digits,
-- because formatting a number costs more in Lua than most of a frame.
local function ms_text(seconds, micros)
  local ms = #micros > 3 and string.sub(micros, 1, -4) or '0'
  return seconds .. string.rep('0', 3 - #ms) .. ms
end

-- The server's clock in ms, as a number and as its text.
local function now_ms()
  local t = redis.call('TIME')
  local text = ms_text(t[1], t[2])
  return tonumber(text), text
end

-- The open stream of a streamed type: meta field "st:<type>" holds its header,
-- "<id> <turn id> <next pos> <attempt>", and its text lives in its own key. Returns
-- {id, turn, pos, attempt}, or nil when none is open. The one parser of the header.
local function parse_stream(header)
  if not header or header == '' then return nil end
  local id, turn, pos, attempt = string.match(header, '^(%S+) (%S*) (%d+) (%S*)$')
  return {id = id, turn = turn, pos = tonumber(pos), attempt = attempt}
end

local function stream_header(s)
  return s.id .. ' ' .. s.turn .. ' ' .. s.pos .. ' ' .. s.attempt
end

-- The pub/sub envelope of every room frame: "<epoch>|<seq>|<stream id>:<pos>|<frame>",
-- the parts that do not apply left empty. The one writer; gateway/redis/envelope.py is
-- the one reader.
local function envelope(epoch, seq, stream_id, pos, frame)
  local position = stream_id and (stream_id .. ':' .. pos) or ''
  return (seq and epoch or '') .. '|' .. (seq or '') .. '|' .. position .. '|' .. frame
end
