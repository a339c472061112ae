-- Delete one conversation: tell its room and its owner's feed, then drop its keys.
-- gateway/redis/scripts.py (DeleteScript) builds the arguments and decodes the reply.
--
-- KEYS[1] meta hash, KEYS[2] event log, KEYS[3] the tree, KEYS[4] the turn starts,
-- KEYS[5..] the text keys, and last the sub-conversations (a sorted set)
-- ARGV[1] room channel, ARGV[2] chat id
-- ARGV[3] retention: "" or "0" deletes; else ms: delete only if nothing was stored for
--         that long (updated_at, by this server's clock) and no turn runs
-- Replies {"owner", "feed": the feed frame that announces the deletion, "parent" (a
-- sub-conversation's), "children": the sub-conversations it had, "members": the others it
-- was shared with (their lists and feeds are told too)}, or {} when the
-- conversation does not exist, or {"kept": ms} when retention keeps it: when to look again
-- (its last change; now while a turn runs). Its children are the store's to delete: they
-- live in other slots.

local owner = redis.call('HGET', KEYS[1], 'owner')
if not owner then return '{}' end
local now, now_text = now_ms()
local untouched = tonumber(ARGV[3])
if untouched and untouched > 0 then
  local status, updated, created = unpack(redis.call('HMGET', KEYS[1], 'status', 'updated_at',
                                                     'created_at'))
  if status == 'running' then return cjson.encode({kept = now}) end
  local last = tonumber(updated or created or 0)
  if last > now - untouched then return cjson.encode({kept = last}) end
end
local chat = cjson.encode(ARGV[2])
local epoch = redis.call('HGET', KEYS[1], 'epoch')
local seq = redis.call('HGET', KEYS[1], 'seq')
local parent = redis.call('HGET', KEYS[1], 'parent') or ''
local children = redis.call('ZRANGE', KEYS[#KEYS], 0, -1)
local members = {}
local flat = redis.call('HGETALL', KEYS[1])
for i = 1, #flat, 2 do
  if string.sub(flat[i], 1, 5) == 'role:' then members[#members + 1] = string.sub(flat[i], 6) end
end
redis.call('DEL', unpack(KEYS))
redis.call('SPUBLISH', ARGV[1], envelope(nil, nil, nil, nil,
  '{"type":"deleted","chat_id":' .. chat .. ',"seq":null,"ts":' .. now_text ..
  ',"data":{"epoch":' .. cjson.encode(epoch) .. ',"last_seq":' .. seq .. '}}'))
return cjson.encode({owner = owner, parent = parent,
  children = #children > 0 and children or nil, members = #members > 0 and members or nil,
  feed = '{"type":"conversation","chat_id":' .. chat ..
  ',"title":null,"status":"idle","updated_at":' .. now_text .. ',"last_seq":' .. seq ..
  ',"goal_state":null,"preview":null,"created":false,"deleted":true}'})
