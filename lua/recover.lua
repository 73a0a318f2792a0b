-- recover: return the payloads of expired reservations to the ready list, as queue 5 does.
--
-- KEYS[1]      reservation registry   {ns}.reservations.{q}
-- KEYS[2]      ready list             {ns}.queue.{q}
-- KEYS[3..]    reservation lists      {ns}.reservations.{q}.{token} (at most 1,000)
-- ARGV[1]      limit                  payloads moved at most (<= 1000)
--
-- The caller found the keys some time ago (expired.lua). Each deadline is re-checked here
-- against the server clock: a reservation claimed (unregistered) meanwhile is not touched.
-- Payloads leave from the head (the most recently taken) and go to the consumer end, so the
-- first taken is consumed first again. A reservation is unregistered once it is empty; one
-- cut short by the limit stays registered (and expired) for the next call.
-- Deadlines of 10^11 and more are milliseconds (this project's previous format).
--
-- Returns the number of payloads moved.

local registry, ready = KEYS[1], KEYS[2]
-- The decimal digits of a whole number from low to high (2^31 - 1 at most: a count, a
-- lease or a TTL that EXPIRE, SETEX and ZADD all take), else nil. Checked before the first
-- write: Lua does not undo the writes made before a command that fails.
local function whole(value, low, high)
  local number = #value <= 10 and string.match(value, '^%d+$') and tonumber(value)
  if number and number >= low and number <= high then return number end
end

local limit = whole(ARGV[1], 1, 1000)
if #KEYS - 2 > 1000 or not limit then
  return redis.error_reply('QSARG recover needs at most 1000 reservations and a limit <= 1000')
end

local function wrong_type(key, expected)
  local actual = redis.call('TYPE', key)['ok']
  if actual ~= expected and actual ~= 'none' then
    return redis.error_reply('QSTYPE ' .. key .. ' is ' .. actual .. ', expected ' .. expected)
  end
end

local err = wrong_type(registry, 'zset') or wrong_type(ready, 'list')
if err then return err end
for i = 3, #KEYS do
  err = wrong_type(KEYS[i], 'list')
  if err then return err end
end

local time = redis.call('TIME')
local now, now_ms = tonumber(time[1]), tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local moved = 0
for i = 3, #KEYS do
  if moved >= limit then break end
  local reservation = KEYS[i]
  local deadline = tonumber(redis.call('ZSCORE', registry, reservation))
  if deadline and (deadline <= now or (deadline >= 1e11 and deadline <= now_ms)) then
    local payloads = redis.call('LPOP', reservation, limit - moved)
    if payloads then
      redis.call('RPUSH', ready, unpack(payloads))
      moved = moved + #payloads
    end
    if redis.call('LLEN', reservation) == 0 then
      redis.call('ZREM', registry, reservation)
    end
  end
end
return moved
