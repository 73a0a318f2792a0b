-- expired: list registered reservations whose deadline has passed (candidates only: the
-- recover script re-checks each deadline atomically before it moves anything).
--
-- KEYS[1]  reservation registry    {ns}.reservations.{q}
-- ARGV[1]  limit                   at most this many keys (<= 1000)
-- ARGV[2]  offset                  skip this many expired ones first (those a caller has
--                                  seen and left registered: reservations in their grace)
--
-- Deadlines are whole seconds (queue 5). A deadline of 10^11 or more is in milliseconds,
-- written by this project's previous format: it is expired once the clock in ms passes it.

-- The decimal digits of a whole number from low to high (2^31 - 1 at most: a count, a
-- lease or a TTL that EXPIRE, SETEX and ZADD all take), else nil. Checked before the first
-- write: Lua does not undo the writes made before a command that fails.
--- @include "includes/whole"

local limit, offset = whole(ARGV[1], 1, 1000), whole(ARGV[2] or '0', 0, 2147483647)
if not limit or not offset or #ARGV > 2 then
  return redis.error_reply('QSARG expired needs a limit of 1..1000 and an offset')
end
local actual = redis.call('TYPE', KEYS[1])['ok']
if actual ~= 'zset' and actual ~= 'none' then
  return redis.error_reply('QSTYPE ' .. KEYS[1] .. ' is ' .. actual .. ', expected zset')
end

local time = redis.call('TIME')
local now_ms = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local found = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', time[1], 'LIMIT', offset, limit)
if #found < limit then
  local old = redis.call('ZRANGEBYSCORE', KEYS[1], '100000000000',
    string.format('%d', now_ms), 'LIMIT', 0, limit - #found)
  for _, key in ipairs(old) do found[#found + 1] = key end
end
return found
