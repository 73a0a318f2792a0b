local function remember_failure(key, failure_json, ttl)
  local kind = redis.call('TYPE', key)['ok']
  if kind ~= 'list' and kind ~= 'none' then redis.call('DEL', key) end
  redis.call('LPUSH', key, failure_json)
  if redis.call('LLEN', key) > 6 then
    redis.call('LSET', key, -2, redis.call('LINDEX', key, -1))
    redis.call('RPOP', key)
  end
  redis.call('EXPIRE', key, ttl)
end
