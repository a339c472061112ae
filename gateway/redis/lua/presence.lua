-- Who is connected to a conversation now: change the list, drop what lapsed, and tell the
-- room (gateway/redis/presence.py builds the call; gateway/presence.py decides when a
-- frame may go out).
--
-- KEYS[1] c:{chat}:presence    sorted set, one member per connection ("u:<user>:<conn>")
--                              or agent worker ("a:<agent>:<worker>"), scored by the time
--                              (ms, this server's clock) it lapses unless renewed
-- KEYS[2] c:{chat}:presence:v  the list's version
-- ARGV[1] ttl: ms an entry added or renewed lives
-- ARGV[2] the room's channel
-- ARGV[3] chat id
-- ARGV[4] "0": publish nothing; "1": publish the list if it changed; "2": publish it
-- ARGV[5] n: the next n arguments are entries to add or renew; the rest, entries to remove
--
-- Replies {1 if the list changed else 0, the presence frame (JSON)}. The version only
-- grows (a change makes it max(version + 1, now)), also across the keys' expiry, so a
-- client keeps the frame with the highest one.

local now, now_text = now_ms()
local ttl = tonumber(ARGV[1])
local changed = redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now) > 0
local adds = tonumber(ARGV[5])
for i = 6, 5 + adds do
  if redis.call('ZADD', KEYS[1], now + ttl, ARGV[i]) == 1 then changed = true end
end
for i = 6 + adds, #ARGV do
  if redis.call('ZREM', KEYS[1], ARGV[i]) == 1 then changed = true end
end
local stored = redis.call('GET', KEYS[2])
local version = tonumber(stored or '0')
local keep = math.max(4 * ttl, 60000)
if changed or not stored then
  version = math.max(version + 1, now)
  redis.call('SET', KEYS[2], string.format('%d', version), 'PX', keep)
elseif adds > 0 then
  redis.call('PEXPIRE', KEYS[2], keep)
end
if adds > 0 then
  redis.call('PEXPIRE', KEYS[1], ttl)  -- gone once every entry would have lapsed
end

local users, agents, user_names, agent_names = {}, {}, {}, {}
for _, member in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local kind, name = string.match(member, '^(%a):([^:]*):')
  if kind == 'u' then
    if not users[name] then users[name] = 0; user_names[#user_names + 1] = name end
    users[name] = users[name] + 1
  elseif kind == 'a' then
    if not agents[name] then agents[name] = 0; agent_names[#agent_names + 1] = name end
    agents[name] = agents[name] + 1
  end
end
table.sort(user_names)
table.sort(agent_names)
local parts = {}
for i, name in ipairs(user_names) do
  parts[i] = '{"user_id":' .. cjson.encode(name) .. ',"connections":' .. users[name] .. '}'
end
local agent_parts = {}
for i, name in ipairs(agent_names) do
  agent_parts[i] = '{"name":' .. cjson.encode(name) .. ',"workers":' .. agents[name] .. '}'
end
local frame = '{"type":"presence","chat_id":' .. cjson.encode(ARGV[3]) .. ',"v":'
  .. string.format('%d', version) .. ',"ts":' .. now_text .. ',"users":['
  .. table.concat(parts, ',') .. '],"agents":[' .. table.concat(agent_parts, ',') .. ']}'
if ARGV[4] == '2' or (ARGV[4] == '1' and changed) then
  -- Marked (gateway/redis/envelope.py): sessions drop a list older than the one they sent.
  redis.call('SPUBLISH', ARGV[2], '!' .. string.format('%d', version) .. '|||' .. frame)
end
return {changed and 1 or 0, frame}
