-- reserve: move up to N ready payloads into a fresh reservation list and register it, as
-- queue 5 does, so that a consumer killed right after this call leaves discoverable work.
-- With nothing ready and a blocking timeout, the (empty) reservation is registered anyway:
-- the caller then blocks with BLMOVE into it, and a payload moved there is discoverable even
-- if the caller dies before it sees the reply.
--
-- KEYS[1]  ready list              {ns}.queue.{q}
-- KEYS[2]  reservation registry    {ns}.reservations.{q}  (zset: reservation key -> deadline)
-- KEYS[3]  reservation list        {ns}.reservations.{q}.{token}  (fresh, normally absent)
-- KEYS[4]  poison list             {ns}.poison.{q}  (needed with a size limit)
-- KEYS[5]  poison reasons (hash)   {ns}.supervisor-poison-reasons.{q}  (idem)
-- KEYS[6]  poison times (zset)     {ns}.supervisor-poison-times.{q}  (idem)
-- ARGV[1]  n           how many payloads at most (1..1000)
-- ARGV[2]  lease       seconds
-- ARGV[3]  timeout     whole seconds the caller will block for if nothing is ready (0: none)
-- ARGV[4]  limit       bytes: a longer payload goes straight to poison (0 or absent: none)
--
-- The deadline is whole seconds of the server clock: now + lease + timeout (queue 5's unit).
-- The reservation list holds the most recently taken payload at its head (as RPOPLPUSH
-- leaves it); the reply lists the payloads in the order they were taken (oldest first).
-- Payloads are opaque here: they are never parsed. One longer than the limit is not
-- reserved: it is LPUSHed to poison as it is (what a PHP worker does with a payload it
-- cannot decode), and the reply has its length (an integer) in its place, so that it never
-- crosses the wire; why is kept by the SHA1 of its bytes (this project's reason store, as
-- claim.lua keeps it). The n payloads are taken in one RPOP (one command per payload cost a
-- reserve of 100 twice the server time: 140 us against 71); the script holds them all, as
-- it must hold the reserved ones for their LPUSH anyway.

--- @include "includes/wrong_type"

-- The decimal digits of a whole number from low to high (2^31 - 1 at most: a count, a
-- lease or a TTL that EXPIRE, SETEX and ZADD all take), else nil. Checked before the first
-- write: Lua does not undo the writes made before a command that fails.
--- @include "includes/whole"

-- Keep why each poisoned payload is poison, by the SHA1 of its bytes, with the time; beyond
-- the 1,000 newest, the oldest go (at most as many as were just added).
--- @include "includes/remember_poison"

local MAX_TTL = 2147483647
local n, lease = whole(ARGV[1], 1, 1000), whole(ARGV[2], 1, MAX_TTL)
local timeout = whole(ARGV[3], 0, MAX_TTL)
local limit = whole(ARGV[4] or '0', 0, 2147483647)
if not n or not lease or not timeout or not limit or #ARGV > 4
    or (limit > 0 and not KEYS[6]) then
  return redis.error_reply('QSARG reserve needs 1 <= n <= 1000, a lease and a timeout in whole s '
    .. 'and a size limit in bytes (with the poison list and reason store)')
end

local err = wrong_type(KEYS[1], 'list') or wrong_type(KEYS[2], 'zset')
  or wrong_type(KEYS[3], 'list') or (KEYS[4] and wrong_type(KEYS[4], 'list'))
  or (limit > 0 and (wrong_type(KEYS[5], 'hash') or wrong_type(KEYS[6], 'zset')))
if err then return err end

local now = tonumber(redis.call('TIME')[1])
local reply, payloads, oversized, why = {}, {}, {}, {}
local taken = redis.call('RPOP', KEYS[1], n) or {}
for i = 1, #taken do
  local raw = taken[i]
  if limit > 0 and #raw > limit then
    redis.call('LPUSH', KEYS[4], raw)
    oversized[#oversized + 1] = raw
    why[#why + 1] = 'envelope of ' .. #raw .. ' bytes exceeds ' .. limit
      .. ': moved to poison unread'
    reply[i] = #raw
  else
    payloads[#payloads + 1] = raw
    reply[i] = raw
  end
end
if #oversized > 0 then remember_poison(KEYS[5], KEYS[6], now, oversized, why) end
if #payloads > 0 then
  redis.call('LPUSH', KEYS[3], unpack(payloads))
end
if #payloads > 0 or (#reply == 0 and timeout > 0) then
  redis.call('ZADD', KEYS[2], string.format('%d', now + lease + timeout), KEYS[3])
end
return reply
