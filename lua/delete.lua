-- delete: remove failed (or dead) jobs for good, each only if its pid is still in the list:
-- the pid leaves the list, and its job record, failure record and failure history are
-- deleted with it. A pid
-- that someone else retried or deleted meanwhile is left alone (its record may already
-- belong to its next run).
--
-- KEYS[1]      source list     {ns}.failed.{q} or {ns}.dead.{q}  (pids)
-- KEYS[3i-1]   job record      {ns}.jobs.{q}.{pid} of item i (at most 1,000 items)
-- KEYS[3i]     failure record  {ns}.supervisor-errors.{q}.{pid} of item i
-- KEYS[3i+1]   history         {ns}.supervisor-failures.{q}.{pid} of item i
-- ARGV[i]      pid of item i
--
-- Per item:
--   'gone'  the pid is no longer in the source list: nothing changes
--   'ok'    every entry of the pid left the source list; its records are deleted
--
-- Returns an array of one status per item.

local MAX_ITEMS = 1000
local source = KEYS[1]
local n = #ARGV

if n < 1 or n > MAX_ITEMS or #KEYS ~= 1 + 3 * n then
  return redis.error_reply('QSARG delete needs 1 list key, then 3 keys and 1 pid per item, 1 to '
    .. MAX_ITEMS .. ' items')
end

-- Validate before the first write.
local actual = redis.call('TYPE', source)['ok']
if actual ~= 'list' and actual ~= 'none' then
  return redis.error_reply('QSTYPE ' .. source .. ' is ' .. actual .. ', expected list')
end

local results = {}
for i = 1, n do
  if redis.call('LREM', source, 0, ARGV[i]) == 0 then
    results[i] = 'gone'
  else
    redis.call('DEL', KEYS[3 * i - 1], KEYS[3 * i], KEYS[3 * i + 1])
    results[i] = 'ok'
  end
end
return results
