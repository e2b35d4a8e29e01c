"""The ``Store`` on Valkey or Redis (standalone or behind Sentinel; not Cluster: the scripts touch keys they compute).

Every change is one server-side Lua script, so it is atomic against every other replica's: ``reserve`` checks the line,
the engine's cap and its reserved KV and then writes, or refuses, in one step; ``release`` and lease expiry close a ticket
once, whoever asks first; every script that changes a line or frees capacity then admits the lines' heads on their
claims (``drain``, base.py ``Claim``), in the same atomic step. Each script also publishes what it did on
``<prefix>:events``, which every replica's ``listen`` turns into ``StoreEvent``s for its mirror. Scripts read the
server's clock (``TIME``) for claims only, so replicas on several hosts agree on a claim's freshness. The keys are
listed in ``ValkeyStore``'s docstring; the scripts are in ``valkeyscripts.py``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from controlplane.core.model import Ticket
from controlplane.core.prefix import blocks_from_text, blocks_text
from controlplane.store.base import (
    Claim, EventKind, FairCharge, FairCounters, Landed, LineChange, Refusal, Reserved, StoreEvent, StoreState,
    StoreUnavailable, member,
)
from controlplane.store.valkeyscripts import SCRIPTS

log = logging.getLogger("sluice.store")

TICKET_KEY_GRACE_S = 3600.0
RECONNECT_S = 0.5
OPEN_LAPSE_MS = 5000
"""A replica's heartbeat at ``open``, until ``start_liveness`` renews it."""
_EVERYONE = (EventKind.CLAIMED, EventKind.DEAD)
"""Events every replica hears, the one they are about too (base.py ``EventKind``)."""


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


def _charge_text(charge: FairCharge | None) -> str:
    """A fair charge as the scripts take it (``fair_charge``): its numbers as exact text ('' for none)."""
    if charge is None:
        return ""
    return json.dumps([charge.tenant, repr(charge.cost), repr(charge.prompt_weight), repr(charge.output_weight),
                       repr(charge.weight)])


def _counters(model: str, text: Any) -> FairCounters:
    """``fair_state``'s answer: [the tenant charged last or null, [tenant, "counter|raw", ...]]."""
    last, flat = json.loads(_text(text))
    pairs = list(flat) if isinstance(flat, list) else []
    counters = {}
    for tenant, value in zip(pairs[::2], pairs[1::2]):
        counter, _, raw = value.partition("|")
        counters[tenant] = (float(counter), float(raw))
    return FairCounters(model, counters, last)


def _tenant_args(tenant: str | None, credit: float) -> list[str]:
    """``park``'s last three arguments: whether the member counts for a tenant, which, and its lift credit."""
    return ["", "", "0"] if tenant is None else ["1", tenant, repr(credit)]


def _claim_text(claim: Claim, owner: str, session_ttl_s: float) -> str:
    """A claim as ``park`` keeps it (the scripts' layout; its fifth field, fresh seconds, becomes a server time)."""
    return json.dumps([_record(claim.ticket, owner), -1 if claim.cap is None else claim.cap,
                       -1 if claim.kv_limit is None else claim.kv_limit, claim.session or "", claim.fresh_s,
                       blocks_text(claim.prefix_blocks), int(session_ttl_s), TICKET_KEY_GRACE_S,
                       claim.serve_half_life_s, _charge_text(claim.charge),
                       -1 if claim.adapter_slots is None else claim.adapter_slots, list(claim.plain_models)])


class _Liveness(threading.Thread):
    """A replica's heartbeat, renewed from its own thread and connection (so a busy event loop does not make a live
    replica look dead), and the reaping of dead replicas after each renewal (base.py ``Store.reap``)."""

    def __init__(self, store: ValkeyStore, every_s: float, lapse_s: float, on_lapsed: Callable[[], None]) -> None:
        super().__init__(name=f"store-liveness-{store.replica_id}", daemon=True)
        self.store = store
        self.every_s = every_s
        self.lapse_ms = max(1, int(lapse_s * 1000))
        self.on_lapsed = on_lapsed
        self.stopping = threading.Event()

    def run(self) -> None:
        s = self.store
        client = redis.Redis.from_url(s.url, socket_timeout=s.timeout_s, socket_connect_timeout=s.timeout_s)
        beat, reap = client.register_script(SCRIPTS["heartbeat"]), client.register_script(SCRIPTS["reap"])
        try:
            while True:
                try:
                    if not beat(args=[s.prefix, s.replica_id, self.lapse_ms]):
                        self.on_lapsed()
                    dead = reap(args=[s.prefix])
                    if dead:
                        log.warning("replica(s) %s found dead (no heartbeat for %.2f s): their parked requests left "
                                    "the lines", ", ".join(map(_text, dead)), self.lapse_ms / 1000)
                except (RedisError, OSError) as exc:  # the store is down: the event loop's own calls notice
                    log.debug("heartbeat of %s failed: %s", s.replica_id, exc)
                if self.stopping.wait(self.every_s):
                    return
        finally:
            client.close()


class ValkeyStore:
    """Keys (``<p>`` = ``store.prefix``, default ``sluice``; a ticket's hash also expires ``TICKET_KEY_GRACE_S`` after
    its lease as a backstop, the lease sweep closes it long before)::

        <p>:t:<ticket>          hash   engine model admitted_at lease reserved done ttft owner  (expires lease + grace)
        <p>:e:<engine>          set    open ticket ids of the engine (its cap is checked against SCARD)
        <p>:kv                  hash   engine -> KV tokens its open tickets reserve
        <p>:leases              zset   ticket id by lease deadline (any replica's sweep closes the lapsed ones)
        <p>:q:<model>:<class>   zset   "<replica>|<request id>" by arrival sequence (<p>:seq)
        <p>:qa:<model>:<class>  hash   request id -> "<replica>|<when it first parked>", one per member of the line
        <p>:qd:<model>:<class>  hash   the same for members of dead replicas (expires DEAD_FIRSTS_S after the last one)
        <p>:c:<model>:<class>   hash   member -> its claim (JSON: ticket record, cap, KV limit, session, until when, ...)
        <p>:ml:<replica>        set    "<model>:<class>" of every line the replica parked in (its removal's index)
        <p>:s:<session>         string the session's engine (EX store.session_ttl_seconds)
        <p>:w                   hash   engine -> "<recent-serve count>|<when last admitted to>" (shared time)
        <p>:r:<replica>         string heartbeat (PX store.heartbeat_seconds x store.dead_after_beats); absent = dead
        <p>:replicas            set    replicas with a heartbeat (each renewal looks for lapsed ones among them)
        <p>:fv:<model>          hash   tenant -> "<virtual token counter>|<its charges without lifts>" (decision 0025)
        <p>:fl                  hash   model -> the tenant charged last
        <p>:qt:<model>:<class>  hash   member -> its tenant (members parked with fair share in the store)
        <p>:fb:<model>          hash   tenant -> its members in the model's lines (a tenant absent parks lifted)
        <p>:fc:<ticket>         string the admission's charge, for its settle (JSON; expires with the ticket's key)
    """

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
        self._scripts = {name: self.client.register_script(text) for name, text in SCRIPTS.items()}
        self._liveness: _Liveness | None = None
        self._listening = False
        self._expected: dict[str, Callable[[], None]] = {}
        """This replica's own admissions it expects to hear (``expect_admission``), by ticket id."""
        self._late: dict[str, asyncio.TimerHandle] = {}

    async def _run(self, name: str, *args: Any) -> Any:
        try:
            return await self._scripts[name](args=[self.prefix, *args])
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            raise _unavailable(f"{name}", exc) from exc

    async def open(self) -> None:
        await self._run("open", self.replica_id, OPEN_LAPSE_MS)

    async def close(self) -> None:
        if self._liveness is not None:
            self._liveness.stopping.set()
            await asyncio.to_thread(self._liveness.join, self.timeout_s * 4)
        try:
            await self.client.delete(f"{self.prefix}:r:{self.replica_id}")
        except (RedisError, OSError):
            pass
        await self.client.aclose()
        await self._subscriber.aclose()

    def _reserve_args(self, claim: Claim) -> list[Any]:
        """``reserve``'s arguments after the prefix (the scripts' ``reserve(A)``, A[2..15])."""
        return [json.dumps(_record(claim.ticket, self.replica_id)), -1 if claim.cap is None else claim.cap,
                -1 if claim.kv_limit is None else claim.kv_limit, claim.queue.value, claim.klass, claim.session or "",
                int(self.session_ttl_s), TICKET_KEY_GRACE_S, blocks_text(claim.prefix_blocks), claim.fresh_s,
                claim.serve_half_life_s, _charge_text(claim.charge),
                -1 if claim.adapter_slots is None else claim.adapter_slots, json.dumps(list(claim.plain_models))]

    async def reserve(self, claim: Claim) -> Reserved:
        answer = await self._run("reserve", *self._reserve_args(claim))
        verdict = _text(answer[0])
        if verdict == "ok":
            return Reserved()
        if verdict == Refusal.QUEUED and len(answer) > 1:
            return Reserved(Refusal.QUEUED, counters=_counters(claim.ticket.model, answer[1]))
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

    async def park(self, model: str, klass: int, request_id: str, at: float, claim: Claim | None = None,
                   tenant: str | None = None, lift_credit: float = 0.0) -> float:
        held = "" if claim is None or claim.fresh_s <= 0 else _claim_text(claim, self.replica_id, self.session_ttl_s)
        return float(_text(await self._run("park", f"{model}:{klass}", self.replica_id, request_id, repr(at), model,
                                           held, *_tenant_args(tenant, lift_credit))))

    async def settle(self, ticket_id: str, prompt_tokens: int, output_tokens: int) -> float | None:
        delta = await self._run("settle", ticket_id, prompt_tokens, output_tokens)
        return None if delta is None else float(_text(delta))

    async def counters(self, model: str) -> FairCounters:
        return _counters(model, await self._run("counters", model))

    async def claim(self, model: str, klass: int, claims: Sequence[tuple[str, Claim]]) -> None:
        if claims:
            pairs = [x for request_id, c in claims
                     for x in (request_id, _claim_text(c, self.replica_id, self.session_ttl_s))]
            await self._run("claim", f"{model}:{klass}", self.replica_id, model, *pairs)

    async def unpark(self, model: str, klass: int, request_id: str) -> bool:
        return bool(await self._run("unpark", f"{model}:{klass}", self.replica_id, request_id, model))

    async def change_lines(self, changes: Sequence[LineChange]) -> list[Landed]:
        """One pipeline (one write, the answers read in order, on one connection: the changes land in their order),
        each change one script: ``park``, ``unpark``, or ``offer`` (``reserve`` and, refused, ``park``, in one step)."""
        if not changes:
            return []
        pipe = self.client.pipeline(transaction=False)
        for change in changes:
            q = f"{change.model}:{change.klass}"
            if change.unpark:
                await self._scripts["unpark"](args=[self.prefix, q, self.replica_id, change.request_id, change.model],
                                              client=pipe)
                continue
            claim = change.claim
            held = "" if claim is None or claim.fresh_s <= 0 else _claim_text(claim, self.replica_id,
                                                                             self.session_ttl_s)
            park = [q, self.replica_id, change.request_id, repr(change.at), change.model, held,
                    *_tenant_args(change.tenant, change.lift_credit)]
            if change.offer is None:
                await self._scripts["park"](args=[self.prefix, *park], client=pipe)
            else:
                await self._scripts["offer"](args=[self.prefix, *self._reserve_args(change.offer), *park], client=pipe)
        try:
            answers = await pipe.execute()
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            raise _unavailable("change_lines", exc) from exc
        out: list[Landed] = []
        for change, answer in zip(changes, answers):
            if change.unpark:
                out.append(Landed(left=bool(answer)))
            elif change.offer is None:
                out.append(Landed(float(_text(answer))))
            elif _text(answer[0]) == "ok":
                out.append(Landed(offered=Reserved()))
            else:
                tickets = tuple(_ticket(json.loads(_text(x)))[0] for x in answer[2:])
                out.append(Landed(float(_text(answer[1])), Reserved(Refusal(_text(answer[0])), tickets)))
        return out

    async def members(self, model: str, klass: int) -> list[str]:
        mine = member(self.replica_id, "")
        try:
            line = await self.client.zrange(f"{self.prefix}:q:{model}:{klass}", 0, -1)
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            raise _unavailable(f"members", exc) from exc
        return [m[len(mine):] for m in map(_text, line) if m.startswith(mine)]

    async def heartbeat(self, ttl_s: float) -> None:
        await self._run("heartbeat", self.replica_id, max(1, int(ttl_s * 1000)))

    async def reap(self) -> list[str]:
        return [_text(r) for r in await self._run("reap")]

    def start_liveness(self, every_s: float, lapse_s: float, on_lapsed: Callable[[], None]) -> None:
        if self._liveness is None:
            self._liveness = _Liveness(self, every_s, lapse_s, on_lapsed)
            self._liveness.start()

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
            serves: dict[str, tuple[float, float]] = {}
            for engine, value in (await self.client.hgetall(f"{self.prefix}:w")).items():
                count, _, at = _text(value).partition("|")
                serves[_text(engine)] = (float(count), float(at))
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            raise _unavailable(f"load", exc) from exc
        return StoreState(tuple(tickets), sessions, serves)

    async def listen(self, handler: Callable[[StoreEvent], None], on_connected: Callable[[], None]) -> None:
        channel = f"{self.prefix}:events"
        while True:
            pubsub = self._subscriber.pubsub()
            try:
                await pubsub.subscribe(channel)
                self._listening = True
                on_connected()
                while True:
                    # No socket timeout on a subscription: it is quiet whenever nothing happens.
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=None)
                    if message is not None and message.get("type") == "message":
                        event = self._event(_text(message["data"]))
                        if event.replica != self.replica_id or event.kind in _EVERYONE:
                            handler(event)
                        elif event.kind is EventKind.ADMITTED:
                            self._heard_own(event.ticket_id)
            except (RedisError, OSError, asyncio.TimeoutError) as exc:
                log.warning("store subscription lost (%s); reconnecting in %.1fs", exc, RECONNECT_S)
            finally:
                self._listening = False
                for ticket_id in list(self._late):  # written, not heard: answered now
                    self._heard_own(ticket_id)
                try:
                    await pubsub.aclose()
                except (RedisError, OSError):
                    pass
            await asyncio.sleep(RECONNECT_S)

    def _heard_own(self, ticket_id: str) -> None:
        then = self._expected.pop(ticket_id, None)
        timer = self._late.pop(ticket_id, None)
        if timer is not None:
            timer.cancel()
        if then is not None:
            then()

    def expect_admission(self, ticket_id: str, then: Callable[[], None]) -> None:
        self._expected[ticket_id] = then

    def admission_settled(self, ticket_id: str, written: bool) -> None:
        if not written:
            self._expected.pop(ticket_id, None)
        elif ticket_id in self._expected:
            if not self._listening:
                self._heard_own(ticket_id)
            else:
                def late() -> None:
                    if ticket_id in self._late:
                        log.debug("admission %s not heard within %.2f s; answered", ticket_id, self.timeout_s)
                        self._heard_own(ticket_id)
                self._late[ticket_id] = asyncio.get_running_loop().call_later(self.timeout_s, late)

    @staticmethod
    def _event(text: str) -> StoreEvent:
        """An event as the scripts publish it: [kind, by, payload, extra, the prompt's block hashes]."""
        kind, by, payload, extra, blocks = json.loads(text)
        if kind == EventKind.UNPARKED:
            return StoreEvent(EventKind.UNPARKED, by, payload, model=extra)
        if kind == EventKind.DEAD:
            return StoreEvent(EventKind.DEAD, by, "")
        ticket, _ = _ticket(json.loads(payload))
        return StoreEvent(EventKind(kind), by, ticket.ticket_id, ticket, extra or None, ticket.model,
                          blocks_from_text(blocks) if isinstance(blocks, str) else ())
