-- A conversation's state and the durable frames after a seq, atomically, in one round trip;
-- optionally creating the conversation first (subscribing to an unknown chat creates it).
--
-- KEYS[1] meta hash, KEYS[2] event stream
-- ARGV[1] seq to read after ("" = the state only), ARGV[2] most frames to return
-- ARGV[3] owner to create the conversation for when it does not exist ("" = do not)
-- ARGV[4] epoch for a new conversation, ARGV[5] chat id, ARGV[6] feed channel prefix
--
-- Returns {meta (flat, empty when it does not exist), entries (XRANGE), created (0/1)}.

local m = load_meta(KEYS[1])
if not m then
  if ARGV[3] == '' then return {{}, {}, 0} end
  local now = now_ms()
  m = new_meta(ARGV[3], ARGV[4], now)
  save_meta(KEYS[1], m)
  announce(ARGV[6], ARGV[5], m, now, true)
  local flat = {}
  for k, v in pairs(m) do flat[#flat + 1] = k; flat[#flat + 1] = v end
  return {flat, {}, 1}
end
local flat = {}
for k, v in pairs(m) do flat[#flat + 1] = k; flat[#flat + 1] = v end
if ARGV[1] == '' then return {flat, {}, 0} end
return {flat, redis.call('XRANGE', KEYS[2], '(' .. ARGV[1] .. '-0', '+', 'COUNT', ARGV[2]), 0}
