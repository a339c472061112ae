-- A page of the active path: the events of the nodes from the root to the head and the
-- conversation-level ones, in seq order, and the forks on the path. (lib.lua, tree.lua
-- first.) gateway/redis/scripts.py (HistoryScript) builds the arguments and decodes it.
--
-- KEYS[1] meta hash, KEYS[2] event log, KEYS[3] the tree
-- ARGV[1] seq to read after, ARGV[2] most events to return, ARGV[3] the node the path ends
-- at ("" = the head; an agent reads the path to the message its turn answers)
--
-- Replies {"meta", "scanned" (the last seq looked at, as a string), "forks": {node id: {"siblings",
-- "index"}} (left out when none), "events": [frame, ...]}, or {} when the conversation
-- does not exist. Events stored before the tree (no node field) count as the
-- conversation's own. When history was trimmed past a node of the path, the page starts at
-- the first user message after the last such node (never an answer without its question)
-- and the reply has "trimmed": true.

local m = load_meta(KEYS[1])
if not m then return '{}' end
local log, tree = KEYS[2], KEYS[3]
local after, limit = tonumber(ARGV[1]), tonumber(ARGV[2])
local tip = ARGV[3] ~= '' and ARGV[3] or (m.head or '')
local path, on_path = path_to(tree, tip)
local oldest = redis.call('XRANGE', log, '-', '+', 'COUNT', 1)[1]
local first = oldest and tonumber(string.match(oldest[1], '^(%d+)')) or (tonumber(m.seq) + 1)
local keep_from = nil  -- the path's index of its first whole exchange
for i, id in ipairs(path) do
  if on_path[id].s < first then keep_from = nil
  elseif not keep_from and on_path[id].k == 'user' then keep_from = i end
end
local trimmed = #path > 0 and on_path[path[1]].s < first
if trimmed then
  for i, id in ipairs(path) do
    if not keep_from or i < keep_from then on_path[id] = nil end
  end
end

local forks, any = {}, false
for _, id in ipairs(path) do
  local node = on_path[id]
  local siblings = node and children(node_get(tree, node.p ~= '' and node.p or ROOT)) or {}
  if #siblings > 1 then
    local index = 0
    for i, sibling in ipairs(siblings) do
      if sibling == id then index = i - 1 end
    end
    forks[id] = {siblings = siblings, index = index}
    any = true
  end
end

-- Seqs are formatted whole: Lua would print a large one in exponent form.
local function whole(n) return string.format('%.0f', n) end
local events, scanned = {}, after
while #events < limit and scanned < tonumber(m.seq) do
  local batch = redis.call('XRANGE', log, '(' .. whole(scanned) .. '-0', '+', 'COUNT', math.max(limit, 100))
  if #batch == 0 then break end
  for _, entry in ipairs(batch) do
    local fields, node = entry[2], ''
    for i = 1, #fields, 2 do
      if fields[i] == 'n' then node = fields[i + 1] end
    end
    scanned = tonumber(string.match(entry[1], '^(%d+)'))
    if node == '' or on_path[node] then
      events[#events + 1] = fields[2]
      if #events == limit then break end
    end
  end
end

local reply = {meta = m, scanned = whole(scanned), trimmed = trimmed or nil}
if any then reply.forks = forks end
local json = cjson.encode(reply)
if #events == 0 then return json end
return '{"events":[' .. table.concat(events, ',') .. '],' .. string.sub(json, 2)
