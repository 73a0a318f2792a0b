-- extend: renew the claim (the lease) of each delivery this consumer still owns, as queue 5
-- does, and report per delivery whether it is still owned. With lease 0 the claims are
-- deleted instead (a consumer giving up its deliveries at exit, so that recovery takes them
-- at once rather than after the lease). Only the owner key decides: an expired claim does
-- not revoke ownership, a recovery (which deletes the owner key) does.
--
-- KEYS[1]       this supervisor's record  {ns}.supervisors.{q}.{consumer id}: informational
--               (for `status`); queue 5 never reads it and recovery does not depend on it
-- KEYS[2i], KEYS[2i+1]   claims and owners key of delivery i   (i = 1..n, n <= 1000)
-- ARGV[1]       lease        seconds (0: delete the claims and the record)
-- ARGV[2]       record       the supervisor record's value
-- ARGV[2+i]     owner token of delivery i
--
-- Returns an array of n integers: 1 still owned, 0 stale (recovered or settled meanwhile).

local n = (#KEYS - 1) / 2
-- The decimal digits of a whole number from low to high (2^31 - 1 at most: a count, a
-- lease or a TTL that EXPIRE, SETEX and ZADD all take), else nil. Checked before the first
-- write: Lua does not undo the writes made before a command that fails.
local function whole(value, low, high)
  local number = value and #value <= 10 and string.match(value, '^%d+$') and tonumber(value)
  if number and number >= low and number <= high then return number end
end

local lease = whole(ARGV[1], 0, 2147483647)
if n ~= math.floor(n) or n > 1000 or #ARGV ~= 2 + n or not lease then
  return redis.error_reply('QSARG extend needs a lease in whole s, a claims key, an owners key '
    .. 'and a token each')
end
-- Owner keys are only read (MGET: one of another type reads as stale); claims and the record
-- are replaced or deleted whatever their type, so no write can fail halfway.
if lease > 0 then
  redis.call('SET', KEYS[1], ARGV[2], 'EX', lease)
else
  redis.call('DEL', KEYS[1])
end
local owned = {}
if n == 0 then return owned end
local owner_keys = {}
for i = 1, n do owner_keys[i] = KEYS[2 * i + 1] end
local owners = redis.call('MGET', unpack(owner_keys))
for i = 1, n do
  local token = ARGV[2 + i]
  if owners[i] == token then
    owned[i] = 1
    if lease > 0 then
      redis.call('SET', KEYS[2 * i], token, 'EX', lease)
    else
      redis.call('DEL', KEYS[2 * i])
    end
  else
    owned[i] = 0
  end
end
return owned
