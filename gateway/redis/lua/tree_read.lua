-- The whole conversation tree and the head, atomically. (lib.lua first.)
-- KEYS[1] meta hash, KEYS[2] the tree
-- Replies {"head", "nodes": {node id: the node's record (tree.lua)}}, or {} when the
-- conversation does not exist.

local m = load_meta(KEYS[1])
if not m then return '{}' end
local nodes = {}
local flat = redis.call('HGETALL', KEYS[2])
for i = 1, #flat, 2 do nodes[flat[i]] = flat[i + 1] end
return cjson.encode({head = m.head or '', nodes = nodes})
