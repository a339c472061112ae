-- A conversation's state, its open streams and the durable frames after a seq, atomically,
-- in one round trip; optionally creating the conversation first (subscribing to an unknown
-- chat creates it). gateway/redis/scripts.py (ReadScript) builds the arguments and decodes
-- the reply.
--
-- KEYS[1] meta hash, KEYS[2] event log, KEYS[3] the tree, KEYS[4] the turn starts,
-- KEYS[5 .. 4+k] the text key of each streamed type, in ARGV[6]'s order, KEYS[5+k] the
-- sub-conversations
-- ARGV[1] seq to read after ("" = the state only), ARGV[2] most frames to return
-- ARGV[3] owner to create the conversation for when it does not exist ("" = do not)
-- ARGV[4] epoch for a new conversation, ARGV[5] chat id, ARGV[6] streamed types,
-- comma-separated, ARGV[7] the agent that answers a new conversation
--
-- Replies {"meta": the meta hash (absent when the conversation does not exist),
-- "created", "feed" (when created: the feed frame that announces it),
-- "streams": [{"type", "id", "turn_id", "pos", "text"}], "children": [chat id, ...],
-- "frames": [[seq, frame], ...]}.
-- The frames are spliced in as they are stored (JSON already), not encoded again.

local m = load_meta(KEYS[1])
if not m then
  if ARGV[3] == '' then return '{"created":false}' end
  local _, now_text = now_ms()
  m = new_meta(ARGV[3], ARGV[4], now_text, ARGV[7])
  save_meta(KEYS[1], m)
  return cjson.encode({meta = m, created = true, feed = announce(ARGV[5], m, now_text, true)})
end
local reply = {meta = m, created = false}
local streams = {}
local k = 0
for typ in string.gmatch(ARGV[6], '[^,]+') do
  k = k + 1
  local s = open_stream(m, typ)
  if s then
    streams[#streams + 1] = {type = typ, id = s.id, turn_id = s.turn, pos = s.pos,
                             text = redis.call('GET', KEYS[4 + k]) or ''}
  end
end
if #streams > 0 then reply.streams = streams end
local children = redis.call('ZRANGE', KEYS[5 + k], 0, -1)
if #children > 0 then reply.children = children end
local json = cjson.encode(reply)
if ARGV[1] == '' then return json end
local entries = redis.call('XRANGE', KEYS[2], '(' .. ARGV[1] .. '-0', '+', 'COUNT', ARGV[2])
if #entries == 0 then return json end
local frames = {}
for i, entry in ipairs(entries) do
  frames[i] = '[' .. string.match(entry[1], '^(%d+)') .. ',' .. entry[2][2] .. ']'
end
return '{"frames":[' .. table.concat(frames, ',') .. '],' .. string.sub(json, 2)
