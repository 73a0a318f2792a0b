-- settle: apply a group of commits, retries, rejects and releases, each conditional on the
-- caller still owning the delivery, each with its own result (queue 5's settle, grouped):
--   'c' commit   DEL job; success += 1.
--   'r' retry    this project's retry below max attempts: LPUSH the new envelope (same pid,
--                new timestamp, attempts + 1) to the producer end of ready, DEL job;
--                failed += 1 (a failed run).
--   'f' reject   queue 5's reject: LPUSH pid to failed, the job record kept (EXPIRE job_ttl
--                if > 0: it starts only now); failed += 1.
--   'l' release  RPUSH the job record as stored (attempts unchanged) to the consumer end of
--                ready, DEL job; no outcome counter.
-- Checks in queue 5's order: owner key ~= token -> 'stale'; job record missing on 'f' or 'l'
-- -> 'missing' (nothing changes, ownership kept); the pid not in processing -> 'stale'.
-- Applied: claim and owner deleted, processing -= 1: 'ok'. A coalescing marker (keyed
-- message) that still names this pid is freed by commit and reject ('c', 'f'); a retry keeps
-- it (the same pid is still pending), and so does a release.
-- Releases go back reversed, so the first released is the first consumed again.
-- Per-message keys are only read with MGET (one of another type reads as absent: the item is
-- 'stale' or 'missing') and only deleted or expired otherwise, so no write can fail halfway.
--
-- KEYS[1]   ready list              {ns}.queue.{q}
-- KEYS[2]   processing list         {ns}.processing.{q}
-- KEYS[3]   failed list             {ns}.failed.{q}
-- KEYS[4]   counter                 {ns}.stats.{q}.processing
-- KEYS[5]   counter                 {ns}.stats.{q}.success
-- KEYS[6]   counter                 {ns}.stats.{q}.failed
-- KEYS[4+3i..6+3i]                  item i: claims, jobs, owners key
-- KEYS[6+3n+m]                      the m-th keyed item's marker {ns}.pending.{q}.{hex key}
-- ARGV[1]   job_ttl                 seconds a rejected job record is kept; 0 = forever
-- ARGV[2]   n                       items (<= 1000)
-- ARGV[3i..2+3i]                    item i: op (upper case: a keyed message), token, pid
-- ARGV[3+3n+r]                      the new envelope of the r-th retry ('r' or 'R')
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
  local value = redis.pcall('GET', key)  -- one call: a key of another type errors here
  if type(value) == 'table' and value['err'] then
    return redis.error_reply('QSTYPE ' .. key .. ' is ' .. redis.call('TYPE', key)['ok']
      .. ', expected string')
  end
  if value and value ~= '0' and not (#value <= 18 and string.match(value, '^%-?[1-9]%d*$')) then
    return redis.error_reply('QSTYPE ' .. key .. ' is "' .. value .. '", expected an integer')
  end
end

local OPS = {c = true, r = true, f = true, l = true}
local ready, processing, failed = KEYS[1], KEYS[2], KEYS[3]
local n, job_ttl = tonumber(ARGV[2]), tonumber(ARGV[1])
if not n or n > 1000 or not job_ttl or #ARGV < 2 + 3 * n then
  return redis.error_reply('QSARG settle needs a job_ttl, a count and 3 arguments per item')
end
local keyed, retries = 0, 0
for i = 1, n do
  local op = ARGV[3 * i]
  local lower = string.lower(op)
  if not OPS[lower] then
    return redis.error_reply('QSARG settle op must be c, r, f or l, not ' .. tostring(op))
  end
  if op ~= lower then keyed = keyed + 1 end
  if lower == 'r' then retries = retries + 1 end
end
if #KEYS ~= 6 + 3 * n + keyed or #ARGV ~= 2 + 3 * n + retries then
  return redis.error_reply('QSARG settle needs 3 keys (4 if keyed) per item and an envelope '
    .. 'per retry, at most 1000 items')
end

local err = wrong_type(ready, 'list') or wrong_type(processing, 'list')
  or wrong_type(failed, 'list') or bad_counter(KEYS[4]) or bad_counter(KEYS[5])
  or bad_counter(KEYS[6])
if err then return err end

-- One MGET for the owners; a job record is read only where a reject or release needs it,
-- a marker only for a keyed message. An item applied earlier in this call is not owned.
local owner_keys = {}
for i = 1, n do owner_keys[i] = KEYS[6 + 3 * i] end
local owners = redis.call('MGET', unpack(owner_keys))

-- Removing the pids from processing. The oldest deliveries, the ones that complete first,
-- sit nearest the tail: while the list is short, a tail window is read once and the
-- settled pids found there are taken out by rewriting it from the first one taken (one
-- LTRIM, one RPUSH) instead of one LREM each; any other pid is removed by LREM from the
-- tail. The window is 16 entries per item (plus 16): with several consumers on a queue a
-- consumer's oldest deliveries lie among theirs, up to all outstanding deliveries from the
-- tail, and one LREM each would cost each item a scan that grows with the consumers. A long
-- list keeps a legacy history at its tail, so there every pid is removed by LREM from the
-- head.
local length = redis.call('LLEN', processing)
local from, window, in_window, taken = 1, {}, {}, {}
if length <= 1000 then
  from = -1
  window = redis.call('LRANGE', processing, -(16 * n + 16), -1)
  for _, entry in ipairs(window) do in_window[entry] = (in_window[entry] or 0) + 1 end
end

-- Takes pid out of processing (from the window if it is there); false if it is not there.
local function remove(pid)
  if (in_window[pid] or 0) > 0 then
    in_window[pid] = in_window[pid] - 1
    taken[pid] = (taken[pid] or 0) + 1
    return true
  end
  return redis.call('LREM', processing, from, pid) > 0
end

local results, requeued, released, rejected, doomed = {}, {}, {}, {}, {}
local commits, failures, applied, settled, markers, retried = 0, 0, 0, {}, 0, 0
for i = 1, n do
  local op, token, pid = ARGV[3 * i], ARGV[3 * i + 1], ARGV[3 * i + 2]
  local claim, job, owner = KEYS[4 + 3 * i], KEYS[5 + 3 * i], KEYS[6 + 3 * i]
  local marker_at = 0  -- the index in KEYS of this item's marker (0: not keyed)
  local lower = string.lower(op)
  if op ~= lower then
    markers = markers + 1
    marker_at = 6 + 3 * n + markers
    op = lower
  end
  local envelope_at = 0
  if op == 'r' then
    retried = retried + 1
    envelope_at = 2 + 3 * n + retried
  end
  local result = 'stale'
  if owners[i] == token and not settled[owner] then
    local record = nil
    if op == 'f' or op == 'l' then record = redis.call('MGET', job)[1] end
    if not record and (op == 'f' or op == 'l') then
      result = 'missing'
    elseif remove(pid) then
      result = 'ok'
      applied = applied + 1
      settled[owner] = true
      doomed[#doomed + 1] = claim
      doomed[#doomed + 1] = owner
      if op == 'f' then
        rejected[#rejected + 1] = pid
        if job_ttl > 0 then redis.call('EXPIRE', job, job_ttl) end
        failures = failures + 1
      else
        doomed[#doomed + 1] = job
        if op == 'l' then
          released[#released + 1] = record
        elseif op == 'r' then
          requeued[#requeued + 1] = ARGV[envelope_at]
          failures = failures + 1
        else
          commits = commits + 1
        end
      end
      if marker_at > 0 and (op == 'c' or op == 'f')
          and redis.call('MGET', KEYS[marker_at])[1] == pid then
        doomed[#doomed + 1] = KEYS[marker_at]
      end
    end
  end
  results[i] = result
end

if next(taken) then
  -- Rewrite the tail window without the entries taken: per removal the occurrence nearest
  -- the tail, as LREM from the tail would take it.
  local keep = {}
  for k = #window, 1, -1 do
    local entry = window[k]
    if (taken[entry] or 0) > 0 then
      taken[entry] = taken[entry] - 1
    else
      keep[k] = true
    end
  end
  local first = 1  -- the entry taken nearest the head: only from there on is rewritten
  while keep[first] do first = first + 1 end
  local kept = {}
  for k = first, #window do
    if keep[k] then kept[#kept + 1] = window[k] end
  end
  redis.call('LTRIM', processing, 0, -(#window - first + 2))
  if #kept > 0 then redis.call('RPUSH', processing, unpack(kept)) end
end
if #doomed > 0 then redis.call('DEL', unpack(doomed)) end

if #rejected > 0 then redis.call('LPUSH', failed, unpack(rejected)) end
if #requeued > 0 then redis.call('LPUSH', ready, unpack(requeued)) end
if #released > 0 then
  local reversed = {}
  for k = #released, 1, -1 do reversed[#reversed + 1] = released[k] end
  redis.call('RPUSH', ready, unpack(reversed))
end
if commits > 0 then redis.call('INCRBY', KEYS[5], commits) end
if failures > 0 then redis.call('INCRBY', KEYS[6], failures) end
if applied > 0 then redis.call('DECRBY', KEYS[4], applied) end
return results
