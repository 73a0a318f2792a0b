-- expired: list registered reservations whose deadline has passed (candidates only: the
-- recover script re-checks each deadline atomically before it moves anything).
--
-- KEYS[1]  reservation registry    {ns}.reservations.{q}
-- ARGV[1]  limit                   at most this many keys (<= 1000)
--
-- Deadlines are whole seconds (queue 5). A deadline of 10^11 or more is in milliseconds,
-- written by this project's previous format: it is expired once the clock in ms passes it.

local limit = tonumber(ARGV[1])
if not limit or limit < 1 or limit > 1000 then
  return redis.error_reply('QSARG expired needs a limit of 1..1000')
end
local actual = redis.call('TYPE', KEYS[1])['ok']
if actual ~= 'zset' and actual ~= 'none' then
  return redis.error_reply('QSTYPE ' .. KEYS[1] .. ' is ' .. actual .. ', expected zset')
end

local time = redis.call('TIME')
local now_ms = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local found = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', time[1], 'LIMIT', 0, limit)
if #found < limit then
  local old = redis.call('ZRANGEBYSCORE', KEYS[1], '100000000000',
    string.format('%d', now_ms), 'LIMIT', 0, limit - #found)
  for _, key in ipairs(old) do found[#found + 1] = key end
end
return found
