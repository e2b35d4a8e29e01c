"""The ``Store`` on Valkey or Redis (standalone or behind Sentinel; not Cluster: the scripts touch keys they compute).

Every change is one server-side Lua script, so it is atomic against every other replica's: ``reserve`` checks the line,
the engine's cap and its reserved KV and then writes, or refuses, in one step; ``release`` and lease expiry close a ticket
once, whoever asks first. Each script also publishes what it did on ``<prefix>:events``, which every replica's
``listen`` turns into ``StoreEvent``s for its mirror.

Keys (``<p>`` = ``store.prefix``, default ``sluice``)::

    <p>:t:<ticket>          hash   engine model admitted_at lease reserved done ttft owner  (expires lease + grace)
    <p>:e:<engine>          set    open ticket ids of the engine (its cap is checked against SCARD)
    <p>:kv                  hash   engine -> KV tokens its open tickets reserve
    <p>:leases              zset   ticket id by lease deadline (any replica's sweep closes the lapsed ones)
    <p>:q:<model>:<class>   zset   "<replica>|<request id>" by arrival sequence (<p>:seq)
    <p>:qa:<model>:<class>  hash   request id -> "<replica>|<when it first parked>", one per member of the line above
    <p>:s:<session>         string the session's engine (EX store.session_ttl_seconds)
    <p>:r:<replica>         string a replica's heartbeat (PX store.heartbeat_ttl_seconds); absent = dead

A ticket's hash also expires ``TICKET_KEY_GRACE_S`` after its lease as a backstop; the lease sweep closes it long before.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from controlplane.core.model import Ticket
from controlplane.core.prefix import blocks_from_text, blocks_text
from controlplane.store.base import (
    Claim, EventKind, Refusal, Reserved, StoreEvent, StoreState, StoreUnavailable, member,
)

log = logging.getLogger("sluice.store")

TICKET_KEY_GRACE_S = 3600.0
RECONNECT_S = 0.5

# Shared by the scripts: a ticket as a JSON array, closing one (publishing it), a member leaving a line, and a line's
# first live member.
_LIB = r"""
local p = ARGV[1]
local FIELDS = {'engine', 'model', 'admitted_at', 'lease', 'reserved', 'done', 'ttft', 'owner'}
local function record(id)
  local h = redis.call('HMGET', p .. ':t:' .. id, unpack(FIELDS))
  if not h[1] then return nil end
  return {id, h[1], h[2], h[3], h[4], h[5], h[6], h[7], h[8]}
end
local function close(id, by)
  local r = record(id)
  redis.call('ZREM', p .. ':leases', id)
  if not r then return nil end
  redis.call('DEL', p .. ':t:' .. id)
  redis.call('SREM', p .. ':e:' .. r[2], id)
  redis.call('HINCRBY', p .. ':kv', r[2], -tonumber(r[6]))
  local text = cjson.encode(r)
  redis.call('PUBLISH', p .. ':events', cjson.encode({'released', by, text, ''}))
  return text
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
local function leave(q, replica, rid)
  if redis.call('ZREM', p .. ':q:' .. q, replica .. '|' .. rid) == 0 then return false end
  local held = redis.call('HGET', p .. ':qa:' .. q, rid)
  if held and string.match(held, '^(.-)|') == replica then redis.call('HDEL', p .. ':qa:' .. q, rid) end
  return true
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
    if replica then leave(q, replica, rid) else redis.call('ZREM', qkey, m[1]) end
  end
  return nil
end
"""

# ARGV: prefix, ticket record (JSON array), cap (-1: none), kv limit (-1: none), queue rule, class, session,
#       session ttl s, key grace s, the prompt's block hashes (hex, only passed on in the event)
_RESERVE = _LIB + r"""
local r = cjson.decode(ARGV[2])
local id, engine, model, owner = r[1], r[2], r[3], r[9]
local cap, kvlimit, rule, klass = tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6])
local session = ARGV[7]
if redis.call('EXISTS', p .. ':t:' .. id) == 1 then return {'exists'} end
local mine = owner .. '|' .. id
if rule ~= 'none' then
  local higher = klass
  if rule == 'arrival' then higher = klass + 1 end
  for k = 0, higher - 1 do if first(model, k, false) then return {'queued'} end end
  if rule ~= 'arrival' then
    local head = first(model, klass, rule == 'newest')
    if head and head ~= mine then return {'queued'} end
  end
end
local ekey = p .. ':e:' .. engine
local function refuse(why)
  local out = {why}
  for _, tid in ipairs(redis.call('SMEMBERS', ekey)) do
    local t = record(tid)
    if t then table.insert(out, cjson.encode(t)) end
  end
  return out
end
if cap >= 0 and redis.call('SCARD', ekey) >= cap then return refuse('cap') end
local held = tonumber(redis.call('HGET', p .. ':kv', engine) or '0')
if kvlimit >= 0 and held + tonumber(r[6]) > kvlimit then return refuse('kv') end
write(r, tonumber(ARGV[9]))
local q = model .. ':' .. klass
if not leave(q, owner, id) then
  local parked = redis.call('HGET', p .. ':qa:' .. q, id)
  if parked then leave(q, string.match(parked, '^(.-)|'), id) end  -- parked by a replica its Check was retried after
end
if session ~= '' then redis.call('SET', p .. ':s:' .. session, engine, 'EX', ARGV[8]) end
redis.call('PUBLISH', p .. ':events', cjson.encode({'admitted', owner, ARGV[2], session, ARGV[10]}))
return {'ok'}
"""

# ARGV: prefix, ticket id, by
_RELEASE = _LIB + r"""
return close(ARGV[2], ARGV[3])
"""

# ARGV: prefix, now, limit, by
_EXPIRE = _LIB + r"""
local out = {}
for _, id in ipairs(redis.call('ZRANGEBYSCORE', p .. ':leases', '-inf', ARGV[2], 'LIMIT', 0, tonumber(ARGV[3]))) do
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
    redis.call('PUBLISH', p .. ':events', cjson.encode({'admitted', ARGV[4], cjson.encode(r), ''}))
    n = n + 1
  end
end
return n
"""

# ARGV: prefix, queue key suffix, replica, request id, now (shared time), model. Returns when the request first parked.
_PARK = _LIB + r"""
local q, me, rid, since = ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local held = redis.call('HGET', p .. ':qa:' .. q, rid)
if held then
  local replica, at = string.match(held, '^(.-)|(.*)$')
  if replica ~= me and leave(q, replica, rid) then  -- its Check was asked again here: it keeps its first park time
    since = at
    redis.call('PUBLISH', p .. ':events', cjson.encode({'unparked', me, rid, ARGV[6]}))
  end
end
redis.call('ZADD', p .. ':q:' .. q, redis.call('INCR', p .. ':seq'), me .. '|' .. rid)
redis.call('HSET', p .. ':qa:' .. q, rid, me .. '|' .. since)
return since
"""

# ARGV: prefix, queue key suffix, replica, request id, model
_UNPARK = _LIB + r"""
if leave(ARGV[2], ARGV[3], ARGV[4]) then
  redis.call('PUBLISH', p .. ':events', cjson.encode({'unparked', ARGV[3], ARGV[4], ARGV[5]}))
  return 1
end
return 0
"""


def _record(ticket: Ticket, owner: str) -> list[Any]:
    return [ticket.ticket_id, ticket.engine, ticket.model, repr(ticket.admitted_at), repr(ticket.lease_deadline),
            str(ticket.reserved_tokens), repr(ticket.expected_done_at), repr(ticket.expected_ttft_s), owner]


def _ticket(record: list[Any]) -> tuple[Ticket, str]:
    tid, engine, model, admitted, lease, reserved, done, ttft, owner = record
    return Ticket(str(tid), str(engine), str(model), float(admitted), float(lease), int(float(reserved)), float(done),
                  float(ttft)), str(owner)


def _unavailable(op: str, exc: BaseException) -> BaseException:
    """What a failed call raises: ``StoreUnavailable``, or ``CancelledError`` when the calling task is being cancelled
    (redis-py can turn a cancellation inside a call into a connection error; swallowed as the store being down, it
    would leave a cancelled task running)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        return asyncio.CancelledError()
    return StoreUnavailable(f"{op}: {exc}")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class ValkeyStore:
    def __init__(self, url: str, replica_id: str, prefix: str = "sluice", timeout_s: float = 0.5,
                 session_ttl_s: float = 3600.0, max_connections: int = 64) -> None:
        self.url = url
        self.replica_id = replica_id
        self.prefix = prefix
        self.timeout_s = timeout_s
        self.session_ttl_s = session_ttl_s
        # A bounded pool whose callers wait (up to the timeout) for a free connection: redis-py's default pool raises
        # "Too many connections" past 100 concurrent calls, which a 2000-request burst reaches and which would count
        # as the store being down.
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=timeout_s, socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s, retry_on_timeout=False)
        self.client: aioredis.Redis = aioredis.Redis(connection_pool=pool)
        # The subscription's own client has no read timeout: a quiet channel is normal, a closed socket still raises.
        self._subscriber: aioredis.Redis = aioredis.Redis.from_url(url, socket_connect_timeout=timeout_s)
        self._scripts = {name: self.client.register_script(text) for name, text in (
            ("reserve", _RESERVE), ("release", _RELEASE), ("expire", _EXPIRE), ("restore", _RESTORE),
            ("park", _PARK), ("unpark", _UNPARK))}

    async def _run(self, name: str, *args: Any) -> Any:
        try:
            return await self._scripts[name](args=[self.prefix, *args])
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            raise _unavailable(f"{name}", exc) from exc

    async def open(self) -> None:
        await self.heartbeat(5.0)

    async def close(self) -> None:
        try:
            await self.client.delete(f"{self.prefix}:r:{self.replica_id}")
        except (RedisError, OSError):
            pass
        await self.client.aclose()
        await self._subscriber.aclose()

    async def reserve(self, claim: Claim) -> Reserved:
        t = claim.ticket
        answer = await self._run(
            "reserve", json.dumps(_record(t, self.replica_id)), -1 if claim.cap is None else claim.cap,
            -1 if claim.kv_limit is None else claim.kv_limit, claim.queue.value, claim.klass, claim.session or "",
            int(self.session_ttl_s), TICKET_KEY_GRACE_S, blocks_text(claim.prefix_blocks))
        verdict = _text(answer[0])
        if verdict == "ok":
            return Reserved()
        tickets = tuple(_ticket(json.loads(_text(x)))[0] for x in answer[1:])
        return Reserved(Refusal(verdict), tickets)

    async def release(self, ticket_id: str) -> Ticket | None:
        text = await self._run("release", ticket_id, self.replica_id)
        return None if text is None else _ticket(json.loads(_text(text)))[0]

    async def expire(self, now: float, limit: int = 256) -> list[Ticket]:
        texts = await self._run("expire", repr(now), limit, self.replica_id)
        return [_ticket(json.loads(_text(x)))[0] for x in texts]

    async def restore(self, tickets: list[Ticket]) -> int:
        if not tickets:
            return 0
        return int(await self._run("restore", json.dumps([_record(t, self.replica_id) for t in tickets]),
                                   TICKET_KEY_GRACE_S, self.replica_id))

    async def park(self, model: str, klass: int, request_id: str, at: float) -> float:
        return float(_text(await self._run("park", f"{model}:{klass}", self.replica_id, request_id, repr(at), model)))

    async def unpark(self, model: str, klass: int, request_id: str) -> bool:
        return bool(await self._run("unpark", f"{model}:{klass}", self.replica_id, request_id, model))

    async def members(self, model: str, klass: int) -> list[str]:
        mine = member(self.replica_id, "")
        try:
            line = await self.client.zrange(f"{self.prefix}:q:{model}:{klass}", 0, -1)
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            raise _unavailable(f"members", exc) from exc
        return [m[len(mine):] for m in map(_text, line) if m.startswith(mine)]

    async def heartbeat(self, ttl_s: float) -> None:
        try:
            await self.client.set(f"{self.prefix}:r:{self.replica_id}", "1", px=max(1, int(ttl_s * 1000)))
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            raise StoreUnavailable(f"heartbeat: {exc}") from exc

    async def load(self) -> StoreState:
        try:
            tickets: list[tuple[Ticket, str]] = []
            async for key in self.client.scan_iter(match=f"{self.prefix}:t:*", count=1000):
                values = await self.client.hmget(key, ["engine", "model", "admitted_at", "lease", "reserved", "done",
                                                       "ttft", "owner"])
                if values[0] is not None:
                    tickets.append(_ticket([_text(key).rsplit(":t:", 1)[1], *(_text(v) for v in values)]))
            sessions: dict[str, str] = {}
            async for key in self.client.scan_iter(match=f"{self.prefix}:s:*", count=1000):
                engine = await self.client.get(key)
                if engine is not None:
                    sessions[_text(key).rsplit(":s:", 1)[1]] = _text(engine)
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            raise _unavailable(f"load", exc) from exc
        return StoreState(tuple(tickets), sessions)

    async def listen(self, handler: Callable[[StoreEvent], None], on_connected: Callable[[], None]) -> None:
        channel = f"{self.prefix}:events"
        while True:
            pubsub = self._subscriber.pubsub()
            try:
                await pubsub.subscribe(channel)
                on_connected()
                while True:
                    # No socket timeout on a subscription: it is quiet whenever nothing happens.
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=None)
                    if message is not None and message.get("type") == "message":
                        event = self._event(_text(message["data"]))
                        if event is not None and event.replica != self.replica_id:
                            handler(event)
            except (RedisError, OSError, asyncio.TimeoutError) as exc:
                log.warning("store subscription lost (%s); reconnecting in %.1fs", exc, RECONNECT_S)
            finally:
                try:
                    await pubsub.aclose()
                except (RedisError, OSError):
                    pass
            await asyncio.sleep(RECONNECT_S)

    @staticmethod
    def _event(text: str) -> StoreEvent | None:
        kind, by, payload, extra, *prefix = json.loads(text)  # an admission's fifth field: its prompt's block hashes
        if kind == EventKind.UNPARKED:
            return StoreEvent(EventKind.UNPARKED, by, payload, model=extra)
        ticket, _ = _ticket(json.loads(payload))
        blocks = blocks_from_text(prefix[0]) if prefix and isinstance(prefix[0], str) else ()
        return StoreEvent(EventKind(kind), by, ticket.ticket_id, ticket, extra or None, ticket.model, blocks)
