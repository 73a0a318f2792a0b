-- peek: entries of a list from its oldest end (the tail: entries are LPUSHed), each as its
-- length, its first bytes and the SHA1 of all its bytes (hex: what the poison reason store
-- is keyed by), so that an entry of any size (poison keeps what no handler could take,
-- oversized ones included) never crosses the wire whole. Read only.
--
-- KEYS[1]  list                    {ns}.poison.{q}
-- ARGV[1]  start                   position from the oldest (0 = the oldest)
-- ARGV[2]  count                   entries (1 .. 1000)
-- ARGV[3]  limit                   bytes of each entry returned (1 .. 2^31 - 1)
--
-- Returns up to count triples {length, first bytes, SHA1 hex}, oldest first.

--- @include "includes/whole"

local start = whole(ARGV[1], 0, 2147483647)
local count = whole(ARGV[2], 1, 1000)
local limit = whole(ARGV[3], 1, 2147483647)
if not (start and count and limit) or #ARGV ~= 3 or #KEYS ~= 1 then
  return redis.error_reply('QSARG peek needs 1 key, a start, a count (at most 1000) and a '
    .. 'limit in bytes')
end
local actual = redis.call('TYPE', KEYS[1])['ok']
if actual ~= 'list' and actual ~= 'none' then
  return redis.error_reply('QSTYPE ' .. KEYS[1] .. ' is ' .. actual .. ', expected list')
end
local window = redis.call('LRANGE', KEYS[1], -(start + count), -(start + 1))
local found = {}
for i = #window, 1, -1 do
  local entry = window[i]
  found[#found + 1] = {#entry, string.sub(entry, 1, limit), redis.sha1hex(entry)}
end
return found
