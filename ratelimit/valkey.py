"""The shared backend: every charge and every settle is one Lua script run atomically inside Valkey (or Redis), so any
number of limiter instances (control-plane replicas) on one server enforce one budget exactly.

The scripts are ``core.py``'s steps written in Lua: ``CHARGE`` is ``check_meter`` + ``decide_charge`` +
``open_charge``, ``SETTLE`` is ``settle_meter`` per meter; both hand raw numbers back, and the verdict is built by the
same Python code as the memory backend's. They run by ``EVALSHA``; on ``NOSCRIPT`` the script is loaded and the call
repeated once. Keys live under ``key_prefix`` (``sluice:rl:``; listed with their TTLs in ratelimit/README.md), each
expiring as soon as it holds nothing a new charge would see; TTLs run on the server's clock, the numbers on the
caller's (a key may vanish up to the clock skew early, forgetting up to skew x rate units). Floats cross the script
boundary as ``%.17g`` strings (Lua's ``tostring`` keeps 14 digits). A settle re-reads its charge inside the script, so
a concurrent second settle changes nothing. One charge may span several hash slots: one Valkey primary, not Cluster.
No client retries (``retries=0``): a script whose reply was lost may have run, and running a charge twice charges
twice. A failed call raises ``StoreUnavailable``; the next call reconnects.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError

from ratelimit.core import (
    NEVER, SLACK_S, ChargedMeter, ChargeDecision, ChargePlan, ChargeRequest, LimiterSettings, LimitKind, LimitState,
    MeterCheck, MeterState, Scope, SettleOutcome, Settlement, Verdict, check_actual_tokens, live, peek_states,
    plan_charge, plan_scopes, verdict,
)
from ratelimit.port import ChargeIdInUse, StoreUnavailable

_COMMON_LUA = """
local function num(x) return string.format('%.17g', x) end
-- A meter is the string "<born> <tat_s> <credit_s>" (MeterState), loaded as {born, tat_s, credit_s}; nil when absent or
-- full again (no debt left).
local function debt(m, now) if m == nil then return 0 end return m[2] - (now - m[1]) end
local function load(key, now)
  local raw = redis.call('GET', key)
  if not raw then return nil end
  local b, t, c = string.match(raw, '^(%S+) (%S+) (%S+)$')
  local m = {tonumber(b), tonumber(t), tonumber(c)}
  if m[1] == nil or m[2] == nil or m[3] == nil or debt(m, now) <= 0 then return nil end
  return m
end
local function show(m) if m == nil then return '' end return num(m[1]) .. ' ' .. num(m[2]) .. ' ' .. num(m[3]) end
local function store(key, m, now)
  if m == nil or debt(m, now) <= 0 then
    redis.call('DEL', key)
  else
    redis.call('SET', key, show(m), 'PX', math.ceil(debt(m, now) * 1000))
  end
end
local function charged(m, now, added)                   -- charged_state
  if m == nil then return {now, added, 0} end
  return {m[1], m[2] + added, m[3]}
end
"""

CHARGE_LUA = _COMMON_LUA + """
-- KEYS: [1] the charge record, then one key per meter, then one per slot set (ChargePlan order).
-- ARGV: now, lease_s, charge id ('' = none), #meters, #slot sets, slack_s, tokens,
--       then per meter: unit_s, period_s, cost, kind; then per slot set: limit.
local now, lease, id = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
local nm, ns, slack, tokens = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7]
if id ~= '' then                                        -- an open charge by this id (its lease not run out)
  local open = redis.call('GET', KEYS[1])
  if open and tonumber(cjson.decode(open).deadline) > now then return {'in_use'} end
end
local allowed = true
local states, waits = {}, {}
for i = 1, nm do                                        -- check_meter
  local a = 7 + (i - 1) * 4
  local unit, period, cost = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
  local m = load(KEYS[1 + i], now)
  local wait = 0
  if cost * unit > period + slack then
    wait = -1                                           -- never
  else
    local over = debt(m, now) + cost * unit - period
    if over > slack then wait = over end
  end
  if wait ~= 0 then allowed = false end
  states[i], waits[i] = m, wait
end
local held = {}
local s0 = 7 + nm * 4
for j = 1, ns do                                        -- live slots: leases not run out
  local key = KEYS[1 + nm + j]
  redis.call('ZREMRANGEBYSCORE', key, '-inf', num(now))
  held[j] = redis.call('ZCARD', key)
  if held[j] >= tonumber(ARGV[s0 + j]) then allowed = false end
end
if allowed then                                         -- decide_charge + open_charge
  local lease_ms = math.ceil(lease * 1000)
  local meters = {}
  for i = 1, nm do
    local a = 7 + (i - 1) * 4
    local unit, cost = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 3])
    local m = charged(states[i], now, cost * unit)
    store(KEYS[1 + i], m, now)
    states[i] = m
    -- key, kind, cost, unit_s, born, end_s, credit_s, below_s (ChargedMeter)
    meters[i] = {KEYS[1 + i], ARGV[a + 4], ARGV[a + 3], num(unit), num(m[1]), num(m[2]), num(m[3]),
                 num(math.max(0, m[2] - cost * unit - (now - m[1])))}
  end
  local slots = {}
  for j = 1, ns do
    local key = KEYS[1 + nm + j]
    redis.call('ZADD', key, num(now + lease), id)
    redis.call('PEXPIRE', key, lease_ms)
    held[j] = held[j] + 1
    slots[j] = key
  end
  if id ~= '' then
    redis.call('SET', KEYS[1], cjson.encode({id = id, tokens = tokens, deadline = num(now + lease),
                                              meters = meters, slots = slots}), 'PX', lease_ms)
  end
end
local reply = {allowed and 'allowed' or 'refused'}
for i = 1, nm do
  reply[#reply + 1] = show(states[i])
  reply[#reply + 1] = num(waits[i])
end
for j = 1, ns do reply[#reply + 1] = held[j] end
return reply
"""

SETTLE_LUA = _COMMON_LUA + """
-- KEYS: [1] the charge record, then the meter keys and slot-set keys it names, in its order.
-- ARGV: now, actual tokens, refund the request ('1'/'0').
local raw = redis.call('GET', KEYS[1])
if not raw then return {'not_open'} end
redis.call('DEL', KEYS[1])
local rec = cjson.decode(raw)
local now, actual, refund_request = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3] == '1'
if tonumber(rec.deadline) <= now then return {'not_open'} end   -- its lease ran out: its tokens stay charged
local nm = #rec.meters
for i = 1, nm do                                        -- settle_meter
  local r = rec.meters[i]
  local key, kind, cost, unit = KEYS[1 + i], r[2], tonumber(r[3]), tonumber(r[4])
  local born, end_s, credit_s, below_s = tonumber(r[5]), tonumber(r[6]), tonumber(r[7]), tonumber(r[8])
  local unused = 0
  if kind == 'tokens' then unused = cost - actual elseif refund_request then unused = cost end
  local m = load(key, now)
  local after = m
  if unused < 0 then
    after = charged(m, now, -unused * unit)
  elseif unused > 0 and m ~= nil and m[1] == born then
    local end_now = end_s - math.min(m[3] - credit_s, below_s)
    local credit = math.max(0, end_now - math.max(now - m[1], end_now - unused * unit))
    if credit > 0 then after = {m[1], m[2] - credit, m[3] + credit} end
  end
  if after ~= m then store(key, after, now) end
end
for j = 1, #rec.slots do redis.call('ZREM', KEYS[1 + nm + j], rec.id) end
return {'settled', rec.tokens}
"""


class _Script:
    def __init__(self, text: str) -> None:
        self.text = text
        self.sha = hashlib.sha1(text.encode()).hexdigest()


_CHARGE = _Script(CHARGE_LUA)
_SETTLE = _Script(SETTLE_LUA)


class ValkeyRateLimiter:
    """``url``: ``redis://host:port/db`` (``rediss://`` for TLS). ``timeout_s``: seconds, > 0, that a call may wait
    for a pooled connection, to connect, and for its reply; past it the call raises ``StoreUnavailable`` (keep it well
    inside the Check's own deadline). ``max_connections``: the pool's size, >= 1; a call beyond it waits for a
    connection (one connection carries one script at a time; Valkey runs them one after another anyway)."""

    def __init__(self, url: str, settings: LimiterSettings | None = None, *, key_prefix: str = "sluice:rl:",
                 timeout_s: float = 0.5, max_connections: int = 32) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, not {timeout_s!r}")
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, not {max_connections!r}")
        self.settings = settings or LimiterSettings()
        self.key_prefix = key_prefix
        self.scripts_loaded = 0
        """Times a script was (re)loaded after NOSCRIPT."""
        # One retry on a connection error: after a Valkey restart every pooled connection is dead, and each would
        # otherwise fail one request (closed: a 503) before the pool replaced it. A command on a dead socket never
        # reached the new server, so the retry cannot charge twice; only a connection lost mid-reply to a live server
        # could, which a timeout (not retried: the script may have run) does not cover either.
        pool = BlockingConnectionPool.from_url(url, decode_responses=True, socket_timeout=timeout_s,
                                               socket_connect_timeout=timeout_s,
                                               retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
                                               max_connections=max_connections, timeout=timeout_s)
        self._redis: Redis = Redis(connection_pool=pool)

    def meter_key(self, key: str, kind: LimitKind) -> str:
        return f"{self.key_prefix}k:{key}:{kind}"

    def charge_key(self, charge_id: str) -> str:
        return f"{self.key_prefix}c:{charge_id}"

    # ---- the port ---------------------------------------------------------------------------------------------------

    async def charge(self, request: ChargeRequest, now: float) -> Verdict:
        plan = plan_charge(request)
        keys = [self.charge_key(request.charge_id or ""),
                *(self.meter_key(m.key, m.kind) for m in plan.meters),
                *(self.meter_key(s.key, LimitKind.CONCURRENT) for s in plan.slot_sets)]
        args: list[str | int] = [repr(float(now)), repr(float(self.settings.lease_s)), request.charge_id or "",
                                 len(plan.meters), len(plan.slot_sets), repr(SLACK_S), request.tokens]
        for m in plan.meters:
            args += [repr(m.rate.unit_s), repr(float(m.rate.period_s)), m.cost, str(m.kind)]
        args += [s.limit for s in plan.slot_sets]
        reply = await self._run(_CHARGE, keys, args)
        if reply[0] == "in_use":
            raise ChargeIdInUse(f"charge {request.charge_id!r} is still open")
        return verdict(request, plan, _decision(plan, reply, now), now, self.settings)

    async def settle(self, charge_id: str, actual_tokens: int, now: float, *,
                     refund_request: bool = False) -> Settlement:
        check_actual_tokens(actual_tokens)
        record_key = self.charge_key(charge_id)
        try:
            raw = await self._redis.get(record_key)
        except RedisError as exc:
            raise StoreUnavailable(f"rate-limit store: {exc}") from exc
        if raw is None:
            return Settlement(SettleOutcome.NOT_OPEN)
        record = json.loads(raw)
        keys = [record_key, *(m[0] for m in record["meters"]), *record["slots"]]
        reply = await self._run(_SETTLE, keys, [repr(float(now)), actual_tokens, "1" if refund_request else "0"])
        if reply[0] != "settled":
            return Settlement(SettleOutcome.NOT_OPEN)
        return Settlement(SettleOutcome.SETTLED, int(reply[1]), actual_tokens)

    async def peek(self, scopes: Sequence[Scope], now: float) -> tuple[LimitState, ...]:
        plan = plan_scopes(scopes)
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for m in plan.meters:
                    pipe.get(self.meter_key(m.key, m.kind))
                for s in plan.slot_sets:
                    pipe.zcount(self.meter_key(s.key, LimitKind.CONCURRENT), f"({float(now)!r}", "+inf")
                replies = await pipe.execute()
        except RedisError as exc:
            raise StoreUnavailable(f"rate-limit store: {exc}") from exc
        states = [_meter_state(r, now) for r in replies[:len(plan.meters)]]
        return peek_states(scopes, states, [int(r) for r in replies[len(plan.meters):]], now)

    async def close(self) -> None:
        await self._redis.aclose()
        await self._redis.connection_pool.disconnect()

    # ---- what the tests look at -------------------------------------------------------------------------------------

    async def stored_keys(self) -> list[str]:
        return sorted([k async for k in self._redis.scan_iter(match=self.key_prefix + "*")])

    async def stored_charge(self, charge_id: str) -> list[ChargedMeter] | None:
        """The stored record of an open charge's meters (``None``: not open)."""
        raw = await self._redis.get(self.charge_key(charge_id))
        if raw is None:
            return None
        return [ChargedMeter(m[0], LimitKind(m[1]), int(m[2]), float(m[3]), float(m[4]), float(m[5]), float(m[6]),
                             float(m[7]))
                for m in json.loads(raw)["meters"]]

    async def meter_state(self, key: str, kind: LimitKind, now: float) -> MeterState | None:
        return _meter_state(await self._redis.get(self.meter_key(key, kind)), now)

    # ---- the scripts ------------------------------------------------------------------------------------------------

    async def _run(self, script: _Script, keys: Sequence[str], args: Sequence[str | int]) -> list[Any]:
        try:
            try:
                reply = await self._redis.evalsha(script.sha, len(keys), *keys, *args)
            except NoScriptError:
                await self._redis.script_load(script.text)
                self.scripts_loaded += 1
                reply = await self._redis.evalsha(script.sha, len(keys), *keys, *args)
        except RedisError as exc:
            raise StoreUnavailable(f"rate-limit store: {exc}") from exc
        if not isinstance(reply, list) or not reply:
            raise StoreUnavailable(f"rate-limit store: unexpected script reply {reply!r}")
        return reply


def _meter_state(raw: str | bytes | None, now: float) -> MeterState | None:
    """A stored meter (``"<born> <tat_s> <credit_s>"``), ``None`` when absent or full again."""
    if not raw:
        return None
    text = raw.decode() if isinstance(raw, bytes) else raw
    born, tat_s, credit_s = (float(x) for x in text.split(" "))
    return live(MeterState(born, tat_s, credit_s), now)


def _decision(plan: ChargePlan, reply: list[Any], now: float) -> ChargeDecision:
    """``CHARGE``'s reply as the ``ChargeDecision`` ``decide_charge`` would have made."""
    allowed = reply[0] == "allowed"
    checks: list[MeterCheck] = []
    states: list[MeterState | None] = []
    for i in range(len(plan.meters)):
        wait = float(reply[2 + 2 * i])
        checks.append(MeterCheck(NEVER if wait < 0 else wait))
        states.append(_meter_state(reply[1 + 2 * i], now))
    held = tuple(int(h) for h in reply[1 + 2 * len(plan.meters):])
    if len(held) != len(plan.slot_sets):
        raise StoreUnavailable(f"rate-limit store: a charge reply of the wrong shape: {reply!r}")
    return ChargeDecision(allowed, tuple(checks), tuple(states), held)
