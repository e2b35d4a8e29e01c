"""The server-side half of ``ValkeyStore`` (valkey.py): its Lua scripts, by name (``SCRIPTS``).

Each script is one atomic step on the server: every one that changes a line or frees capacity then admits the lines'
heads on their claims (``drain``), and each publishes what it did on ``<prefix>:events``. Each takes the key prefix as
``ARGV[1]``, the rest as the comment above it says; the keys are listed in valkey.py's docstring."""

from __future__ import annotations

from controlplane.store.base import DEAD_FIRSTS_S, LINE_CLASSES

# Shared by the scripts: a ticket as a JSON array, closing one (publishing it), a member leaving a line, a dead
# replica's removal, a line's first live member, the shared serve counts, an admission, and draining a model's lines on
# claims; fair share's counters (decision 0025): read and written as '%.17g' text (exact doubles), a line's fair pick
# (core/fairshare.py ``fair_pick``'s rule), a charge (its JSON: tenant, cost, prompt weight, output weight, weight, the
# numbers as text) and the lift.
_LIB = r"""
local p = ARGV[1]
local CLASSES = @CLASSES@
local DEAD_MS = @DEAD_MS@
local FIELDS = {'engine', 'model', 'admitted_at', 'lease', 'reserved', 'done', 'ttft', 'owner'}
local function record(id)
  local h = redis.call('HMGET', p .. ':t:' .. id, unpack(FIELDS))
  if not h[1] then return nil end
  return {id, h[1], h[2], h[3], h[4], h[5], h[6], h[7], h[8]}
end
local function clock()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local function publish(kind, by, payload, extra, blocks)
  redis.call('PUBLISH', p .. ':events', cjson.encode({kind, by, payload, extra, blocks or ''}))
end
local function leave(q, replica, rid)
  local m = replica .. '|' .. rid
  if redis.call('ZREM', p .. ':q:' .. q, m) == 0 then return false end
  redis.call('HDEL', p .. ':c:' .. q, m)
  local tenant = redis.call('HGET', p .. ':qt:' .. q, m)
  if tenant then
    redis.call('HDEL', p .. ':qt:' .. q, m)
    local fb = p .. ':fb:' .. string.match(q, '^(.*):%d+$')
    if redis.call('HINCRBY', fb, tenant, -1) <= 0 then redis.call('HDEL', fb, tenant) end
  end
  local held = redis.call('HGET', p .. ':qa:' .. q, rid)
  if held and string.match(held, '^(.-)|') == replica then redis.call('HDEL', p .. ':qa:' .. q, rid) end
  return true
end
local function purge(replica)
  local prefix = replica .. '|'
  local models = {}
  for _, q in ipairs(redis.call('SMEMBERS', p .. ':ml:' .. replica)) do
    local gone = false
    for _, m in ipairs(redis.call('ZRANGE', p .. ':q:' .. q, 0, -1)) do
      if string.sub(m, 1, #prefix) == prefix then
        local rid = string.sub(m, #prefix + 1)
        local held = redis.call('HGET', p .. ':qa:' .. q, rid)
        if held and string.match(held, '^(.-)|') == replica then
          redis.call('HSET', p .. ':qd:' .. q, rid, held)
          redis.call('PEXPIRE', p .. ':qd:' .. q, DEAD_MS)
        end
        leave(q, replica, rid)
        gone = true
      end
    end
    if gone then table.insert(models, string.match(q, '^(.*):%d+$')) end
  end
  redis.call('DEL', p .. ':ml:' .. replica)
  redis.call('SREM', p .. ':replicas', replica)
  publish('dead', replica, '', '')
  return models
end
local function first(model, k, newest)
  local q = model .. ':' .. k
  local qkey = p .. ':q:' .. q
  for _ = 1, 1000 do
    local m
    if newest then m = redis.call('ZRANGE', qkey, -1, -1) else m = redis.call('ZRANGE', qkey, 0, 0) end
    if #m == 0 then return nil end
    local replica, rid = string.match(m[1], '^(.-)|(.*)$')
    if replica and redis.call('EXISTS', p .. ':r:' .. replica) == 1 then return m[1] end
    if replica then
      purge(replica)
      leave(q, replica, rid)
    else
      redis.call('ZREM', qkey, m[1])
    end
  end
  return nil
end
local function fair_get(model, tenant)
  local v = redis.call('HGET', p .. ':fv:' .. model, tenant)
  if not v then return 0, 0 end
  local c, r = string.match(v, '^(.-)|(.*)$')
  return tonumber(c), tonumber(r)
end
local function fair_set(model, tenant, c, r)
  redis.call('HSET', p .. ':fv:' .. model, tenant, string.format('%.17g|%.17g', c, r))
end
local function fair_state(model)
  return cjson.encode({redis.call('HGET', p .. ':fl', model) or cjson.null,
                       redis.call('HGETALL', p .. ':fv:' .. model)})
end
local function fair_pick(model, k, newest)
  local q = model .. ':' .. k
  local qkey = p .. ':q:' .. q
  for _ = 1, 1000 do
    local line = redis.call('ZRANGE', qkey, 0, -1, 'WITHSCORES')
    if #line == 0 then return nil end
    local tenants, flat = {}, redis.call('HGETALL', p .. ':qt:' .. q)
    for i = 1, #flat, 2 do tenants[flat[i]] = flat[i + 1] end
    local heads, order = {}, {}
    for i = 1, #line, 2 do
      local t, seq = tenants[line[i]] or '', tonumber(line[i + 1])
      local h = heads[t]
      if not h then
        heads[t] = {seq, line[i]}
        table.insert(order, t)
      elseif (newest and seq > h[1]) or (not newest and seq < h[1]) then
        heads[t] = {seq, line[i]}
      end
    end
    local best, bc, br, bs
    for _, t in ipairs(order) do
      local c, r = fair_get(model, t)
      local s = heads[t][1]
      if newest then s = -s end
      if best == nil or c < bc or (c == bc and (r < br or (r == br and s < bs))) then
        best, bc, br, bs = heads[t][2], c, r, s
      end
    end
    local replica, rid = string.match(best, '^(.-)|(.*)$')
    if replica and redis.call('EXISTS', p .. ':r:' .. replica) == 1 then return best end
    if replica then
      purge(replica)
      leave(q, replica, rid)
    else
      redis.call('ZREM', qkey, best)
    end
  end
  return nil
end
local function fair_charge(model, id, text, lease, grace)
  local f = cjson.decode(text)
  local c, r = fair_get(model, f[1])
  local cost = tonumber(f[2])
  fair_set(model, f[1], c + cost, r + cost)
  redis.call('HSET', p .. ':fl', model, f[1])
  local key = p .. ':fc:' .. id
  redis.call('SET', key, cjson.encode({model, f[1], f[2], f[3], f[4], f[5]}))
  redis.call('PEXPIREAT', key, math.floor((tonumber(lease) + grace) * 1000))
end
local function fair_lift(model, tenant, credit)
  local floor = nil
  for _, t in ipairs(redis.call('HKEYS', p .. ':fb:' .. model)) do
    if t ~= tenant then
      local c = fair_get(model, t)
      if floor == nil or c < floor then floor = c end
    end
  end
  if floor == nil then
    local last = redis.call('HGET', p .. ':fl', model)
    if last then floor = fair_get(model, last) else floor = 0 end
  end
  floor = floor - credit
  local c, r = fair_get(model, tenant)
  if floor > c then fair_set(model, tenant, floor, r) end
end
local function serve(engine, at, hl)
  if hl <= 0 then return end
  local old = redis.call('HGET', p .. ':w', engine)
  local count, since = 1, at
  if old then
    local c0, a0 = string.match(old, '^(.-)|(.*)$')
    c0, a0 = tonumber(c0), tonumber(a0)
    if at >= a0 then
      count = c0 * math.pow(0.5, (at - a0) / hl) + 1
    else
      count, since = c0 + math.pow(0.5, (a0 - at) / hl), a0
    end
  end
  redis.call('HSET', p .. ':w', engine, string.format('%.6f|%.6f', count, since))
end
local function write(r, grace)
  local id, engine = r[1], r[2]
  local tkey = p .. ':t:' .. id
  redis.call('HSET', tkey, 'engine', engine, 'model', r[3], 'admitted_at', r[4], 'lease', r[5], 'reserved', r[6],
             'done', r[7], 'ttft', r[8], 'owner', r[9])
  redis.call('PEXPIREAT', tkey, math.floor((tonumber(r[5]) + grace) * 1000))
  redis.call('SADD', p .. ':e:' .. engine, id)
  redis.call('HINCRBY', p .. ':kv', engine, tonumber(r[6]))
  redis.call('ZADD', p .. ':leases', r[5], id)
end
local function fits(r, cap, kvlimit, slots, plain)
  if cap >= 0 and redis.call('SCARD', p .. ':e:' .. r[2]) >= cap then return 'cap' end
  local held = tonumber(redis.call('HGET', p .. ':kv', r[2]) or '0')
  if kvlimit >= 0 and held + tonumber(r[6]) > kvlimit then return 'kv' end
  if slots and slots >= 0 then  -- adapter slots: the distinct models of the engine's tickets, base models aside
    local skip = {}
    for _, m in ipairs(plain or {}) do skip[m] = true end
    if skip[r[3]] then return nil end
    local seen, n = {}, 0
    for _, tid in ipairs(redis.call('SMEMBERS', p .. ':e:' .. r[2])) do
      local m = redis.call('HGET', p .. ':t:' .. tid, 'model')
      if m == r[3] then return nil end
      if m and not skip[m] and not seen[m] then seen[m], n = true, n + 1 end
    end
    if n >= slots then return 'adapter_slots' end
  end
  return nil
end
local function admit(r, session, session_ttl, grace, hl, charge)
  write(r, grace)
  serve(r[2], tonumber(r[4]), hl)
  if session ~= '' then redis.call('SET', p .. ':s:' .. session, r[2], 'EX', session_ttl) end
  if charge and charge ~= '' then fair_charge(r[3], r[1], charge, r[5], grace) end
end
-- A claim: {record, cap, kv limit, session, until (server time), block hashes, session ttl, grace, serve half-life,
-- fair charge ('' for none), adapter slots (-1: none), the engine's base models}
local function drain(model)
  local n, now = 0, nil
  local claims = {}
  for k = 0, CLASSES - 1 do claims[k + 1] = p .. ':c:' .. model .. ':' .. k end
  if redis.call('EXISTS', unpack(claims)) == 0 then return 0 end  -- no claim anywhere in the model's lines
  for k = 0, CLASSES - 1 do
    local q = model .. ':' .. k
    local ckey = p .. ':c:' .. q
    while true do
      local head = first(model, k, false)
      if not head then break end
      local text = redis.call('HGET', ckey, head)
      if not text then return n end
      local c = cjson.decode(text)
      local r = c[1]
      now = now or clock()
      if tonumber(c[5]) < now or redis.call('EXISTS', p .. ':t:' .. r[1]) == 1 then
        redis.call('HDEL', ckey, head)
        return n
      end
      if fits(r, tonumber(c[2]), tonumber(c[3]), tonumber(c[11] or -1), c[12]) then return n end
      admit(r, c[4], c[7], tonumber(c[8]), tonumber(c[9]), c[10])
      local replica = string.match(head, '^(.-)|')
      leave(q, replica, r[1])
      publish('claimed', replica, cjson.encode(r), c[4], c[6])
      n = n + 1
    end
  end
  return n
end
local function close(id, by)
  local r = record(id)
  redis.call('ZREM', p .. ':leases', id)
  if not r then return nil end
  redis.call('DEL', p .. ':t:' .. id)
  redis.call('SREM', p .. ':e:' .. r[2], id)
  redis.call('HINCRBY', p .. ':kv', r[2], -tonumber(r[6]))
  local text = cjson.encode(r)
  publish('released', by, text, '')
  drain(r[3])
  return text
end
""".replace("@CLASSES@", str(LINE_CLASSES)).replace("@DEAD_MS@", str(int(DEAD_FIRSTS_S * 1000)))

# The scripts that write an admission or a park, as functions of their arguments (``A``: as the scripts' ARGV), so
# that ``offer`` runs both in one step.
# reserve's A: prefix, ticket record (JSON array), cap (-1: none), kv limit (-1: none), queue rule, class, session,
#       session ttl s, key grace s, the prompt's block hashes (hex, only passed on), claim fresh s, serve half-life s,
#       fair charge (JSON; '' for none), adapter slots (-1: none), the engine's base models (JSON list). A FAIR
#       refusal carries the model's counters (``fair_state``).
# park's A: prefix, queue key suffix, replica, request id, now (shared time), model, claim (JSON, its fourth field
#       fresh s; '' for none), '1' when the member counts for a tenant (then lifted), the tenant, its lift credit
#       (the counter units below the backlogged minimum the lift may leave it). Returns when the
#       request first parked.
_LINE_LIB = r"""
local function reserve(A)
  local r = cjson.decode(A[2])
  local id, engine, model, owner = r[1], r[2], r[3], r[9]
  local cap, kvlimit, rule, klass = tonumber(A[3]), tonumber(A[4]), A[5], tonumber(A[6])
  local session, fresh, hl = A[7], tonumber(A[11]), tonumber(A[12])
  local slots, plain = tonumber(A[14]), cjson.decode(A[15])
  drain(model)
  if redis.call('EXISTS', p .. ':t:' .. id) == 1 then return {'exists'} end
  local mine = owner .. '|' .. id
  local q = model .. ':' .. klass
  if rule ~= 'none' then
    local higher = klass
    if rule == 'arrival' then higher = klass + 1 end
    local queued = false
    local fair = rule == 'fair' or rule == 'fair_newest'
    for k = 0, higher - 1 do if first(model, k, false) then queued = true break end end
    if not queued and (rule == 'oldest' or rule == 'newest') then
      local head = first(model, klass, rule == 'newest')
      queued = head ~= nil and head ~= mine
    elseif not queued and fair then
      local pick = fair_pick(model, klass, rule == 'fair_newest')
      queued = pick ~= nil and pick ~= mine
    end
    if queued then
      if rule == 'oldest' and fresh > 0 and redis.call('ZSCORE', p .. ':q:' .. q, mine) then
        redis.call('HSET', p .. ':c:' .. q, mine, cjson.encode({r, cap, kvlimit, session, clock() + fresh, A[10],
                                                               tonumber(A[8]), tonumber(A[9]), hl, A[13], slots,
                                                               plain}))
      end
      if fair then return {'queued', fair_state(model)} end
      return {'queued'}
    end
  end
  local why = fits(r, cap, kvlimit, slots, plain)
  if why then
    local out = {why}
    for _, tid in ipairs(redis.call('SMEMBERS', p .. ':e:' .. engine)) do
      local t = record(tid)
      if t then table.insert(out, cjson.encode(t)) end
    end
    return out
  end
  admit(r, session, A[8], tonumber(A[9]), hl, A[13])
  if not leave(q, owner, id) then
    local parked = redis.call('HGET', p .. ':qa:' .. q, id)
    if parked then leave(q, string.match(parked, '^(.-)|'), id) end  -- parked by a replica its Check was retried after
  end
  publish('admitted', owner, A[2], session, A[10])
  drain(model)
  return {'ok'}
end
local function park(A)
  local q, me, rid, since = A[2], A[3], A[4], A[5]
  local held = redis.call('HGET', p .. ':qa:' .. q, rid)
  local moved = false
  if held then
    local replica, at = string.match(held, '^(.-)|(.*)$')
    if replica ~= me and leave(q, replica, rid) then  -- its Check was asked again here: it keeps its first park time
      since, moved = at, true
      publish('unparked', me, rid, A[6])
    end
  end
  if not moved then
    local dead = redis.call('HGET', p .. ':qd:' .. q, rid)
    if dead then  -- ... asked again after its replica was found dead
      local replica, at = string.match(dead, '^(.-)|(.*)$')
      if replica ~= me then since = at end
      redis.call('HDEL', p .. ':qd:' .. q, rid)
    end
  end
  local m = me .. '|' .. rid
  if A[8] == '1' and not redis.call('HGET', p .. ':qt:' .. q, m) then
    local fb = p .. ':fb:' .. A[6]
    if tonumber(redis.call('HGET', fb, A[9]) or '0') <= 0 then fair_lift(A[6], A[9], tonumber(A[10])) end
    redis.call('HINCRBY', fb, A[9], 1)
    redis.call('HSET', p .. ':qt:' .. q, m, A[9])
  end
  redis.call('ZADD', p .. ':q:' .. q, redis.call('INCR', p .. ':seq'), m)
  redis.call('HSET', p .. ':qa:' .. q, rid, me .. '|' .. since)
  redis.call('SADD', p .. ':ml:' .. me, q)
  if A[7] ~= '' then
    local c = cjson.decode(A[7])
    c[5] = clock() + tonumber(c[5])
    redis.call('HSET', p .. ':c:' .. q, m, cjson.encode(c))
  end
  drain(A[6])
  return since
end
"""

_RESERVE = _LIB + _LINE_LIB + r"""
return reserve(ARGV)
"""

# ARGV: prefix, ticket id, by
_RELEASE = _LIB + r"""
return close(ARGV[2], ARGV[3])
"""

# ARGV: prefix, now, limit, by. A lapsed ticket's fair charge goes with it (no settle will come: the estimate stands).
_EXPIRE = _LIB + r"""
local out = {}
for _, id in ipairs(redis.call('ZRANGEBYSCORE', p .. ':leases', '-inf', ARGV[2], 'LIMIT', 0, tonumber(ARGV[3]))) do
  redis.call('DEL', p .. ':fc:' .. id)
  local text = close(id, ARGV[4])
  if text then table.insert(out, text) end
end
return out
"""

# ARGV: prefix, JSON array of ticket records, key grace s, by
_RESTORE = _LIB + r"""
local n = 0
for _, r in ipairs(cjson.decode(ARGV[2])) do
  if redis.call('EXISTS', p .. ':t:' .. r[1]) == 0 then
    write(r, tonumber(ARGV[3]))
    publish('admitted', ARGV[4], cjson.encode(r), '')
    n = n + 1
  end
end
return n
"""

# ARGV: park's A. Returns when the request first parked.
_PARK = _LIB + _LINE_LIB + r"""
return park(ARGV)
"""

# ARGV: prefix, reserve's A[2..15], park's A[2..10]. Offers a park as an arrival (``reserve``); refused, parks it (with
# its claim only when refused for the line alone). Returns {'ok'}, or {refusal, first park time, the engine's
# tickets on a CAP, KV or adapter_slots refusal...}.
_OFFER = _LIB + _LINE_LIB + r"""
local R, P = {ARGV[1]}, {ARGV[1]}
for i = 2, 15 do R[i] = ARGV[i] end
for i = 16, 24 do P[i - 14] = ARGV[i] end
local out = reserve(R)
if out[1] == 'ok' then return out end
if out[1] ~= 'queued' then P[7] = '' end
table.insert(out, 2, park(P))
return out
"""

# ARGV: prefix, ticket id, prompt tokens, output tokens. Corrects the ticket's tenant's counter by its real usage priced
# with the charge's weights (base.py ``FairCharge.priced``); returns the correction as text, or nil without a charge.
_SETTLE = _LIB + r"""
local key = p .. ':fc:' .. ARGV[2]
local text = redis.call('GET', key)
if not text then return false end
redis.call('DEL', key)
local f = cjson.decode(text)
local cost = (tonumber(f[4]) * tonumber(ARGV[3]) + tonumber(f[5]) * tonumber(ARGV[4])) / tonumber(f[6])
local delta = cost - tonumber(f[3])
local c, r = fair_get(f[1], f[2])
fair_set(f[1], f[2], c + delta, r + delta)
return string.format('%.17g', delta)
"""

# ARGV: prefix, model. The model's counters (``fair_state``).
_COUNTERS = _LIB + r"""
return fair_state(ARGV[2])
"""

# ARGV: prefix, queue key suffix, replica, model, then pairs of request id and claim (JSON, its fifth field fresh s)
_CLAIM = _LIB + r"""
local q, me = ARGV[2], ARGV[3]
local now = clock()
for i = 5, #ARGV, 2 do
  local m = me .. '|' .. ARGV[i]
  if redis.call('ZSCORE', p .. ':q:' .. q, m) then
    local c = cjson.decode(ARGV[i + 1])
    c[5] = now + tonumber(c[5])
    redis.call('HSET', p .. ':c:' .. q, m, cjson.encode(c))
  end
end
drain(ARGV[4])
return 1
"""

# ARGV: prefix, queue key suffix, replica, request id, model
_UNPARK = _LIB + r"""
if leave(ARGV[2], ARGV[3], ARGV[4]) then
  publish('unparked', ARGV[3], ARGV[4], ARGV[5])
  drain(ARGV[5])
  return 1
end
return 0
"""

# ARGV: prefix, replica, lapse ms. Returns 0 when the replica's heartbeat had lapsed (or never was), else 1.
_HEARTBEAT = r"""
local p = ARGV[1]
local was = redis.call('SET', p .. ':r:' .. ARGV[2], '1', 'PX', ARGV[3], 'GET')
redis.call('SADD', p .. ':replicas', ARGV[2])
if was then return 1 end
return 0
"""

# ARGV: prefix. Removes every replica whose heartbeat lapsed; returns their ids.
_REAP = _LIB + r"""
local dead = {}
for _, replica in ipairs(redis.call('SMEMBERS', p .. ':replicas')) do
  if redis.call('EXISTS', p .. ':r:' .. replica) == 0 then
    for _, model in ipairs(purge(replica)) do drain(model) end
    table.insert(dead, replica)
  end
end
return dead
"""

# ARGV: prefix, replica, lapse ms. A former process of this replica id left members: they go (their Checks died with
# it).
_OPEN = _LIB + r"""
if redis.call('EXISTS', p .. ':ml:' .. ARGV[2]) == 1 then
  for _, model in ipairs(purge(ARGV[2])) do drain(model) end
end
redis.call('SET', p .. ':r:' .. ARGV[2], '1', 'PX', ARGV[3])
redis.call('SADD', p .. ':replicas', ARGV[2])
return 1
"""


SCRIPTS: dict[str, str] = {
    "reserve": _RESERVE, "release": _RELEASE, "expire": _EXPIRE, "restore": _RESTORE, "park": _PARK, "offer": _OFFER,
    "unpark": _UNPARK, "claim": _CLAIM, "settle": _SETTLE, "counters": _COUNTERS, "heartbeat": _HEARTBEAT, "reap": _REAP, "open": _OPEN,
}
"""Every script ``ValkeyStore`` registers, by the name it runs it under."""
