-- The conversation tree, kept beside the log (key c:{chat}:tree). Prepended to the scripts
-- that read or change it, after lib.lua.
--
-- Nodes are user messages (kind "user", id = msg_id) and turns (kind "turn", id =
-- turn_id). Field <node id> holds {"k": kind, "p": parent id ("" for none), "s": seq of the
-- node's first event, "c": child ids, comma-joined, "l": the child last on the active path,
-- "v": a user message's preview, "d": its depth (nodes from the root to it, itself included),
-- "u": a turn's usage as its turn_end reported it}. Field "^" is the root: {"c", "l"} of the first messages.
-- The conversation's head (meta field "head", "" for none) is the node the next message
-- follows; the active path runs from the root to it.

local ROOT = '^'

local function node_get(tree, id)
  local raw = redis.call('HGET', tree, id)
  if not raw then return nil end
  return cjson.decode(raw)
end

local function node_put(tree, id, node)
  redis.call('HSET', tree, id, cjson.encode(node))
end

local function children(node)
  local list = {}
  if node and node.c and node.c ~= '' then
    for id in string.gmatch(node.c, '[^,]+') do list[#list + 1] = id end
  end
  return list
end

-- The node ids from the root down to `head`, and a set of them.
local function path_to(tree, head)
  local up, set = {}, {}
  local id = head
  while id and id ~= '' do
    local node = node_get(tree, id)
    if not node then break end
    up[#up + 1] = id
    set[id] = node
    id = node.p
  end
  local path = {}
  for i = #up, 1, -1 do path[#path + 1] = up[i] end
  return path, set
end

-- How many nodes the path to `id` holds (0 for the root). Nodes made before depths were
-- kept have none: their path is counted.
local function depth(tree, id, node)
  if id == '' or id == ROOT then return 0 end
  node = node or node_get(tree, id)
  if node and node.d then return node.d end
  return #path_to(tree, id)
end

-- Add a node under `parent` ("" = the root).
local function node_add(tree, id, kind, parent, seq, preview)
  local pid = parent ~= '' and parent or ROOT
  local p = node_get(tree, pid) or {c = '', l = ''}
  node_put(tree, id, {k = kind, p = parent, s = seq, c = '', l = '', v = preview,
                      d = depth(tree, pid, p) + 1})
  p.c = (p.c ~= '' and (p.c .. ',') or '') .. id
  node_put(tree, pid, p)
end

-- The summed usage of the turns on the path to `head`.
local function path_usage(tree, head)
  local total = {}
  local _, set = path_to(tree, head)
  for _, node in pairs(set) do
    if node.u then usage_add(total, node.u) end
  end
  return total
end

-- The last user message on the path to `head` (its id and node), or nil.
local function last_user(tree, head)
  local id = head
  while id and id ~= '' do
    local node = node_get(tree, id)
    if not node then return nil end
    if node.k == 'user' then return id, node end
    id = node.p
  end
  return nil
end

-- The leaf last active below `id`: follow each node's last active child down.
local function last_leaf(tree, id)
  local node = node_get(tree, id)
  while node and node.l and node.l ~= '' do
    id = node.l
    node = node_get(tree, id)
  end
  return id
end

-- Make `head` the active path's end: every ancestor remembers the child it went through,
-- so a later switch to that fork returns here.
local function mark_active(tree, head)
  local id = head
  while id and id ~= '' do
    local node = node_get(tree, id)
    if not node then return end
    local pid = node.p ~= '' and node.p or ROOT
    local parent = node_get(tree, pid) or {c = '', l = ''}
    if parent.l ~= id then
      parent.l = id
      node_put(tree, pid, parent)
    end
    id = node.p
  end
end
