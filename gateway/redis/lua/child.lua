-- Create a sub-conversation: a new conversation, as publish.lua and read.lua create one,
-- whose meta field "parent" names its parent. The parent lives in another slot: the store
-- records the child there afterwards (a `child` event, publish.lua).
-- gateway/redis/scripts.py (ChildScript) builds the arguments and decodes the reply.
--
-- KEYS[1] meta hash
-- ARGV[1] owner (the parent's), ARGV[2] epoch, ARGV[3] chat id, ARGV[4] the parent's chat id
-- ARGV[5] the agent that answers it
-- Replies {"created": true, "epoch", "ts", "feed": the feed frame that announces it}, or
-- {"created": false, "epoch", "parent": the existing conversation's ("" for none)}.

local m = load_meta(KEYS[1])
if m then return cjson.encode({created = false, epoch = m.epoch, parent = m.parent or ''}) end
local now, now_text = now_ms()
m = new_meta(ARGV[1], ARGV[2], now_text, ARGV[5])
m.parent = ARGV[4]
save_meta(KEYS[1], m)
return cjson.encode({created = true, epoch = m.epoch, ts = now,
                     feed = announce(ARGV[3], m, now_text, true)})
