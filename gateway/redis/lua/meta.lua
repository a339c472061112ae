-- A conversation's state (its meta hash), created, saved and announced the same way by
-- every script that needs it. The store puts this file after lib.lua (publish.lua: after
-- its short paths, which do without it).

-- The meta hash as a table, or nil when the conversation does not exist.
local function load_meta(key)
  local flat = redis.call('HGETALL', key)
  if #flat == 0 then return nil end
  local m = {}
  for i = 1, #flat, 2 do m[flat[i]] = flat[i + 1] end
  if not m.epoch then return nil end
  return m
end

-- A new conversation's state, created at ``now_text`` (now_ms's text), answered by the
-- agent named ``agent``.
local function new_meta(owner, epoch, now_text, agent)
  return {owner = owner, epoch = epoch, seq = '0', status = 'idle', title = '', turn_id = '',
          started_at = '', goal = '', preview = '', created_at = now_text,
          updated_at = now_text, agent = agent}
end

-- The agent that answers a conversation: one from before named agents has "default".
local function agent_of(m)
  return (m.agent or '') ~= '' and m.agent or 'default'
end

-- The meta table as HSET arguments.
local function flatten(m)
  local flat = {}
  for k, v in pairs(m) do flat[#flat + 1] = k; flat[#flat + 1] = v end
  return flat
end

local function save_meta(key, m)
  redis.call('HSET', key, unpack(flatten(m)))
end

local function open_stream(m, typ)
  return parse_stream(m['st:' .. typ])
end

-- Usage totals (meta fields usage_billed, usage_active): JSON objects of summed numbers.
local function usage_decode(raw)
  if not raw or raw == '' then return {} end
  return cjson.decode(raw)
end

local function usage_add(total, usage)
  for name, value in pairs(usage) do total[name] = (total[name] or 0) + value end
  return total
end

-- The people a conversation is shared with besides its owner (meta fields "role:<user>"),
-- as {user = role}, and their ids in a list.
local function members_of(m)
  local roles, users = {}, {}
  for k, v in pairs(m) do
    if string.sub(k, 1, 5) == 'role:' then
      local user = string.sub(k, 6)
      roles[user] = v
      users[#users + 1] = user
    end
  end
  table.sort(users)
  return roles, users
end

-- Whether ``writer`` (publish.lua's ARGV[8]) may write: "" anyone (a service), "<user>"
-- the owner or a member, ":<user>" only the owner. Else the refusal's message.
local function write_refused(m, writer)
  if writer == '' or writer == m.owner or writer == ':' .. m.owner then return nil end
  if string.sub(writer, 1, 1) == ':' then
    local role = m['role:' .. string.sub(writer, 2)]
    return role and 'only the owner may do this' or 'conversation belongs to another user'
  end
  local role = m['role:' .. writer]
  if role == 'member' then return nil end
  return role == 'viewer' and 'a viewer may only read this conversation'
    or 'conversation belongs to another user'
end

-- The members as the feed frame's JSON object ({} when none).
local function members_json(m)
  local roles, users = members_of(m)
  local parts = {}
  for _, user in ipairs(users) do
    parts[#parts + 1] = cjson.encode(user) .. ':' .. cjson.encode(roles[user])
  end
  return '{' .. table.concat(parts, ',') .. '}'
end

-- The frame that tells the owner's and the members' devices (their conversation feeds)
-- about the conversation's state. The feed channel lives in the owner's slot, so the store publishes
-- it after the script (a script may touch only its own slot). ``now_text``: now_ms's text.
local function announce(chat, m, now_text, created)
  return '{"type":"conversation","chat_id":' .. cjson.encode(chat) ..
    ',"title":' .. (m.title ~= '' and cjson.encode(m.title) or 'null') ..
    ',"status":"' .. m.status .. '","updated_at":' .. now_text .. ',"last_seq":' .. m.seq ..
    ',"goal_state":' .. (m.goal ~= '' and m.goal or 'null') ..
    ',"preview":' .. (m.preview ~= '' and cjson.encode(m.preview) or 'null') ..
    ',"head":' .. ((m.head or '') ~= '' and cjson.encode(m.head) or 'null') ..
    ',"usage":{"billed":' .. ((m.usage_billed or '') ~= '' and m.usage_billed or '{}') ..
    ',"active":' .. ((m.usage_active or '') ~= '' and m.usage_active or '{}') .. '}' ..
    ',"message_count":' .. (m.msgs or '0') ..
    ',"parent":' .. ((m.parent or '') ~= '' and cjson.encode(m.parent) or 'null') ..
    ',"agent":' .. cjson.encode(agent_of(m)) ..
    ',"owner":' .. cjson.encode(m.owner) .. ',"members":' .. members_json(m) ..
    ',"created":' .. (created and 'true' or 'false') .. ',"deleted":false}'
end
