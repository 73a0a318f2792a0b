-- recover: return the payloads of expired reservations to the ready list, as queue 5 does.
--
-- KEYS[1]      reservation registry   {ns}.reservations.{q}
-- KEYS[2]      ready list             {ns}.queue.{q}
-- KEYS[3..]    reservation lists      {ns}.reservations.{q}.{token} (at most 1,000)
-- ARGV[1]      limit                  payloads moved at most (<= 1000)
-- ARGV[2]      grace                  seconds an expired EMPTY reservation stays registered
--                                     past its deadline (0 or absent: none, as queue 5;
--                                     9999999999: whatever its deadline)
--
-- The caller found the keys some time ago (expired.lua). Each deadline is re-checked here
-- against the server clock: a reservation claimed (unregistered) meanwhile is not touched.
-- Payloads leave from the head (the most recently taken) and go to the consumer end, so the
-- first taken is consumed first again. A reservation emptied here is unregistered; one cut
-- short by the limit stays registered (and expired) for the next call.
-- One found empty stays registered until `grace` seconds past its deadline: it may be the
-- blocking receive of a consumer frozen between registering it and sending its blocking
-- move (BRPOPLPUSH, BLMOVE). That move may still land; while the list is registered the
-- next call returns what landed (and the consumer's claim refuses the expired reservation).
-- Unregistered at once, the list would hold the payload with nothing naming it. A single
-- blocking move is all such a consumer sends, so a list something was moved out of is done.
-- Deadlines of 10^11 and more are milliseconds (this project's previous format).
--
-- Returns {moved, kept}: the payloads moved, and how many of the reservations given are
-- still registered and expired (in their grace, or cut short by the limit).

local registry, ready = KEYS[1], KEYS[2]
-- The decimal digits of a whole number from low to high (2^31 - 1 at most: a count, a
-- lease or a TTL that EXPIRE, SETEX and ZADD all take), else nil. Checked before the first
-- write: Lua does not undo the writes made before a command that fails.
--- @include "includes/whole"

local limit, grace = whole(ARGV[1], 1, 1000), whole(ARGV[2] or '0', 0, 9999999999)
if #KEYS - 2 > 1000 or not limit or not grace or #ARGV > 2 then
  return redis.error_reply('QSARG recover needs at most 1000 reservations, a limit <= 1000 '
    .. 'and a grace in whole s')
end

--- @include "includes/wrong_type"

local err = wrong_type(registry, 'zset') or wrong_type(ready, 'list')
if err then return err end
for i = 3, #KEYS do
  err = wrong_type(KEYS[i], 'list')
  if err then return err end
end

local time = redis.call('TIME')
local now, now_ms = tonumber(time[1]), tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local moved, kept = 0, 0
for i = 3, #KEYS do
  local reservation = KEYS[i]
  local deadline = tonumber(redis.call('ZSCORE', registry, reservation))
  local ms = deadline and deadline >= 1e11
  if deadline and ((not ms and deadline <= now) or (ms and deadline <= now_ms)) then
    local payloads = moved < limit and redis.call('LPOP', reservation, limit - moved)
    if payloads then
      redis.call('RPUSH', ready, unpack(payloads))
      moved = moved + #payloads
    end
    local past = (ms and deadline <= now_ms - grace * 1000)
      or (not ms and deadline <= now - grace)
    if redis.call('LLEN', reservation) == 0 and (payloads or past) then
      redis.call('ZREM', registry, reservation)
    else
      kept = kept + 1
    end
  end
end
return {moved, kept}
