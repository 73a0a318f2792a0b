local function remember_poison(reasons, times, now, raws, why)
  local added = 0
  for i = 1, #raws do
    local digest = redis.sha1hex(raws[i])
    redis.call('HSET', reasons, digest, now .. ' ' .. why[i])
    if redis.call('ZADD', times, now, digest) == 1 then added = added + 1 end
  end
  local over = redis.call('ZCARD', times) - 1000
  if over > added then over = added end
  if over > 0 then
    local oldest = redis.call('ZPOPMIN', times, over)
    for i = 1, #oldest, 2 do redis.call('HDEL', reasons, oldest[i]) end
  end
end
