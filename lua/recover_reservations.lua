-- recover_reservations: return the payloads of expired reservations to the ready list.
--
-- KEYS[1]      ready list             {ns}.queue.{q}
-- KEYS[2]      reservation registry   {ns}.reservations.{q} (zset: list key -> deadline ms)
-- KEYS[3..N]   reservation lists      {ns}.reservations.{q}.{token} (at most 1,000)
-- ARGV[1]      max_items: stop before moving more payloads than this (capped at 1,000);
--              (the first reservation with payloads is always done, whatever its size)
--
-- The caller found the keys with ZRANGEBYSCORE some time ago. Each one is re-checked here,
-- atomically, against the server clock: a reservation that was renewed (deadline moved),
-- claimed or otherwise unregistered meanwhile is not touched.
--
-- A reservation list holds payloads in the order they were taken (index 0 first). They go
-- back to the consumer end (right) of the ready list so that they are taken next, the first
-- taken rightmost.
--
-- Returns {payloads moved, reservations done}.

local MAX_ITEMS = 1000
local ready, registry = KEYS[1], KEYS[2]

if #KEYS - 2 > MAX_ITEMS then
  return redis.error_reply('QSARGS at most ' .. MAX_ITEMS .. ' reservations per call')
end
local max_items = tonumber(ARGV[1])
if not max_items or max_items < 1 then
  return redis.error_reply('QSARGS max_items must be a positive number')
end
max_items = math.min(math.floor(max_items), MAX_ITEMS)

local function expect_type(key, expected)
  local actual = redis.call('TYPE', key)['ok']
  if actual ~= 'none' and actual ~= expected then
    return redis.error_reply('QSTYPE ' .. key .. ' is ' .. actual .. ', expected ' .. expected)
  end
end

-- Validate every key before the first write.
local bad = expect_type(ready, 'list') or expect_type(registry, 'zset')
if bad then return bad end
for i = 3, #KEYS do
  bad = expect_type(KEYS[i], 'list')
  if bad then return bad end
end

-- TIME is non-deterministic: older servers need effects replication switched on.
if redis.replicate_commands then redis.replicate_commands() end
local time = redis.call('TIME')
local now_ms = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)

local moved, done = 0, 0
for i = 3, #KEYS do
  local reservation = KEYS[i]
  local deadline = tonumber(redis.call('ZSCORE', registry, reservation))
  if deadline and deadline <= now_ms then
    local payloads = redis.call('LRANGE', reservation, 0, -1)
    if moved > 0 and moved + #payloads > max_items then break end
    -- Push the last taken first, so that the first taken ends up rightmost.
    for j = #payloads, 1, -1 do
      redis.call('RPUSH', ready, payloads[j])
    end
    redis.call('DEL', reservation)
    redis.call('ZREM', registry, reservation)
    moved = moved + #payloads
    done = done + 1
  end
end

return {moved, done}
