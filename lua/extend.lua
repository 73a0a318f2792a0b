-- extend: renew the claim (the lease) of each delivery this consumer still owns, as queue 5
-- does, and report per delivery whether it is still owned. With lease 0 the claims are
-- deleted instead (a consumer giving up its deliveries at exit). Only the owner key decides:
-- an expired claim does not revoke ownership, a recovery (which deletes the owner key) does.
--
-- The same call keeps this supervisor known to recovery (keys queue 5 never reads): its
-- record, with the lease as expiry (it is alive while the record exists), and its entry in
-- the token registry (the prefix every owner token of this supervisor starts with). An
-- owner whose prefix is registered but whose record is gone is ours and dead: recovery takes
-- its deliveries as soon as their claims are gone. With lease 0 the record goes and the
-- registry entry stays (its until set to now: alive no more), so whatever is still owned is
-- recovered at once.
--
-- KEYS[1]       this supervisor's record     {ns}.supervisors.{q}.{consumer id}
-- KEYS[2]       the token registry (hash)    {ns}.supervisor-tokens.{q}
-- KEYS[2i+1], KEYS[2i+2]   claims and owners key of delivery i   (i = 1..n, n <= 1000)
-- ARGV[1]       lease        seconds (0: delete the claims and the record)
-- ARGV[2]       record       the supervisor record's value
-- ARGV[3]       prefix       this supervisor's owner-token prefix (16 lowercase hex)
-- ARGV[4]       consumer id  (the registry entry is "<until> <consumer id>", until = server
--               unix seconds + lease: no delivery can become this supervisor's after that)
-- ARGV[4+i]     owner token of delivery i
--
-- Returns an array of n integers: 1 still owned, 0 stale (recovered or settled meanwhile).

local n = (#KEYS - 2) / 2
-- The decimal digits of a whole number from low to high (2^31 - 1 at most: a count, a
-- lease or a TTL that EXPIRE, SETEX and ZADD all take), else nil. Checked before the first
-- write: Lua does not undo the writes made before a command that fails.
--- @include "includes/whole"

local lease = whole(ARGV[1], 0, 2147483647)
if n ~= math.floor(n) or n > 1000 or #ARGV ~= 4 + n or not lease
    or not string.match(ARGV[3], '^%x+$') then
  return redis.error_reply('QSARG extend needs a lease in whole s, a token prefix, a claims '
    .. 'key, an owners key and a token each')
end
local kind = redis.call('TYPE', KEYS[2])['ok']
if kind ~= 'hash' and kind ~= 'none' then
  return redis.error_reply('QSTYPE ' .. KEYS[2] .. ' is ' .. kind .. ', expected hash')
end
-- Owner keys are only read (MGET: one of another type reads as stale); claims and the record
-- are replaced or deleted whatever their type, the registry's type was checked: no write can
-- fail halfway.
-- The registry entry's until is now + lease; at lease 0 an entry that exists ends now: a
-- supervisor that stopped is no longer counted alive (``check``, the metrics), and its entry
-- still names it ours. None is made at lease 0: a consumer that never renewed never made its
-- tokens known for ours, and its exit must not (queue 5's rule keeps applying to them).
local now = tonumber(redis.call('TIME')[1])
if lease > 0 then
  redis.call('SET', KEYS[1], ARGV[2], 'EX', lease)
  redis.call('HSET', KEYS[2], ARGV[3], string.format('%d %s', now + lease, ARGV[4]))
else
  redis.call('DEL', KEYS[1])
  if redis.call('HMGET', KEYS[2], ARGV[3])[1] then
    redis.call('HSET', KEYS[2], ARGV[3], string.format('%d %s', now, ARGV[4]))
  end
end
local owned = {}
if n == 0 then return owned end
local owner_keys = {}
for i = 1, n do owner_keys[i] = KEYS[2 * i + 2] end
local owners = redis.call('MGET', unpack(owner_keys))
for i = 1, n do
  local token = ARGV[4 + i]
  if owners[i] == token then
    owned[i] = 1
    if lease > 0 then
      redis.call('SET', KEYS[2 * i + 1], token, 'EX', lease)
    else
      redis.call('DEL', KEYS[2 * i + 1])
    end
  else
    owned[i] = 0
  end
end
return owned
