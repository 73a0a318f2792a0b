-- retry: move failed (or dead) jobs back to the ready list, each only if it is still where
-- and what the caller read. The caller (Python) decides the envelope to push, so that this
-- script never parses a payload: it is the job record as stored (attempts kept) or that
-- record re-encoded with attempts = 0.
--
-- KEYS[1]      source list     {ns}.failed.{q} or {ns}.dead.{q}  (pids)
-- KEYS[2]      ready list      {ns}.queue.{q}
-- KEYS[3i]     job record      {ns}.jobs.{q}.{pid} of item i (at most 1,000 items)
-- KEYS[3i+1]   failure record  {ns}.supervisor-errors.{q}.{pid} of item i (broker.failure)
-- KEYS[3i+2]   history         {ns}.supervisor-failures.{q}.{pid} of item i
-- ARGV[3i-2]   pid of item i
-- ARGV[3i-1]   the job record as the caller read it ('' if there was none)
-- ARGV[3i]     the envelope to push ('' when the record was none)
--
-- Per item:
--   'changed'  the record is no longer what the caller read: nothing changes
--   'gone'     the pid is no longer in the source list: nothing changes
--   'expired'  there was no record (its jobTtl ran out): the pid leaves the source list
--              and its failure record and history are deleted
--   'ok'       the pid leaves the source list, the envelope is LPUSHed to the ready list
--              (the producer end, like a new message), the job record, the failure
--              record and the history are deleted
--
-- Returns an array of one status per item.

local MAX_ITEMS = 1000
local source, ready = KEYS[1], KEYS[2]
local n = #ARGV / 3

if n > MAX_ITEMS or #ARGV ~= 3 * n or n ~= math.floor(n) or #KEYS ~= 2 + 3 * n then
  return redis.error_reply('QSARG retry needs 3 keys and 3 arguments per item, at most '
    .. MAX_ITEMS)
end

--- @include "includes/wrong_type"

-- Validate every key before the first write.
local err = wrong_type(source, 'list') or wrong_type(ready, 'list')
if err then return err end
for i = 1, n do
  err = wrong_type(KEYS[3 * i], 'string')
  if err then return err end
end

local results = {}
for i = 1, n do
  local job_key, error_key, history_key = KEYS[3 * i], KEYS[3 * i + 1], KEYS[3 * i + 2]
  local pid = ARGV[3 * i - 2]
  local expected, envelope = ARGV[3 * i - 1], ARGV[3 * i]
  local record = redis.call('GET', job_key) or ''
  if record ~= expected then
    results[i] = 'changed'
  elseif redis.call('LREM', source, -1, pid) == 0 then
    results[i] = 'gone'
  elseif record == '' then
    redis.call('DEL', error_key, history_key)
    results[i] = 'expired'
  else
    redis.call('LPUSH', ready, envelope)
    redis.call('DEL', job_key, error_key, history_key)
    results[i] = 'ok'
  end
end
return results
