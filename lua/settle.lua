-- settle: apply a group of commits, retries, failures and releases, each conditional on
-- the caller still owning the delivery (owner key == token), each with its own result:
--   'c' commit   DEL job + owner, remove pid from processing, success += 1.
--   'r' retry    LPUSH the new envelope (attempts + 1) to ready, DEL job + owner, remove pid.
--   'f' fail     LPUSH pid to failed, SET job = new envelope (EX job_ttl if > 0: the TTL
--                starts only now), DEL owner, remove pid, failed += 1.
--   'l' release  RPUSH the job record as stored (attempts unchanged) to ready's consumer end,
--                DEL job + owner, remove pid. Job record missing: 'missing', nothing changes
--                and the ownership is kept.
-- Applied: 'ok' (and processing -= 1). Owner absent or another token: 'stale', nothing changes.
-- The same owner key twice in one call: the first applied item makes the second stale.
--
-- KEYS[1]   ready list              {ns}.queue.{q}
-- KEYS[2]   processing list         {ns}.processing.{q}
-- KEYS[3]   failed list             {ns}.failed.{q}
-- KEYS[4]   counter                 {ns}.stats.{q}.processing
-- KEYS[5]   counter                 {ns}.stats.{q}.success
-- KEYS[6]   counter                 {ns}.stats.{q}.failed
-- KEYS[5+2i], KEYS[6+2i]            {ns}.jobs.{q}.{pid}, {ns}.owners.{q}.{pid} of item i
-- ARGV[1]   job_ttl_s               seconds a failed job record is kept; 0 = forever
-- ARGV[2+4(i-1)..5+4(i-1)]          item i: op, owner token, pid, new envelope ('' unless r/f)
--
-- Returns an array of n results: 'ok', 'stale' or 'missing'.

local function wrong_type(key, expected)
  local actual = redis.call('TYPE', key)['ok']
  if actual ~= expected and actual ~= 'none' then
    return redis.error_reply('QSTYPE ' .. key .. ' is ' .. actual .. ', expected ' .. expected)
  end
end

-- What INCRBY/DECRBY accept, with room left for a batch.
local function bad_counter(key)
  local err = wrong_type(key, 'string')
  if err then return err end
  local value = redis.call('GET', key)
  if value and value ~= '0' and not (#value <= 18 and string.match(value, '^%-?[1-9]%d*$')) then
    return redis.error_reply('QSTYPE ' .. key .. ' is "' .. value .. '", expected an integer')
  end
end

local ready, processing, failed = KEYS[1], KEYS[2], KEYS[3]
local n = (#KEYS - 6) / 2
local job_ttl = tonumber(ARGV[1])
if n ~= math.floor(n) or n > 1000 or #ARGV ~= 1 + 4 * n or not job_ttl then
  return redis.error_reply('QSARG settle needs 2 keys and 4 arguments per item, at most 1000')
end

local err = wrong_type(ready, 'list') or wrong_type(processing, 'list')
  or wrong_type(failed, 'list') or bad_counter(KEYS[4]) or bad_counter(KEYS[5])
  or bad_counter(KEYS[6])
if err then return err end
if n == 0 then return {} end

-- Owner keys are only read (MGET): one of another type reads as absent, i.e. stale.
local owner_keys = {}
for i = 1, n do owner_keys[i] = KEYS[6 + 2 * i] end
local values = redis.call('MGET', unpack(owner_keys))
local owner = {}
for i = 1, n do owner[owner_keys[i]] = values[i] end

-- First pass: decide every item and read what releases need; no writes yet, so a job
-- record of the wrong type can still refuse the whole call.
local results, applied, doomed, requeued, released, failures = {}, {}, {}, {}, {}, {}
local commits = 0
for i = 1, n do
  local arg = 2 + 4 * (i - 1)
  local op, job_key, owner_key = ARGV[arg], KEYS[5 + 2 * i], owner_keys[i]
  local result = 'stale'
  if owner[owner_key] == ARGV[arg + 1] then
    result = 'ok'
    if op == 'l' then
      local record = redis.pcall('GET', job_key)
      if type(record) == 'table' and record['err'] then
        return redis.error_reply('QSTYPE ' .. job_key .. ' is '
          .. redis.call('TYPE', job_key)['ok'] .. ', expected string')
      elseif record then
        released[#released + 1] = record
      else
        result = 'missing'
      end
    elseif op == 'c' then
      commits = commits + 1
    elseif op == 'r' then
      requeued[#requeued + 1] = ARGV[arg + 3]
    elseif op == 'f' then
      failures[#failures + 1] = i
    else
      return redis.error_reply('QSARG settle op must be c, r, f or l, not ' .. op)
    end
  end
  if result == 'ok' then
    owner[owner_key] = false
    applied[#applied + 1] = ARGV[arg + 2]
    doomed[#doomed + 1] = owner_key
    if op ~= 'f' then doomed[#doomed + 1] = job_key end
  end
  results[i] = result
end
if #applied == 0 then return results end

-- Second pass: the writes, grouped. Processing entries are removed scanning from the head,
-- where claims LPUSH them: live deliveries sit within the first (prefetch x consumers)
-- entries, while the tail may hold a long history of stale legacy pids that a scan from
-- that end would walk through for every message.
for _, pid in ipairs(applied) do
  redis.call('LREM', processing, 1, pid)
end
for _, i in ipairs(failures) do
  local arg = 2 + 4 * (i - 1)
  if job_ttl > 0 then
    redis.call('SET', KEYS[5 + 2 * i], ARGV[arg + 3], 'EX', ARGV[1])
  else
    redis.call('SET', KEYS[5 + 2 * i], ARGV[arg + 3])
  end
end
if #failures > 0 then
  local pids = {}
  for k, i in ipairs(failures) do pids[k] = ARGV[4 + 4 * (i - 1)] end
  redis.call('LPUSH', failed, unpack(pids))
  redis.call('INCRBY', KEYS[6], #failures)
end
redis.call('DEL', unpack(doomed))
if #requeued > 0 then redis.call('LPUSH', ready, unpack(requeued)) end
if #released > 0 then
  -- Reversed, so the first released is the first consumed again (original order).
  local reversed = {}
  for k = #released, 1, -1 do reversed[#reversed + 1] = released[k] end
  redis.call('RPUSH', ready, unpack(reversed))
end
if commits > 0 then redis.call('INCRBY', KEYS[5], commits) end
redis.call('DECRBY', KEYS[4], #applied)
return results
