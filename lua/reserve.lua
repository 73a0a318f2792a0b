-- reserve: move up to N ready payloads into a fresh reservation list and register the
-- reservation's deadline, atomically, so a consumer killed right after this call leaves
-- discoverable work (maintenance returns expired reservations to the ready list).
--
-- KEYS[1]  ready list              {ns}.queue.{q}
-- KEYS[2]  reservation registry    {ns}.reservations.{q}  (zset: reservation key -> deadline ms)
-- KEYS[3]  reservation list        {ns}.reservations.{q}.{token}  (fresh, normally absent)
-- ARGV[1]  n          how many payloads at most (1..1000)
-- ARGV[2]  lease_ms   the deadline, counted from the server's clock now
--
-- Returns the payloads in pop order (oldest first), the order they now have in the
-- reservation list; an empty array (and no registration) when the queue is empty.
-- Payloads are opaque here: they are never parsed.

local function wrong_type(key, expected)
  local actual = redis.call('TYPE', key)['ok']
  if actual ~= expected and actual ~= 'none' then
    return redis.error_reply('QSTYPE ' .. key .. ' is ' .. actual .. ', expected ' .. expected)
  end
end

local n = tonumber(ARGV[1])
local lease_ms = tonumber(ARGV[2])
if not n or n < 1 or n > 1000 or not lease_ms then
  return redis.error_reply('QSARG reserve needs 1 <= n <= 1000 and a lease in ms')
end

local err = wrong_type(KEYS[1], 'list') or wrong_type(KEYS[2], 'zset')
  or wrong_type(KEYS[3], 'list')
if err then return err end

local time = redis.call('TIME')
local deadline = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000) + lease_ms

local payloads = redis.call('RPOP', KEYS[1], n)
if not payloads then return {} end

redis.call('RPUSH', KEYS[3], unpack(payloads))
redis.call('ZADD', KEYS[2], string.format('%d', deadline), KEYS[3])
return payloads
