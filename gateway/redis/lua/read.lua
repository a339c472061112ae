-- A conversation's state, its open streams and the durable frames after a seq, atomically,
-- in one round trip; optionally creating the conversation first (subscribing to an unknown
-- chat creates it).
--
-- KEYS[1] meta hash, KEYS[2] event stream, KEYS[3 .. 2+k] the text key of each streamed
-- type, in ARGV[6]'s order
-- ARGV[1] seq to read after ("" = the state only), ARGV[2] most frames to return
-- ARGV[3] owner to create the conversation for when it does not exist ("" = do not)
-- ARGV[4] epoch for a new conversation, ARGV[5] chat id, ARGV[6] streamed types,
-- comma-separated
--
-- Returns {meta (flat, empty when it does not exist), entries (XRANGE), created (0/1),
-- streams (flat: type, "<id> <turn id> <pos> <attempt>", text, ...)}; when created, a
-- fifth element: the feed frame that announces it.

local m = load_meta(KEYS[1])
if not m then
  if ARGV[3] == '' then return {{}, {}, 0, {}} end
  local now = now_ms()
  m = new_meta(ARGV[3], ARGV[4], now)
  save_meta(KEYS[1], m)
  return {flatten(m), {}, 1, {}, announce(ARGV[5], m, now, true)}
end
local streams = {}
local k = 0
for typ in string.gmatch(ARGV[6], '[^,]+') do
  k = k + 1
  local header = m['st:' .. typ]
  if header and header ~= '' then
    streams[#streams + 1] = typ
    streams[#streams + 1] = header
    streams[#streams + 1] = redis.call('GET', KEYS[2 + k]) or ''
  end
end
local entries = {}
if ARGV[1] ~= '' then
  entries = redis.call('XRANGE', KEYS[2], '(' .. ARGV[1] .. '-0', '+', 'COUNT', ARGV[2])
end
return {flatten(m), entries, 0, streams}
