-- claim: turn a registered, unexpired reservation into owned deliveries. Python decoded
-- the payloads it got from reserve; this script re-reads them from the reservation list
-- (the bytes are not sent again) and, per payload in reservation order:
--   good ('g'):   owner key absent -> SET job record (no TTL), SET owner token, LPUSH pid to
--                 processing: 'ok'. Owner key present (the pid is being processed already, or
--                 repeats in this batch) -> LPUSH the payload back to ready: 'deferred'.
--   poison ('p'): LPUSH the raw bytes to poison: 'poison'.
-- Then the counters, the reservation's removal and the consumer's heartbeat.
-- An unregistered or expired reservation is left alone: 'expired' (maintenance recovers it).
-- A reservation whose length differs from the count expected is left alone: 'mismatch'.
--
-- KEYS[1]   reservation registry    {ns}.reservations.{q}
-- KEYS[2]   reservation list        {ns}.reservations.{q}.{token}
-- KEYS[3]   ready list              {ns}.queue.{q}
-- KEYS[4]   processing list         {ns}.processing.{q}
-- KEYS[5]   poison list             {ns}.poison.{q}
-- KEYS[6]   counter                 {ns}.stats.{q}.total
-- KEYS[7]   counter                 {ns}.stats.{q}.processing
-- KEYS[8]   counter                 {ns}.stats.{q}.failed
-- KEYS[9]   consumer heartbeat      {ns}.consumers.{q}.{consumer id}
-- KEYS[8+2g], KEYS[9+2g]            {ns}.jobs.{q}.{pid}, {ns}.owners.{q}.{pid} of the g-th good
-- ARGV[1]   lease_ms                heartbeat lifetime
-- ARGV[2]   consumer id             the heartbeat's value
-- ARGV[3]   n                       payloads expected in the reservation (<= 1000)
-- ARGV[4+3(i-1)..6+3(i-1)]          payload i: kind 'g' or 'p', owner token, pid ('' for 'p')
--
-- Returns 'expired', 'mismatch', or an array of n results: 'ok', 'deferred' or 'poison'.

local function wrong_type(key, expected)
  local actual = redis.call('TYPE', key)['ok']
  if actual ~= expected and actual ~= 'none' then
    return redis.error_reply('QSTYPE ' .. key .. ' is ' .. actual .. ', expected ' .. expected)
  end
end

-- What INCRBY accepts, with room left for adding a batch.
local function bad_counter(key)
  local err = wrong_type(key, 'string')
  if err then return err end
  local value = redis.call('GET', key)
  if value and value ~= '0' and not (#value <= 18 and string.match(value, '^%-?[1-9]%d*$')) then
    return redis.error_reply('QSTYPE ' .. key .. ' is "' .. value .. '", expected an integer')
  end
end

local registry, reservation, ready, processing = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local n = tonumber(ARGV[3])
local goods = (#KEYS - 9) / 2
if not n or n > 1000 or #ARGV ~= 3 + 3 * n or goods ~= math.floor(goods) then
  return redis.error_reply('QSARG claim needs 3 arguments per payload, at most 1000')
end

local err = wrong_type(registry, 'zset') or wrong_type(reservation, 'list')
  or wrong_type(ready, 'list') or wrong_type(processing, 'list') or wrong_type(KEYS[5], 'list')
  or bad_counter(KEYS[6]) or bad_counter(KEYS[7]) or bad_counter(KEYS[8])
  or wrong_type(KEYS[9], 'string')
if err then return err end

local deadline = redis.call('ZSCORE', registry, reservation)
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
if not deadline or tonumber(deadline) <= now then return 'expired' end

local payloads = redis.call('LRANGE', reservation, 0, -1)
if #payloads ~= n then return 'mismatch' end

-- Owner keys are only read here (MGET): one of another type reads as absent and is replaced.
local owned = {}
if goods > 0 then
  local owner_keys = {}
  for g = 1, goods do owner_keys[g] = KEYS[9 + 2 * g] end
  local owners = redis.call('MGET', unpack(owner_keys))
  for g = 1, goods do
    if owners[g] then owned[owner_keys[g]] = true end
  end
end

local results, records, pids, poisoned, deferred = {}, {}, {}, {}, {}
local g = 0
for i = 1, n do
  local arg = 4 + 3 * (i - 1)
  if ARGV[arg] == 'g' then
    g = g + 1
    local owner_key = KEYS[9 + 2 * g]
    if owned[owner_key] then
      deferred[#deferred + 1] = payloads[i]
      results[i] = 'deferred'
    else
      owned[owner_key] = true
      records[#records + 1] = KEYS[8 + 2 * g]
      records[#records + 1] = payloads[i]
      records[#records + 1] = owner_key
      records[#records + 1] = ARGV[arg + 1]
      pids[#pids + 1] = ARGV[arg + 2]
      results[i] = 'ok'
    end
  else
    poisoned[#poisoned + 1] = payloads[i]
    results[i] = 'poison'
  end
end
if g ~= goods then
  return redis.error_reply('QSARG claim needs one job and owner key per good payload')
end

if #pids > 0 then
  redis.call('MSET', unpack(records))
  redis.call('LPUSH', processing, unpack(pids))
  redis.call('INCRBY', KEYS[7], #pids)
end
if #poisoned > 0 then
  redis.call('LPUSH', KEYS[5], unpack(poisoned))
  redis.call('INCRBY', KEYS[8], #poisoned)
end
if #pids + #poisoned > 0 then
  redis.call('INCRBY', KEYS[6], #pids + #poisoned)
end
if #deferred > 0 then
  redis.call('LPUSH', ready, unpack(deferred))
end
redis.call('DEL', reservation)
redis.call('ZREM', registry, reservation)
redis.call('SET', KEYS[9], ARGV[2], 'PX', ARGV[1])
return results
