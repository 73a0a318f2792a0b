-- reclaim: recover processing entries whose delivery is no longer live, as queue 5's reap
-- does, for a group of candidates. The caller chose them from reads that may be stale;
-- every condition is re-checked here:
--   'q' requeue  only if the owner key is (still) the one read ('' = none), the claim key
--   'd' dead     is absent, the job record exists and LREM removed the pid. Then the owner
--                and claim keys go, processing -= 1, and: 'q' LPUSHes the replacement
--                envelope (same pid, new timestamp, attempts + 1) to the producer end of
--                ready and deletes the job record; 'd' LPUSHes the pid to dead and keeps the
--                record (EXPIRE job_ttl if > 0), and frees a coalescing marker that still
--                names this pid; its failure record (when not '') is SET in the item's
--                errors key with record_ttl (job_ttl, when there is one: never for ever).
--                Either way the failure record (when not '') is pushed onto the job's
--                history (supervisor-failures: the first failure and the last 5 kept,
--                record_ttl), as settle.lua does for a failed attempt.
--   'x' dangling a pid with neither job record nor owner key: LREM it (no counter changes).
-- Deleting the owner key makes any later settle or renewal by the old owner stale.
-- Each LREM scans from the end the caller names (1: head, -1: tail), the end nearer to
-- where the pid was read, so the work stays bounded however long the list is.
--
-- KEYS[1]   ready list              {ns}.queue.{q}
-- KEYS[2]   dead list               {ns}.dead.{q}
-- KEYS[3]   processing list         {ns}.processing.{q}
-- KEYS[4]   counter                 {ns}.stats.{q}.processing
-- KEYS[6i-1..4+6i]                  item i: owners, claims, jobs key, marker key
--                                   {ns}.pending.{q}.{hex key} (the jobs key if not keyed),
--                                   failure record {ns}.supervisor-errors.{q}.{pid},
--                                   history {ns}.supervisor-failures.{q}.{pid}
-- ARGV[1]   job_ttl                 seconds a dead job record is kept; 0 = forever
-- ARGV[2]   record_ttl              seconds a failure record is kept (1 .. 2^31 - 1)
-- ARGV[7i-4..7i+2]                  item i: mode, expected owner, pid, replacement envelope,
--                                   direction (1 or -1), keyed ('1' or '0'), failure record
--                                   ('' = none; 'x': unused)
--
-- Returns an array of n integers: 1 applied, 0 left alone.

--- @include "includes/wrong_type"

-- The decimal digits of a whole number from low to high (2^31 - 1 at most: a count, a
-- lease or a TTL that EXPIRE, SETEX and ZADD all take), else nil. Checked before the first
-- write: Lua does not undo the writes made before a command that fails.
--- @include "includes/whole"

-- Push a failure record onto a job's history, keeping the oldest (the first failure: when
-- the job was first published) and the newest 5; a key of another type is replaced.
--- @include "includes/remember_failure"

local MODES = {q = true, d = true, x = true}
local ready, dead, processing, counter = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local n = (#KEYS - 4) / 6
local job_ttl, record_ttl = whole(ARGV[1], 0, 2147483647), whole(ARGV[2], 1, 2147483647)
if n ~= math.floor(n) or n > 1000 or #ARGV ~= 2 + 7 * n or not job_ttl or not record_ttl then
  return redis.error_reply('QSARG reclaim needs a job_ttl and a record_ttl in whole s, 6 keys '
    .. 'and 7 arguments per item, at most 1000')
end

local err = wrong_type(ready, 'list') or wrong_type(dead, 'list')
  or wrong_type(processing, 'list') or wrong_type(counter, 'string')
if err then return err end
local count = redis.call('GET', counter)
-- What DECRBY accepts (no leading zero, no "-0"), checked here: it runs after the moves.
if count and count ~= '0' and not (#count <= 18 and string.match(count, '^%-?[1-9]%d*$')) then
  return redis.error_reply('QSTYPE ' .. counter .. ' is "' .. count .. '", expected an integer')
end
for i = 1, n do
  local mode, direction = ARGV[7 * i - 4], ARGV[7 * i]
  if not MODES[mode] or (direction ~= '1' and direction ~= '-1') then
    return redis.error_reply('QSARG reclaim item ' .. i .. ': bad mode or direction')
  end
end

-- Owner keys and markers are only read with MGET (one of another type reads as absent);
-- the rest is EXISTS, DEL and EXPIRE, which work on any type: no write can fail halfway.
local reads = {}
for i = 1, n do
  reads[2 * i - 1] = KEYS[6 * i - 1]
  reads[2 * i] = KEYS[6 * i + 2]
end
local values = n > 0 and redis.call('MGET', unpack(reads)) or {}

local results, requeued, buried, records = {}, {}, {}, {}
local failure_keys, failures, history_keys, histories = {}, {}, {}, {}
local removed = 0
for i = 1, n do
  local mode, expected, pid = ARGV[7 * i - 4], ARGV[7 * i - 3], ARGV[7 * i - 2]
  local direction = tonumber(ARGV[7 * i])
  local owner, claim, job, marker = KEYS[6 * i - 1], KEYS[6 * i], KEYS[6 * i + 1], KEYS[6 * i + 2]
  local done = 0
  if mode == 'x' then
    if redis.call('EXISTS', owner) == 0 and redis.call('EXISTS', job) == 0 then
      done = redis.call('LREM', processing, direction, pid) > 0 and 1 or 0
    end
  elseif (values[2 * i - 1] or '') == expected and redis.call('EXISTS', claim) == 0
      and redis.call('EXISTS', job) == 1
      and redis.call('LREM', processing, direction, pid) > 0 then
    done = 1
    removed = removed + 1
    redis.call('DEL', owner, claim)
    if ARGV[7 * i + 2] ~= '' then
      history_keys[#history_keys + 1] = KEYS[6 * i + 4]
      histories[#histories + 1] = ARGV[7 * i + 2]
    end
    if mode == 'q' then
      requeued[#requeued + 1] = ARGV[7 * i - 1]
      redis.call('DEL', job)
    else
      buried[#buried + 1] = pid
      records[#records + 1] = job
      if ARGV[7 * i + 1] == '1' and values[2 * i] == pid then
        redis.call('DEL', marker)
      end
      if ARGV[7 * i + 2] ~= '' then
        failure_keys[#failure_keys + 1] = KEYS[6 * i + 3]
        failures[#failures + 1] = ARGV[7 * i + 2]
      end
    end
  end
  results[i] = done
end

if #requeued > 0 then redis.call('LPUSH', ready, unpack(requeued)) end
if #buried > 0 then redis.call('LPUSH', dead, unpack(buried)) end
-- After the push, as queue 5 orders it: the pid is listed before its record may expire.
if job_ttl > 0 then
  for _, record in ipairs(records) do redis.call('EXPIRE', record, job_ttl) end
end
for k = 1, #failure_keys do
  redis.call('SET', failure_keys[k], failures[k], 'EX', record_ttl)
end
for k = 1, #history_keys do remember_failure(history_keys[k], histories[k], record_ttl) end
if removed > 0 then redis.call('DECRBY', counter, removed) end
return results
