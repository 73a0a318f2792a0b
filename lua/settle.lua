-- settle: apply a group of commits, retries, rejects and releases, each conditional on the
-- caller still owning the delivery, each with its own result (queue 5's settle, grouped):
--   'c' commit   DEL job; success += 1.
--   'o' commit   of a job with earlier attempts: 'c', and its failure history is deleted.
--   'r' retry    this project's retry below max attempts: LPUSH the new envelope (same pid,
--                new timestamp, attempts + 1) to the producer end of ready, DEL job;
--                failed += 1 (a failed run).
--   'd' delayed  a retry with a backoff: ZADD the new envelope to the delayed set scored
--                TIME + delay (whole s of this server's clock), DEL job; failed += 1.
--                promote.lua moves it to ready once due, stamped with the time it does
--                (the envelope's layout is requeued()'s); queue 5 never reads the set.
--   'f' reject   queue 5's reject: LPUSH pid to failed, the job record kept (EXPIRE job_ttl
--                if > 0: it starts only now); failed += 1. The failure record (when not '')
--                is SET in the item's errors key with record_ttl (job_ttl, when there is
--                one: never for ever, since a queue-5 worker's retry() requeues the job
--                under a new pid and leaves the record of the old one behind).
--   'l' release  RPUSH the job record as stored (attempts unchanged) to the consumer end of
--                ready, DEL job; no outcome counter.
-- Checks in queue 5's order: owner key ~= token -> 'stale'; job record missing on 'f' or 'l'
-- -> 'missing' (nothing changes, ownership kept); the pid not in processing -> 'stale'.
-- Applied: claim and owner deleted, processing -= 1: 'ok'. A coalescing marker (keyed
-- message) that still names this pid is freed by commit and reject ('c', 'o', 'f'); a retry keeps
-- it (the same pid is still pending, delayed or not), and so does a release.
-- Releases go back reversed, so the first released is the first consumed again.
-- Every failed attempt applied ('r', 'd', 'f') with a failure record (not '') also pushes it
-- onto the job's history {ns}.supervisor-failures.{q}.{pid}: this project's own bounded
-- list (newest first: the first failure kept and the last 5), expiring with record_ttl.
-- Queue 5 never reads it; the errors key keeps the last record, as older versions read it.
-- Per-message keys are only read with MGET (one of another type reads as absent: the item is
-- 'stale' or 'missing') and only deleted, replaced or expired otherwise, so no write can fail
-- halfway.
--
-- KEYS[1]   ready list              {ns}.queue.{q}
-- KEYS[2]   processing list         {ns}.processing.{q}
-- KEYS[3]   failed list             {ns}.failed.{q}
-- KEYS[4]   counter                 {ns}.stats.{q}.processing
-- KEYS[5]   counter                 {ns}.stats.{q}.success
-- KEYS[6]   counter                 {ns}.stats.{q}.failed
-- KEYS[7]   delayed retries (zset)  {ns}.supervisor-delayed.{q}
-- KEYS[5+3i..7+3i]                  item i: claims, jobs, owners key
-- KEYS[7+3n+m]                      the m-th keyed item's marker {ns}.pending.{q}.{hex key}
-- KEYS[7+3n+k+f]                    the f-th reject's failure record
--                                   {ns}.supervisor-errors.{q}.{pid} (k: keyed items)
-- KEYS[7+3n+k+j+h]                  the h-th history {ns}.supervisor-failures.{q}.{pid}
--                                   (j: rejects), of each 'r', 'd', 'f' and 'o' item
-- ARGV[1]   job_ttl                 seconds a rejected job record is kept; 0 = forever
-- ARGV[2]   n                       items (<= 1000)
-- ARGV[3]   ops                     n characters, item i's op (upper case: a keyed message)
-- ARGV[4]   pid offset              length of the jobs keys' common prefix: an item's pid
--                                   is its jobs key after it (read, not sent again)
-- ARGV[5]   record_ttl              seconds a failure record is kept (1 .. 2^31 - 1)
-- ARGV[5+i]                         item i: the owner token it was claimed with
-- ARGV[6+n..]                       then, in item order, what an op needs beyond its token:
--                                   'r' the new envelope and the failure record; 'd' the
--                                   new envelope, its delay (whole s, 1 .. 2^31 - 1) and
--                                   the failure record; 'f' the failure record (each
--                                   '' = none); 'c' and 'l' nothing
--
-- Returns an array of n results: 'ok', 'stale' or 'missing'.

--- @include "includes/wrong_type"

-- What INCRBY/DECRBY accept, with room left for a batch.
--- @include "includes/bad_counter"

-- The decimal digits of a whole number from low to high (2^31 - 1 at most: a count, a
-- lease or a TTL that EXPIRE, SETEX and ZADD all take), else nil. Checked before the first
-- write: Lua does not undo the writes made before a command that fails.
--- @include "includes/whole"

-- Push a failure record onto a job's history, keeping the oldest (the first failure: when
-- the job was first published) and the newest 5; a key of another type is replaced.
--- @include "includes/remember_failure"

-- Op characters by byte: the op in lower case, and whether a marker key follows.
local OPS = {[99] = 'c', [114] = 'r', [102] = 'f', [108] = 'l', [100] = 'd', [111] = 'o',
             [67] = 'c', [82] = 'r', [70] = 'f', [76] = 'l', [68] = 'd', [79] = 'o'}
local ready, processing, failed, delayed = KEYS[1], KEYS[2], KEYS[3], KEYS[7]
local n, job_ttl, ops = whole(ARGV[2], 0, 1000), whole(ARGV[1], 0, 2147483647), ARGV[3]
local offset, record_ttl = whole(ARGV[4], 0, 2147483647), whole(ARGV[5], 1, 2147483647)
if not n or not job_ttl or not offset or not record_ttl or not ops or #ops ~= n then
  return redis.error_reply('QSARG settle needs a job_ttl in whole s, a count, an op per item, a '
    .. 'pid offset and a record_ttl in whole s')
end
if string.find(ops, '[^crfldoCRFLDO]') then
  return redis.error_reply('QSARG settle ops must be c, o, r, d, f or l, not ' .. ops)
end
local _, keyed = string.gsub(ops, '%u', '')
local _, retries = string.gsub(ops, '[rR]', '')
local _, waits = string.gsub(ops, '[dD]', '')
local _, rejects = string.gsub(ops, '[fF]', '')
local _, forgets = string.gsub(ops, '[oO]', '')
local failing = retries + waits + rejects + forgets
if #KEYS ~= 7 + 3 * n + keyed + rejects + failing
    or #ARGV ~= 5 + n + 2 * retries + 3 * waits + rejects then
  return redis.error_reply('QSARG settle needs 3 keys (4 if keyed, 2 more per reject, 1 per '
    .. 'retry and o) and a token per item, an envelope per retry (and a delay if delayed), a '
    .. 'record per retry and reject, at most 1000 items')
end
-- Where each item's extra arguments start, and every delay checked before the first write.
local extra_at, cursor = {}, 5 + n
for i = 1, n do
  local op = OPS[string.byte(ops, i)]
  extra_at[i] = cursor + 1
  if op == 'f' then
    cursor = cursor + 1
  elseif op == 'r' then
    cursor = cursor + 2
  elseif op == 'd' then
    if not whole(ARGV[cursor + 2], 1, 2147483647) then
      return redis.error_reply('QSARG settle item ' .. i .. ': a delay must be whole s from 1')
    end
    cursor = cursor + 3
  end
end

local err = wrong_type(ready, 'list') or wrong_type(processing, 'list')
  or wrong_type(failed, 'list') or wrong_type(delayed, 'zset') or bad_counter(KEYS[4])
  or bad_counter(KEYS[5]) or bad_counter(KEYS[6])
if err then return err end

-- One MGET for the owners; a job record is read only where a reject or release needs it,
-- a marker only for a keyed message. An item applied earlier in this call is not owned.
local owner_keys = {}
for i = 1, n do owner_keys[i] = KEYS[7 + 3 * i] end
local owners = redis.call('MGET', unpack(owner_keys))

-- Removing the pids from processing. The oldest deliveries, the ones that complete first,
-- sit nearest the tail: while the list is short, a tail window is read and the settled
-- pids found there are taken out by rewriting it from the first one taken (one LTRIM, one
-- RPUSH) instead of one LREM each; any other pid is removed by LREM from the tail. The
-- window is n + 16 entries, which holds a lone consumer's pids; when some are not in it,
-- it grows once to 16 per item (plus 16): with several consumers on a queue a consumer's
-- oldest deliveries lie among theirs, up to all outstanding deliveries from the tail, and
-- one LREM each would cost each item a scan that grows with the consumers. A long list
-- keeps a legacy history at its tail, so there every pid is removed by LREM from the head.
local pids = {}
for i = 1, n do pids[i] = string.sub(KEYS[6 + 3 * i], offset + 1) end
local length = redis.call('LLEN', processing)
local from, window, in_window, taken, any_taken = 1, {}, {}, {}, false
if length <= 1000 then
  from = -1
  window = redis.call('LRANGE', processing, -(n + 16), -1)
  for _, entry in ipairs(window) do in_window[entry] = (in_window[entry] or 0) + 1 end
  local wide = 16 * n + 16
  if #window < length and wide > #window then
    local missing = false
    for i = 1, n do
      if not in_window[pids[i]] then
        missing = true
        break
      end
    end
    if missing then  -- the entries before the window, then the window
      local wider = redis.call('LRANGE', processing, -wide, -(#window + 1))
      for _, entry in ipairs(wider) do in_window[entry] = (in_window[entry] or 0) + 1 end
      for _, entry in ipairs(window) do wider[#wider + 1] = entry end
      window = wider
    end
  end
end

local results, requeued, released, rejected, doomed = {}, {}, {}, {}, {}
local rejected_at = {}  -- the item index of each rejected pid (its jobs key is KEYS[6+3i])
local record_keys, record_values = {}, {}  -- per rejected pid: its failure record
local waiting = {}  -- delayed retries: delay, envelope, delay, envelope ...
local history_keys, history_values = {}, {}  -- per failed attempt applied: its history
local failing_no = 0
local ndoomed, nrequeued, nreleased, nrejected, nwaiting = 0, 0, 0, 0, 0
local commits, failures, applied, settled, markers, reject_no = 0, 0, 0, {}, 0, 0
for i = 1, n do
  local code = string.byte(ops, i)
  local op, token = OPS[code], ARGV[5 + i]
  local at = 4 + 3 * i
  local claim, job, owner = KEYS[at + 1], KEYS[at + 2], KEYS[at + 3]
  local marker_at = 0  -- the index in KEYS of this item's marker (0: not keyed)
  if code < 97 then  -- upper case: keyed
    markers = markers + 1
    marker_at = 7 + 3 * n + markers
  end
  if op == 'f' then reject_no = reject_no + 1 end
  local history_at = 0  -- the index in KEYS of this item's history (0: no failed attempt)
  local history_record = nil
  if op == 'f' or op == 'r' or op == 'd' or op == 'o' then
    failing_no = failing_no + 1
    history_at = 7 + 3 * n + keyed + rejects + failing_no
    if op ~= 'o' then
      history_record = ARGV[extra_at[i] + (op == 'r' and 1 or (op == 'd' and 2 or 0))]
    end
  end
  local result = 'stale'
  if owners[i] == token and not settled[owner] then
    local record = nil
    if op == 'f' or op == 'l' then record = redis.call('MGET', job)[1] end
    local pid = pids[i]
    local removed = false
    if not record and (op == 'f' or op == 'l') then
      result = 'missing'
    else
      local left = in_window[pid]
      if left and left > 0 then
        in_window[pid] = left - 1
        taken[pid] = (taken[pid] or 0) + 1
        any_taken = true
        removed = true
      else
        removed = redis.call('LREM', processing, from, pid) > 0
      end
    end
    if removed then
      result = 'ok'
      applied = applied + 1
      settled[owner] = true
      doomed[ndoomed + 1] = claim
      doomed[ndoomed + 2] = owner
      ndoomed = ndoomed + 2
      if op == 'f' then
        nrejected = nrejected + 1
        rejected_at[nrejected] = i
        rejected[nrejected] = pid
        record_keys[nrejected] = KEYS[7 + 3 * n + keyed + reject_no]
        record_values[nrejected] = ARGV[extra_at[i]]
        failures = failures + 1
      else
        ndoomed = ndoomed + 1
        doomed[ndoomed] = job
        if op == 'l' then
          nreleased = nreleased + 1
          released[nreleased] = record
        elseif op == 'r' then
          nrequeued = nrequeued + 1
          requeued[nrequeued] = ARGV[extra_at[i]]
          failures = failures + 1
        elseif op == 'd' then
          waiting[nwaiting + 1] = tonumber(ARGV[extra_at[i] + 1])
          waiting[nwaiting + 2] = ARGV[extra_at[i]]
          nwaiting = nwaiting + 2
          failures = failures + 1
        else
          commits = commits + 1
        end
      end
      if op == 'o' then
        ndoomed = ndoomed + 1
        doomed[ndoomed] = KEYS[history_at]
      elseif history_at > 0 and history_record ~= '' then
        history_keys[#history_keys + 1] = KEYS[history_at]
        history_values[#history_values + 1] = history_record
      end
      if marker_at > 0 and (op == 'c' or op == 'o' or op == 'f')
          and redis.call('MGET', KEYS[marker_at])[1] == pid then
        ndoomed = ndoomed + 1
        doomed[ndoomed] = KEYS[marker_at]
      end
    end
  end
  results[i] = result
end

if any_taken then
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
  local kept, nkept = {}, 0
  for k = first, #window do
    if keep[k] then
      nkept = nkept + 1
      kept[nkept] = window[k]
    end
  end
  redis.call('LTRIM', processing, 0, -(#window - first + 2))
  if nkept > 0 then redis.call('RPUSH', processing, unpack(kept)) end
end
if ndoomed > 0 then redis.call('DEL', unpack(doomed)) end

if nrejected > 0 then
  redis.call('LPUSH', failed, unpack(rejected))
  -- After the push, as queue 5 orders it: the pid is listed before its record may expire.
  if job_ttl > 0 then
    for k = 1, nrejected do redis.call('EXPIRE', KEYS[6 + 3 * rejected_at[k]], job_ttl) end
  end
  for k = 1, nrejected do
    if record_values[k] ~= '' then
      redis.call('SET', record_keys[k], record_values[k], 'EX', record_ttl)
    end
  end
end
for k = 1, #history_keys do remember_failure(history_keys[k], history_values[k], record_ttl) end
if nrequeued > 0 then redis.call('LPUSH', ready, unpack(requeued)) end
if nwaiting > 0 then
  local now = tonumber(redis.call('TIME')[1])
  for k = 1, nwaiting, 2 do waiting[k] = now + waiting[k] end
  redis.call('ZADD', delayed, unpack(waiting))
end
if nreleased > 0 then
  local reversed = {}
  for k = nreleased, 1, -1 do reversed[#reversed + 1] = released[k] end
  redis.call('RPUSH', ready, unpack(reversed))
end
if commits > 0 then redis.call('INCRBY', KEYS[5], commits) end
if failures > 0 then redis.call('INCRBY', KEYS[6], failures) end
if applied > 0 then redis.call('DECRBY', KEYS[4], applied) end
return results
