-- claim: turn a registered, unexpired reservation into owned deliveries, as queue 5 does:
-- per delivery a job record (no TTL), an owner key with the reservation's token (the
-- receipt) and a claim key with the same token and the lease as its expiry (liveness).
-- Python decoded the payloads it got from reserve; this script re-reads them from the
-- reservation list (the bytes are not sent again). Per payload, in the order taken:
--   good ('g'):   owner key absent -> job record, owner, claim, LPUSH pid to processing:
--                 'ok'. Owner key present (the pid is being processed already, or repeats
--                 in this batch) -> the payload goes back to the producer end of the ready
--                 list, to wait behind the rest until the first delivery settles: 'deferred'.
--   poison ('p'): LPUSH the raw bytes to poison: 'poison' (counted in no counter). The
--                 poison list holds the bytes only, as queue 5 has it; why (Python's reason)
--                 is kept beside it, by the SHA1 of the bytes, in this project's bounded
--                 reason store (the hash and sorted set below: the 1,000 newest).
-- total and processing grow by the deliveries made; the reservation is removed.
--
-- A reservation that is no longer registered or whose deadline passed is not claimed: what
-- it still holds goes back to the consumer end of the ready list (first taken rightmost)
-- and it is removed, so that no list is ever left that no registry names (a late blocking
-- move into a reservation already recovered lands here). Reply {'expired', moved}.
-- A reservation whose length differs from the count expected is left alone: 'mismatch'.
--
-- KEYS[1]   reservation registry    {ns}.reservations.{q}
-- KEYS[2]   reservation list        {ns}.reservations.{q}.{token}
-- KEYS[3]   ready list              {ns}.queue.{q}
-- KEYS[4]   processing list         {ns}.processing.{q}
-- KEYS[5]   poison list             {ns}.poison.{q}
-- KEYS[6]   counter                 {ns}.stats.{q}.total
-- KEYS[7]   counter                 {ns}.stats.{q}.processing
-- KEYS[8]   poison reasons (hash)   {ns}.supervisor-poison-reasons.{q}
-- KEYS[9]   poison times (zset)     {ns}.supervisor-poison-times.{q}
-- KEYS[7+3g], KEYS[8+3g], KEYS[9+3g]   jobs, claims, owners key of the g-th good payload
-- ARGV[1]   lease                   seconds (the claim keys' expiry)
-- ARGV[2]   token                   32 hex: the reservation's token, the owner of all
-- ARGV[3]   n                       payloads expected in the reservation (<= 1000)
-- ARGV[4]   kinds                   n characters, payload i (in the order taken) is
--                                   'g' (good) or 'p' (poison)
-- ARGV[5]   pid offset              length of the jobs keys' common prefix: a good
--                                   payload's pid is its jobs key after it
-- ARGV[5+p]                         why the p-th poison payload is poison (text)
-- (The pids are read from the jobs keys, not sent again: nothing is built from them.)
--
-- Returns {'expired', moved}, 'mismatch', or n results: 'ok', 'deferred' or 'poison'.

--- @include "includes/wrong_type"

-- What INCRBY accepts, with room left for adding a batch.
--- @include "includes/bad_counter"

-- The decimal digits of a whole number from low to high (2^31 - 1 at most: a count, a
-- lease or a TTL that EXPIRE, SETEX and ZADD all take), else nil. Checked before the first
-- write: Lua does not undo the writes made before a command that fails.
--- @include "includes/whole"

-- Keep why each poisoned payload is poison, by the SHA1 of its bytes, with the time; beyond
-- the 1,000 newest, the oldest go (at most as many as were just added).
--- @include "includes/remember_poison"

local registry, reservation, ready, processing = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local n, kinds, offset = whole(ARGV[3], 0, 1000), ARGV[4], whole(ARGV[5], 0, 2147483647)
local lease = whole(ARGV[1], 1, 2147483647)
local goods = (#KEYS - 9) / 3
local _, poisons = string.gsub(kinds or '', 'p', 'p')
if not n or not lease or #ARGV ~= 5 + poisons or not kinds or #kinds ~= n or not offset
    or string.find(kinds, '[^gp]') or goods ~= math.floor(goods) or goods < 0 then
  return redis.error_reply('QSARG claim needs a lease in whole s, a kind per payload (g or p), '
    .. 'at most 1000, a pid offset and a reason per poison payload')
end

local err = wrong_type(registry, 'zset') or wrong_type(reservation, 'list')
  or wrong_type(ready, 'list') or wrong_type(processing, 'list') or wrong_type(KEYS[5], 'list')
  or bad_counter(KEYS[6]) or bad_counter(KEYS[7])
  or (poisons > 0 and (wrong_type(KEYS[8], 'hash') or wrong_type(KEYS[9], 'zset')))
if err then return err end
local _, good_kinds = string.gsub(kinds, 'g', 'g')
if good_kinds ~= goods then
  return redis.error_reply('QSARG claim needs jobs, claims and owners keys per good payload')
end

local deadline = tonumber(redis.call('ZSCORE', registry, reservation))
local now = tonumber(redis.call('TIME')[1])
if not deadline or deadline <= now then
  local left = redis.call('LPOP', reservation, 1000)
  if left then redis.call('RPUSH', ready, unpack(left)) end
  redis.call('DEL', reservation)
  redis.call('ZREM', registry, reservation)
  return {'expired', left and #left or 0}
end

local stored = redis.call('LRANGE', reservation, 0, -1)
if #stored ~= n then return 'mismatch' end

-- Owner keys are only read (MGET: one of another type reads as absent) and then written
-- with MSET and SET, which replace a key of any type: no write can fail halfway.
local owned = {}
if goods > 0 then
  local owner_keys = {}
  for g = 1, goods do owner_keys[g] = KEYS[9 + 3 * g] end
  local owners = redis.call('MGET', unpack(owner_keys))
  for g = 1, goods do
    if owners[g] then owned[owner_keys[g]] = true end
  end
end

local results, records, pids, poisoned, deferred = {}, {}, {}, {}, {}
local nrecords, npids = 0, 0
local token = ARGV[2]
local g = 0
for i = 1, n do
  local raw = stored[n + 1 - i]  -- the list holds the most recently taken at its head
  if string.byte(kinds, i) == 103 then  -- 'g'
    g = g + 1
    local at = 6 + 3 * g
    local owner_key = KEYS[at + 3]
    if owned[owner_key] then
      deferred[#deferred + 1] = raw
      results[i] = 'deferred'
    else
      owned[owner_key] = true
      local job_key = KEYS[at + 1]
      records[nrecords + 1] = job_key
      records[nrecords + 2] = raw
      records[nrecords + 3] = owner_key
      records[nrecords + 4] = token
      nrecords = nrecords + 4
      redis.call('SETEX', KEYS[at + 2], lease, token)
      npids = npids + 1
      pids[npids] = string.sub(job_key, offset + 1)
      results[i] = 'ok'
    end
  else
    poisoned[#poisoned + 1] = raw
    results[i] = 'poison'
  end
end
if npids > 0 then
  redis.call('MSET', unpack(records))
  redis.call('LPUSH', processing, unpack(pids))
  redis.call('INCRBY', KEYS[6], npids)
  redis.call('INCRBY', KEYS[7], npids)
end
if #poisoned > 0 then
  redis.call('LPUSH', KEYS[5], unpack(poisoned))
  local why = {}
  for p = 1, #poisoned do why[p] = ARGV[5 + p] end
  remember_poison(KEYS[8], KEYS[9], now, poisoned, why)
end
if #deferred > 0 then redis.call('LPUSH', ready, unpack(deferred)) end
redis.call('DEL', reservation)
redis.call('ZREM', registry, reservation)
return results
