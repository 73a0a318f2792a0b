-- extend: renew this consumer's heartbeat (one write however many deliveries are
-- outstanding) and report, per delivery, whether this consumer still owns it.
--
-- KEYS[1]    consumer heartbeat     {ns}.consumers.{q}.{consumer id}
-- KEYS[1+i]  owner of delivery i    {ns}.owners.{q}.{pid}            (i = 1..n, n <= 1000)
-- ARGV[1]    lease_ms      heartbeat lifetime
-- ARGV[2]    consumer id   the heartbeat's value
-- ARGV[2+i]  owner token of delivery i
--
-- Returns an array of n integers: 1 still owned, 0 stale (recovered or settled meanwhile).
-- Owner keys are only read (MGET): a key of another type reads as absent, i.e. stale.

local n = #KEYS - 1
if n > 1000 or #ARGV ~= 2 + n then
  return redis.error_reply('QSARG extend needs one token per owner key, at most 1000')
end

local actual = redis.call('TYPE', KEYS[1])['ok']
if actual ~= 'string' and actual ~= 'none' then
  return redis.error_reply('QSTYPE ' .. KEYS[1] .. ' is ' .. actual .. ', expected string')
end

redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[1])
if n == 0 then return {} end

local owners = redis.call('MGET', unpack(KEYS, 2))
local owned = {}
for i = 1, n do
  owned[i] = (owners[i] == ARGV[2 + i]) and 1 or 0
end
return owned
