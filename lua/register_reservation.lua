-- register_reservation: register an (empty) reservation list before a blocking move into it,
-- so that a consumer killed right after the move leaves discoverable work.
--
-- KEYS[1]  reservation registry    {ns}.reservations.{q}  (zset: reservation key -> deadline ms)
-- KEYS[2]  reservation list        {ns}.reservations.{q}.{token}  (fresh, normally absent)
-- ARGV[1]  timeout_ms   the blocking timeout plus a safety margin, from the server's clock now
--
-- Returns the deadline (ms of the server's clock).

local function wrong_type(key, expected)
  local actual = redis.call('TYPE', key)['ok']
  if actual ~= expected and actual ~= 'none' then
    return redis.error_reply('QSTYPE ' .. key .. ' is ' .. actual .. ', expected ' .. expected)
  end
end

local timeout_ms = tonumber(ARGV[1])
if not timeout_ms or timeout_ms < 0 then
  return redis.error_reply('QSARG register_reservation needs a timeout in ms')
end

local err = wrong_type(KEYS[1], 'zset') or wrong_type(KEYS[2], 'list')
if err then return err end

local time = redis.call('TIME')
local deadline = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000) + timeout_ms
redis.call('ZADD', KEYS[1], string.format('%d', deadline), KEYS[2])
return deadline
