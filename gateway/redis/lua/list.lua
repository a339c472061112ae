-- A run of one user's conversation list, read from a place in its walk.
-- gateway/redis/scripts.py (ListScript) builds the arguments and decodes the reply.
--
-- The walk goes newest change first, and within one millisecond by chat id descending
-- (the sorted set's own order, reversed), so a place (score, chat id) stays put while other
-- entries move.
--
-- KEYS[1] the list: {u:<user>}:convs
-- ARGV[1] the place's score ("" = from the top)   ARGV[2] the place's chat id ("": every
--         entry of that score is past)
-- ARGV[3] the lowest score kept ("-inf" for all)  ARGV[4] most entries to reply
-- Replies {"rows": [[chat id, score], ...]} in walk order, the entries strictly after the
-- place (scores as strings: cjson would round them).

local key, at, after, low, count = KEYS[1], ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local floor = low ~= '-inf' and tonumber(low) or nil
local rows = {}

local function take(flat)
  for i = 1, #flat, 2 do
    if #rows == count or (floor and tonumber(flat[i + 1]) < floor) then return end
    rows[#rows + 1] = {flat[i], flat[i + 1]}
  end
end

-- a < b as the sorted set orders members: bytewise (Lua's < follows the server's locale).
local function below(a, b)
  for i = 1, math.min(#a, #b) do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then return x < y end
  end
  return #a < #b
end

if at == '' then
  take(redis.call('ZREVRANGEBYSCORE', key, '+inf', low, 'WITHSCORES', 'LIMIT', 0, count))
else
  local score = after ~= '' and redis.call('ZSCORE', key, after)
  if score and tonumber(score) == tonumber(at) then
    -- The place's own entry has not moved: the entries after it by rank.
    local rank = redis.call('ZREVRANK', key, after)
    take(redis.call('ZREVRANGE', key, rank + 1, rank + count, 'WITHSCORES'))
  else
    if after ~= '' then  -- the rest of the place's millisecond: its chat ids below
      local tied = redis.call('ZREVRANGEBYSCORE', key, at, at, 'WITHSCORES')
      local rest = {}
      for i = 1, #tied, 2 do
        if below(tied[i], after) then rest[#rest + 1] = tied[i]; rest[#rest + 1] = tied[i + 1] end
      end
      take(rest)
    end
    if #rows < count then
      take(redis.call('ZREVRANGEBYSCORE', key, '(' .. at, low, 'WITHSCORES', 'LIMIT', 0,
                      count - #rows))
    end
  end
end

if #rows == 0 then return '{}' end
return cjson.encode({rows = rows})
