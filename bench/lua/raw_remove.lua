-- The raw ceiling's acknowledgement: remove the given payloads from the processing list,
-- each by value, scanning from the head where the newest entries are.
-- KEYS[1] processing list; ARGV[1..n] the payloads
for i = 1, #ARGV do
  redis.call('LREM', KEYS[1], 1, ARGV[i])
end
return #ARGV
