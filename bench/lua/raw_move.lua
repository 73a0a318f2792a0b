-- The raw ceiling's reserve: move up to N payloads from the ready list to a processing
-- list and return them (no registration, no owner, no counters).
-- KEYS[1] ready list, KEYS[2] processing list; ARGV[1] n
local payloads = redis.call('RPOP', KEYS[1], tonumber(ARGV[1]))
if not payloads then return {} end
redis.call('LPUSH', KEYS[2], unpack(payloads))
return payloads
