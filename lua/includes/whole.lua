local function whole(value, low, high)
  local number = value and #value <= 10 and string.match(value, '^%d+$') and tonumber(value)
  if number and number >= low and number <= high then return number end
end
