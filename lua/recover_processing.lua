-- recover_processing: requeue processing entries that their consumer abandoned.
--
-- KEYS[1]        ready list             {ns}.queue.{q}
-- KEYS[2]        processing list        {ns}.processing.{q}
-- KEYS[3]        processing counter     {ns}.stats.{q}.processing
-- then for item i = 1..n (at most 1,000), three keys:
-- KEYS[3i+1]     job record             {ns}.jobs.{q}.{pid}
-- KEYS[3i+2]     owner token            {ns}.owners.{q}.{pid}
-- KEYS[3i+3]     consumer heartbeat     {ns}.consumers.{q}.{consumer id} (for a legacy item
--                any consumer key of the queue: it is not read)
-- ARGV, for item i, three values:
-- ARGV[3i-2]     mode: 'd' (owner's heartbeat expired) or 'l' (legacy: no owner key)
-- ARGV[3i-1]     pid
-- ARGV[3i]       the owner token the caller saw ('d'), or '' ('l')
--
-- The caller chose the items from reads that may be stale; everything is re-checked here:
--   'd': recovered only if the owner token is still the one seen and the consumer's
--        heartbeat does not exist, so a settled, renewed or re-delivered entry is untouched.
--        Deleting the owner key makes any later settle or renewal by that consumer stale.
--   'l': recovered only if there is still no owner key and LREM removed the pid.
-- A recovered job record goes back to the ready list's consumer end (right) unchanged, so
-- its attempts count is unchanged. A job record that is missing leaves a dangling pid (and
-- owner), which is removed and reported 'missing'. The counter drops by one per removed
-- processing entry, never below zero.
--
-- Returns one status per item: 'ok', 'missing' or 'skip' (changed meanwhile: untouched).

local MAX_ITEMS = 1000
local ready, processing, counter = KEYS[1], KEYS[2], KEYS[3]
local n = #ARGV / 3

if n ~= math.floor(n) or #KEYS ~= 3 + #ARGV then
  return redis.error_reply('QSARGS expected 3 keys and 3 values per item')
end
if n > MAX_ITEMS then
  return redis.error_reply('QSARGS at most ' .. MAX_ITEMS .. ' items per call')
end

local function expect_type(key, expected)
  local actual = redis.call('TYPE', key)['ok']
  if actual ~= 'none' and actual ~= expected then
    return redis.error_reply('QSTYPE ' .. key .. ' is ' .. actual .. ', expected ' .. expected)
  end
end

-- Validate every key and the counter before the first write.
local bad = expect_type(ready, 'list') or expect_type(processing, 'list')
  or expect_type(counter, 'string')
if bad then return bad end
local count = redis.call('GET', counter)
if count and not string.match(count, '^%-?%d+$') then
  return redis.error_reply('QSTYPE ' .. counter .. ' is not an integer counter')
end
count = tonumber(count or '0')
for i = 1, n do
  local mode = ARGV[3 * i - 2]
  if mode ~= 'd' and mode ~= 'l' then
    return redis.error_reply('QSARGS unknown mode ' .. tostring(mode))
  end
  bad = expect_type(KEYS[3 * i + 1], 'string') or expect_type(KEYS[3 * i + 2], 'string')
  if bad then return bad end
end

local results, removed = {}, 0

-- Requeue a job record (unchanged) and delete it; 'missing' if there is none.
local function requeue(job)
  local record = redis.call('GET', job)
  if not record then return 'missing' end
  redis.call('RPUSH', ready, record)
  redis.call('DEL', job)
  return 'ok'
end

for i = 1, n do
  local mode, pid, expected = ARGV[3 * i - 2], ARGV[3 * i - 1], ARGV[3 * i]
  local job, owner, heartbeat = KEYS[3 * i + 1], KEYS[3 * i + 2], KEYS[3 * i + 3]
  local status = 'skip'
  if mode == 'd' then
    if redis.call('GET', owner) == expected and redis.call('EXISTS', heartbeat) == 0 then
      removed = removed + redis.call('LREM', processing, 1, pid)
      redis.call('DEL', owner)
      status = requeue(job)
    end
  elseif redis.call('EXISTS', owner) == 0 then
    local gone = redis.call('LREM', processing, 1, pid)
    if gone > 0 then
      removed = removed + gone
      status = requeue(job)
    end
  end
  results[i] = status
end

local decrement = math.min(removed, math.max(count, 0))
if decrement > 0 then redis.call('DECRBY', counter, decrement) end
return results
