-- The whole conversation tree and the head, atomically. (lib.lua first.)
-- KEYS[1] meta hash, KEYS[2] the tree, KEYS[3] the event log
-- Replies {"head", "nodes": {node id: the node's record (tree.lua)}, "first": the seq of
-- the first event the log still holds (left out when it holds none)}, or {} when the
-- conversation does not exist.

local m = load_meta(KEYS[1])
if not m then return '{}' end
local nodes = {}
local flat = redis.call('HGETALL', KEYS[2])
for i = 1, #flat, 2 do nodes[flat[i]] = flat[i + 1] end
local oldest = redis.call('XRANGE', KEYS[3], '-', '+', 'COUNT', 1)[1]
local first = oldest and string.match(oldest[1], '^(%d+)') or nil
return cjson.encode({head = m.head or '', nodes = nodes, first = first})
