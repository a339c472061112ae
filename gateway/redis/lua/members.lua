-- Share a conversation: set or remove its members' roles, atomically.
-- gateway/redis/scripts.py (MembersScript) builds the arguments and decodes the reply.
-- The store puts meta.lua after lib.lua in front of it.
--
-- KEYS[1] meta hash
-- ARGV[1] room channel, ARGV[2] chat id
-- ARGV[3] writer: ":<user>", who must own the conversation ("" = a service)
-- ARGV[4] the most members it may have, ARGV[5] n: how many roles to set
-- ARGV[6 .. 5+2n] user, role ("member" or "viewer") pairs; then the users to remove
--
-- A member's role is meta field "role:<user>"; the owner has none (meta owner). Each user
-- removed who was a member gets a `removed` frame on the room's channel, marked
-- "-<user>" (gateway/redis/envelope.py): only their connections and streams take it. Then
-- every subscriber gets a `members` frame with the list after the change.
--
-- Replies {"owner", "members": {user: role} after, "users": the members after (sorted),
-- "removed": the users no longer members, "feed": the feed frame for everyone who has it
-- in their list, "gone": the feed frame for the removed, "updated_at"}, or {"error":
-- {"code", "message"}}.

local function refuse(code, message)
  return cjson.encode({error = {code = code, message = message}})
end

local m = load_meta(KEYS[1])
if not m then return refuse('not_found', 'conversation does not exist') end
local why = write_refused(m, ARGV[3])
if why then return refuse('forbidden', why == 'conversation belongs to another user'
  and why or 'only the owner may change who shares the conversation') end

local n = tonumber(ARGV[5])
local set, remove = {}, {}
for i = 0, n - 1 do
  local user, role = ARGV[6 + i * 2], ARGV[7 + i * 2]
  if user == m.owner then return refuse('invalid_request', 'the owner\'s role cannot change') end
  set[#set + 1] = {user, role}
end
for i = 6 + n * 2, #ARGV do
  if ARGV[i] == m.owner then return refuse('invalid_request', 'the owner cannot be removed') end
  remove[#remove + 1] = ARGV[i]
end

local removed = {}
for _, user in ipairs(remove) do
  if m['role:' .. user] then
    removed[#removed + 1] = user
    m['role:' .. user] = nil
  end
end
for _, pair in ipairs(set) do m['role:' .. pair[1]] = pair[2] end
local roles, users = members_of(m)
if #users > tonumber(ARGV[4]) then
  return refuse('invalid_request', 'a conversation has at most ' .. ARGV[4] .. ' members')
end
if #removed > 0 then
  local fields = {}
  for i, user in ipairs(removed) do fields[i] = 'role:' .. user end
  redis.call('HDEL', KEYS[1], unpack(fields))
end
if #set > 0 then
  local fields = {}
  for _, pair in ipairs(set) do
    fields[#fields + 1] = 'role:' .. pair[1]
    fields[#fields + 1] = pair[2]
  end
  redis.call('HSET', KEYS[1], unpack(fields))
end

local _, now_text = now_ms()
local chat = cjson.encode(ARGV[2])
for _, user in ipairs(removed) do
  redis.call('SPUBLISH', ARGV[1], '-' .. user .. '|||' ..
    '{"type":"removed","chat_id":' .. chat .. ',"user_id":' .. cjson.encode(user) ..
    ',"reason":"removed from the conversation by its owner","ts":' .. now_text .. '}')
end
redis.call('SPUBLISH', ARGV[1], envelope(nil, nil, nil, nil,
  '{"type":"members","chat_id":' .. chat .. ',"owner":' .. cjson.encode(m.owner) ..
  ',"members":' .. members_json(m) .. ',"ts":' .. now_text .. '}'))
local updated = m.updated_at or m.created_at
return cjson.encode({owner = m.owner, members = #users > 0 and roles or nil,
  users = #users > 0 and users or nil, removed = #removed > 0 and removed or nil,
  updated_at = tonumber(updated),
  feed = announce(ARGV[2], m, updated, false),
  gone = '{"type":"conversation","chat_id":' .. chat ..
    ',"title":null,"status":"idle","updated_at":' .. now_text .. ',"last_seq":' .. m.seq ..
    ',"goal_state":null,"preview":null,"created":false,"deleted":true,"removed":true}'})
