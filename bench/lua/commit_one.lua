-- Per-message settlement (the comparison of bench.settle_compare): commit ONE delivery if
-- the caller still owns it, as settle.lua's 'c' does for a group. Sent once per message,
-- many in one pipeline.
-- KEYS[1] processing list, KEYS[2] counter processing, KEYS[3] counter success,
-- KEYS[4] job record, KEYS[5] owner key; ARGV[1] owner token, ARGV[2] pid
if redis.call('GET', KEYS[5]) ~= ARGV[1] then return 'stale' end
redis.call('LREM', KEYS[1], -1, ARGV[2])
redis.call('DEL', KEYS[4], KEYS[5])
redis.call('DECRBY', KEYS[2], 1)
redis.call('INCRBY', KEYS[3], 1)
return 'ok'
