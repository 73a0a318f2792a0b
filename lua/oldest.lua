-- oldest: the next payload to be received (the tail of the ready list), for the age shown
-- on the progress line, only if it is no longer than the limit; a longer one is answered
-- with its length, so that an oversized payload never crosses the wire for a log line.
-- Read only.
--
-- KEYS[1]  ready list              {ns}.queue.{q}
-- ARGV[1]  limit                   bytes (>= 1)
--
-- Returns nil (an empty list), the payload, or its length (an integer) when it is longer.

if #ARGV ~= 1 then return redis.error_reply('QSARG oldest needs a limit in bytes') end
local limit = #ARGV[1] <= 10 and string.match(ARGV[1], '^%d+$') and tonumber(ARGV[1])
if not limit or limit < 1 then
  return redis.error_reply('QSARG oldest needs a limit in bytes')
end
local actual = redis.call('TYPE', KEYS[1])['ok']
if actual ~= 'list' and actual ~= 'none' then
  return redis.error_reply('QSTYPE ' .. KEYS[1] .. ' is ' .. actual .. ', expected list')
end
local raw = redis.call('LINDEX', KEYS[1], -1)
if raw and #raw > limit then return #raw end
return raw
