-- records: job records as MGET reads them, except that one longer than the limit is
-- answered with its length only, so that an oversized record (a PHP worker accepts any
-- size) never crosses the wire for a sweep or an operator's retry. Read only.
--
-- KEYS[i]  job record              {ns}.jobs.{q}.{pid}   (i = 1..n, n <= 1000)
-- ARGV[1]  limit                   bytes (1 .. 2^31 - 1)
--
-- Returns n items: the record, its length (an integer) when it is longer than the limit,
-- or nil when there is none (or the key holds another type, as MGET reads it).

-- The decimal digits of a whole number from low to high (2^31 - 1 at most: a count, a
-- lease or a TTL that EXPIRE, SETEX and ZADD all take), else nil. Checked before the first
-- write: Lua does not undo the writes made before a command that fails.
--- @include "includes/whole"

local limit = whole(ARGV[1], 1, 2147483647)
if not limit or #ARGV ~= 1 or #KEYS > 1000 then
  return redis.error_reply('QSARG records needs at most 1000 keys and a limit in bytes')
end
local found = {}
for i = 1, #KEYS do
  found[i] = false
  if redis.call('TYPE', KEYS[i])['ok'] == 'string' then
    local length = redis.call('STRLEN', KEYS[i])
    if length > limit then
      found[i] = length
    else
      found[i] = redis.call('GET', KEYS[i])
    end
  end
end
return found
