-- promote: move retries whose backoff is over from the delayed set to the ready list, at
-- its producer end (as an immediate retry is LPUSHed), the earliest due consumed first.
-- One atomic step per call: ZRANGEBYSCORE then ZREM and LPUSH of exactly what was read, so
-- two supervisors promoting at once never move one envelope twice (the second finds it
-- gone). 'all' moves every envelope whatever its due time: the rollback to PHP workers,
-- which never read the set, empties it this way (drain).
--
-- KEYS[1]   delayed retries (zset)  {ns}.supervisor-delayed.{q}  envelope -> due (unix s)
-- KEYS[2]   ready list              {ns}.queue.{q}
-- ARGV[1]   limit                   envelopes moved at most (1 .. 1000)
-- ARGV[2]   which                   'due' (score <= TIME) or 'all'
--
-- Returns how many envelopes were moved.

local function wrong_type(key, expected)
  local actual = redis.call('TYPE', key)['ok']
  if actual ~= expected and actual ~= 'none' then
    return redis.error_reply('QSTYPE ' .. key .. ' is ' .. actual .. ', expected ' .. expected)
  end
end

-- The decimal digits of a whole number from low to high (2^31 - 1 at most: a count, a
-- lease or a TTL that EXPIRE, SETEX and ZADD all take), else nil. Checked before the first
-- write: Lua does not undo the writes made before a command that fails.
local function whole(value, low, high)
  local number = value and #value <= 10 and string.match(value, '^%d+$') and tonumber(value)
  if number and number >= low and number <= high then return number end
end

local delayed, ready = KEYS[1], KEYS[2]
local limit, which = whole(ARGV[1], 1, 1000), ARGV[2]
if #KEYS ~= 2 or #ARGV ~= 2 or not limit or (which ~= 'due' and which ~= 'all') then
  return redis.error_reply('QSARG promote needs 2 keys, a limit of 1 to 1000 and due or all')
end
local err = wrong_type(delayed, 'zset') or wrong_type(ready, 'list')
if err then return err end

local upto = '+inf'
if which == 'due' then upto = redis.call('TIME')[1] end
local due = redis.call('ZRANGEBYSCORE', delayed, '-inf', upto, 'LIMIT', 0, limit)
if #due == 0 then return 0 end
redis.call('ZREM', delayed, unpack(due))
redis.call('LPUSH', ready, unpack(due))
return #due
