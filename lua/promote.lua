-- promote: move retries whose backoff is over from the delayed set to the ready list, at
-- its producer end (as an immediate retry is LPUSHed), the earliest due consumed first.
-- One atomic step per call: ZRANGEBYSCORE then ZREM and LPUSH of what was read, so two
-- supervisors promoting at once never move one envelope twice (the second finds it gone).
-- 'all' moves every envelope whatever its due time: the rollback to PHP workers, which
-- never read the set, empties it this way (drain).
--
-- Each envelope is stamped with this server's time as it moves (issue 39.1): queue 5's
-- sweep takes a delivery whose claim lapsed once its timestamp is older than reapAfter
-- (a worker that never renews, such as Workerman's, may still run it), so a retry must
-- look as young as a fresh message when it becomes ready, not as old as its backoff (PHP's
-- retryPayload() stamps time() when it pushes). The script parses no JSON: a member is
-- the bytes broker.envelope.requeued() wrote (settle.lua parks them as they are; older
-- versions of ours parked the same layout), {"pid":"...","queue":"...","timestamp":<digits>,
-- "payload":..., and the digits after the first ,"timestamp": are that field (a " inside a
-- JSON string is always escaped, so the pid and the queue cannot hold those bytes); they
-- are replaced, and the rest is kept byte for byte. A member of any other shape moves as
-- it is. (A member stays a whole envelope in the set, so an older promote.lua moving it
-- during a rolling upgrade still pushes a valid one: parked, it carries its due time by the
-- parking host's clock.)
--
-- KEYS[1]   delayed retries (zset)  {ns}.supervisor-delayed.{q}  envelope -> due (unix s)
-- KEYS[2]   ready list              {ns}.queue.{q}
-- ARGV[1]   limit                   envelopes moved at most (1 .. 1000)
-- ARGV[2]   which                   'due' (score <= TIME) or 'all'
--
-- Returns how many envelopes were moved.

--- @include "includes/wrong_type"

-- The decimal digits of a whole number from low to high (2^31 - 1 at most: a count, a
-- lease or a TTL that EXPIRE, SETEX and ZADD all take), else nil. Checked before the first
-- write: Lua does not undo the writes made before a command that fails.
--- @include "includes/whole"

local delayed, ready = KEYS[1], KEYS[2]
local limit, which = whole(ARGV[1], 1, 1000), ARGV[2]
if #KEYS ~= 2 or #ARGV ~= 2 or not limit or (which ~= 'due' and which ~= 'all') then
  return redis.error_reply('QSARG promote needs 2 keys, a limit of 1 to 1000 and due or all')
end
local err = wrong_type(delayed, 'zset') or wrong_type(ready, 'list')
if err then return err end

-- The envelope with its timestamp replaced by now (decimal digits), or as it is.
local OPENING, FIELD, NEXT = '{"pid":"', ',"timestamp":', ',"payload":'
local function stamped(member, now)
  if string.sub(member, 1, #OPENING) ~= OPENING then return member end
  local at = string.find(member, FIELD, #OPENING + 1, true)
  if not at then return member end
  local from = at + #FIELD
  local digits = string.match(member, '^%d+', from)
  if not digits then return member end
  local after = from + #digits
  if string.sub(member, after, after + #NEXT - 1) ~= NEXT then return member end
  return string.sub(member, 1, from - 1) .. now .. string.sub(member, after)
end

local now = redis.call('TIME')[1]
local upto = '+inf'
if which == 'due' then upto = now end
local due = redis.call('ZRANGEBYSCORE', delayed, '-inf', upto, 'LIMIT', 0, limit)
if #due == 0 then return 0 end
redis.call('ZREM', delayed, unpack(due))
local envelopes = {}
for i = 1, #due do envelopes[i] = stamped(due[i], now) end
redis.call('LPUSH', ready, unpack(envelopes))
return #due
