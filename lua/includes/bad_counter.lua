local function bad_counter(key)
  local value = redis.pcall('GET', key)  -- one call: a key of another type errors here
  if type(value) == 'table' and value['err'] then
    return redis.error_reply('QSTYPE ' .. key .. ' is ' .. redis.call('TYPE', key)['ok']
      .. ', expected string')
  end
  if value and value ~= '0' and not (#value <= 18 and string.match(value, '^%-?[1-9]%d*$')) then
    return redis.error_reply('QSTYPE ' .. key .. ' is "' .. value .. '", expected an integer')
  end
end
