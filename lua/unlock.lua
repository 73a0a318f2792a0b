-- unlock: delete a lock only if it is still held by the caller (compare-and-delete).
--
-- KEYS[1]   lock key (string), e.g. {ns}.reap-lock.{q}
-- ARGV[1]   the holder value the caller SET it to
--
-- A lock that expired and was taken by someone else is left alone.
-- Returns 1 if the lock was deleted, 0 otherwise.

local lock, holder = KEYS[1], ARGV[1]
local actual = redis.call('TYPE', lock)['ok']
if actual ~= 'none' and actual ~= 'string' then
  return redis.error_reply('QSTYPE ' .. lock .. ' is ' .. actual .. ', expected string')
end
if redis.call('GET', lock) == holder then
  return redis.call('DEL', lock)
end
return 0
