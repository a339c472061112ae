-- Hand one user message's turn to the agents, once. Two callers race for it: the gateway
-- that published the message (right after its publish) and the sweeper (when that gateway
-- died in between). Whichever comes first appends the inbox entry and arms the turn's
-- timeout; the other finds the turn in the handed set and does nothing. Either way the
-- outbox entry is gone afterwards. Every key is in the partition's slot.
--
-- KEYS[1] handed set: "chat turn_id" of turns handed off, by time (kept ARGV[6] ms)
-- KEYS[2] outbox: hand-offs yet to be done, by the time a sweeper may do them
-- KEYS[3] inbox stream, KEYS[4] turn deadlines
-- ARGV[1] "chat turn_id", ARGV[2] outbox member, ARGV[3] deadline (ms)
-- ARGV[4] inbox max length (approximate), ARGV[5] now (ms), ARGV[6] handed-set retention (ms)
-- ARGV[7..] the inbox entry: field, value, field, value, ...
-- Returns 1 when this call handed the turn off, 0 when it had been handed off already.

redis.call('ZREM', KEYS[2], ARGV[2])
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 0 end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', tonumber(ARGV[5]) - tonumber(ARGV[6]))
redis.call('ZADD', KEYS[1], ARGV[5], ARGV[1])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[4], '*', unpack(ARGV, 7))
redis.call('ZADD', KEYS[4], ARGV[3], ARGV[1])
return 1
