"""Replication's asyncio shell: it makes the store calls the ledger mirror (``mirror.py``) decides on and feeds the
answers back, as ``xds/server.py`` does for ``xds/stream.py``.

To the store (controlplane/store/): admissions (``commit``; a wake's in order, ``settle``), parks and unparks (one writer,
in batches, under the line lock), releases (in the background; resent after an outage). From it: its events
(``listen``), the lease sweep (``_upkeep``, which also tells whether the store answers), a resync each time the event
stream (re)connects or the store returns (releases not sent are sent, tickets it lost restored, every ticket it holds
learned), the line audit, and the lot put back in line after a lapsed heartbeat. With the store unreachable
``store.on_failure`` decides: ``open`` keeps admissions on this replica's ledger, ``closed`` answers 503
``store_unavailable``. With the memory store no call suspends. Parked Checks are answered and woken through the ``Lot``
(the admission service).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol, TypeVar

from controlplane.config import Config
from controlplane.core.admission import AdmissionCore
from controlplane.core.model import Decision, InferenceRequest, Outcome, Parked, Ticket
from controlplane.metrics import SluiceMetrics
from controlplane.store.base import (
    Claim, EventKind, Landed, LineChange, Reserved, SharedClock, Store, StoreEvent, StoreUnavailable,
)
from controlplane.admission.mirror import Heard, LedgerMirror, LineQueue, Settlement, Views

_T = TypeVar("_T")

log = logging.getLogger("sluice.admission")

STORE_UPKEEP_S = 0.5
"""How often the store's lease sweep runs here, which also tells whether the store answers (``_upkeep``)."""


class Lot(Protocol):
    """The parked Checks replication answers and wakes (the admission service)."""

    def wake(self, models: list[str] | None = None) -> None: ...
    def answer(self, outcomes: list[Outcome]) -> None: ...
    def withdraw(self, request_id: str, client_left: bool) -> bool: ...
    def release_ticket(self, ticket_id: str) -> Ticket | None: ...


class Replication:
    def __init__(self, config: Config, core: AdmissionCore, views: Views, metrics: SluiceMetrics,
                 clock: Callable[[], float], store: Store, lot: Lot) -> None:
        self.core = core
        self.metrics = metrics
        self.clock = clock
        self.store = store
        self.lot = lot
        self.shared = SharedClock.here(clock)
        self.mirror = LedgerMirror(config, core, views, store.replica_id, self.shared)
        self.store_up = True
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[None]] = set()
        self._release_tasks: set[asyncio.Task[None]] = set()
        self._store_timers: dict[str, Any] = {}
        self._line_lock = asyncio.Lock()
        """Held while a batch of line changes is on its way, and by whatever must not overlap one."""
        self._lines: LineQueue[asyncio.Future[Landed | None]] = LineQueue()
        self._line_writer: asyncio.Task[None] | None = None

    @property
    def config(self) -> Config:
        return self.mirror.config

    @config.setter
    def config(self, config: Config) -> None:
        self.mirror.config = config

    # -- admissions --------------------------------------------------------------------------------------------------
    async def commit(self, outcome: Outcome, claim: Claim, now: float) -> Reserved:
        """Write an admission the core made (at ``now``) to the store; a refusal is undone (an admission written, or
        kept on this replica's ledger with the store unreachable and ``on_failure: open``, is ``ok``)."""
        answer: Reserved | None
        try:
            answer = await self._timed("reserve", self.store.reserve(claim))
        except StoreUnavailable:
            answer = None
        if answer is not None and answer.refusal is not None:
            self.metrics.store_refusals.labels(answer.refusal.value).inc()
        reserved = self.mirror.reserved(outcome, answer, now, self.clock())
        if answer is None and reserved.ok:
            self.metrics.store_fail_open.inc()
        return reserved

    async def settle(self, outcomes: list[Outcome], now: float) -> set[str]:
        """Write a wake's admissions to the store in order and answer them (``Settlement`` decides which go). Returns
        models to wake again (the mirror learned tickets it lacked)."""
        woken = {o.request_id for o in outcomes if o.parked is not None}
        self.mirror.settling |= woken
        try:
            again = await self._settle_in_order(outcomes, Settlement(self.mirror, now))
            return again | self.mirror.learn_counters()
        finally:
            self.mirror.settling -= woken
            self.mirror.claimed_done -= woken

    async def _settle_in_order(self, outcomes: list[Outcome], settlement: Settlement) -> set[str]:
        for outcome in outcomes:
            parked = outcome.parked
            model = parked.request.model if parked is not None else None
            request_id = outcome.request_id
            if settlement.taken_back(outcome):
                continue
            if outcome.ticket is None:
                self.left_lot(outcome)
                self.lot.answer([outcome])
                continue
            if parked is None or model is None:
                self.lot.answer([outcome])
                continue
            claim = settlement.to_write(outcome, parked, model)
            if claim is None:
                continue
            # Answered from the event stream, at this admission's own event: requests the store admitted on their
            # claims before it (in line order), answered from the stream too, are answered first.
            self.store.expect_admission(request_id, self._answer_later(outcome))
            reserved = await self.commit(outcome, claim, settlement.now)
            written = reserved.ok and request_id not in self.mirror.unsynced
            self.store.admission_settled(request_id, written)
            if reserved.ok and not written:  # kept on this replica's ledger (the store unreachable): no event
                self.lot.answer([outcome])
            elif reserved.refusal is not None:
                settlement.refused(outcome, parked, model, reserved.refusal)
        for (model, klass), held in settlement.behind.items():
            await self._leave_claims(model, klass, held)
        return settlement.again

    async def _leave_claims(self, model: str, klass: int, held: list[tuple[Outcome, Parked, Claim]]) -> None:
        """The wake's admissions of heads behind one the store refused for the line (retracted here): each is left
        with its member as a claim, in one store call, and the requests go back to their places in the lot."""
        for outcome, parked, claim in held:
            self.mirror.note_claim(outcome.request_id, parked.parked_at, claim, outcome.decision)
        try:
            await self._timed("claim", self.store.claim(model, klass, [(o.request_id, c) for o, _, c in held]))
        except StoreUnavailable:
            pass  # they wait for a wake as without claims; the upkeep loop notices the store
        for _, parked, _ in held:
            self.mirror.back_in_lot(parked)

    def _answer_later(self, outcome: Outcome) -> Callable[[], None]:
        return lambda: self.lot.answer([outcome])

    # -- the line ----------------------------------------------------------------------------------------------------
    async def enter_line(self, request_id: str, request: InferenceRequest, parked_at: float,
                         queued: tuple[Decision, Claim] | None, behind: bool = False) -> Outcome | None:
        """Write a request the core just parked into the shared line (``LedgerMirror.park``); an offer admitted is
        returned. A client gone meanwhile takes the request out of the lot and, after its park, out of the line (an
        offer admitted as it left gives its ticket back). A request the store says parked earlier on another replica
        keeps that time."""
        model = request.model
        assert model is not None
        at = self.shared.offset + self.clock()
        change = self.mirror.park(request_id, request, parked_at, at, queued, behind)
        offer = change.offer
        landing = self._in_line(change)
        try:
            landed = await asyncio.shield(landing)
        except asyncio.CancelledError:
            self.lot.withdraw(request_id, client_left=True)
            if offer is not None:  # the change lands all the same: an offer admitted meanwhile is given back
                landing.add_done_callback(lambda f: self._offer_landed_without_client(request, offer, f))
            raise
        finally:
            if self.mirror.park_landed(request_id, model):
                self.lot.wake([model])
        if landed is None:  # the store did not answer: parked here as it would have been
            return None
        if landed.offered is not None and queued is not None:
            assert offer is not None
            if landed.offered.refusal is not None:
                self.metrics.store_refusals.labels(landed.offered.refusal.value).inc()
            admitted = self.mirror.offer_landed(request_id, request, queued[0], offer, landed.offered, self.clock())
            if admitted is not None:
                self.metrics.parked_now.set(self.core.depth())
                return admitted
        first = landed.first_parked_at
        if first is not None and first < at:
            first_here = first - self.shared.offset
            if self.mirror.keep_first_park(request_id, first_here):
                log.debug("request %s parked again here after its replica went away; it first parked %.1f s ago",
                          request_id, self.clock() - first_here)
        return None

    def _offer_landed_without_client(self, request: InferenceRequest, offer: Claim,
                                     landing: asyncio.Future[Landed | None]) -> None:
        landed = None if landing.cancelled() else landing.result()
        if landed is None or landed.offered is None or not landed.offered.ok:
            return
        ticket = self.mirror.offer_admitted_without_client(request, offer, self.clock())
        self.lot.release_ticket(ticket.ticket_id)

    def left_lot(self, outcome: Outcome) -> None:
        """A parked request the core answered without an admission (a wake's refusal or shed, a sweep's shed) leaves
        the shared line too."""
        parked = outcome.parked
        if parked is not None and parked.request.model is not None:
            self.unpark((parked.request.model, self.core.class_index(parked.request)), outcome.request_id)

    def unpark(self, where: tuple[str, int] | None, request_id: str) -> None:
        """A request left the lot without an admission (cancelled, shed): it leaves the shared line too."""
        if where is not None:
            model, klass = where
            self.mirror.unparking.add(request_id)

            async def unpark() -> None:
                try:
                    await self._in_line(LineChange(model, klass, request_id, unpark=True))
                finally:
                    self.mirror.unparking.discard(request_id)
            self._spawn(unpark())

    def _in_line(self, change: LineChange) -> asyncio.Future[Landed | None]:
        """A park or unpark for the shared line; the future is what it did (None: the store did not answer; the first
        failure says so at once, and later changes are skipped until the upkeep loop finds the store back). One writer
        sends them in order (concurrent calls would travel on different connections and land in any order)."""
        future: asyncio.Future[Landed | None] = asyncio.get_running_loop().create_future()
        self._lines.ask(change, future)
        if self._line_writer is None or self._line_writer.done():
            self._line_writer = self._spawn(self._write_lines())
        return future

    async def _write_lines(self) -> None:
        """Send the waiting line changes, a batch a call, until none waits (under the line lock)."""
        batch: list[tuple[LineChange, asyncio.Future[Landed | None]]] = []
        try:
            while self._lines:
                async with self._line_lock:
                    batch = self._lines.next_batch()
                    landed: list[Landed | None] = [None] * len(batch)
                    if self.store_up:
                        try:
                            landed = list(await self._timed("line", self.store.change_lines([c for c, _ in batch])))
                        except StoreUnavailable as exc:
                            log.error("the shared store does not answer (%s); store.on_failure: %s", exc,
                                      self.config.store.on_failure.value)
                            self.store_up = False
                            self.metrics.store_up.set(0)
                for (_, future), result in zip(batch, landed):
                    if not future.done():
                        future.set_result(result)
                batch = []
        finally:  # stopping: whoever still waits is told the store did not answer
            for _, future in batch + self._lines.waiting():
                if not future.done():
                    future.set_result(None)

    async def before_wake(self) -> None:
        """Before a wake decides: a lot found out of line goes back in (``_lapsed``), and the releases that woke it reach
        the store before its admissions do."""
        if self.mirror.rejoin:
            self.mirror.rejoin = False
            await self._put_back_in_line()
        if self._release_tasks:
            await self.releases_sent()

    async def _put_back_in_line(self) -> None:
        """Every request the lot holds goes back into its shared line, in the lot's order, at the back, without a
        claim. Under the line lock, so every park and unpark asked for before has landed; a member the store still held
        moves to the back with the others."""
        async with self._line_lock:
            for entry in self.core.parked():
                model = entry.request.model
                if model is None or self.core.where(entry.request_id) is None or not self.store_up:
                    continue
                try:
                    await self._timed("park", self.store.park(model, self.core.class_index(entry.request),
                                                              entry.request_id, self.shared.offset + entry.parked_at,
                                                              tenant=self.mirror.line_tenant(entry.request),
                                                              lift_credit=self.core.lift_credit(entry.request)))
                except StoreUnavailable:
                    return  # the store lost everything or is down: its return resynchronises and lapses again

    async def audit_lines(self) -> None:
        """Take out of the shared lines every member of this replica that its lot no longer holds (``strays``): the
        backstop for a way out of the lot that did not unpark (a stray heads its line for good). Under the line lock,
        so every change asked for before has landed and none lands meanwhile. Counted in
        ``sluice_line_strays_removed_total``."""
        for model, klass in self.core.lines():
            strays: list[str] = []
            async with self._line_lock:
                if not self.store_up:
                    return
                try:
                    candidates = self.mirror.strays(await self._timed("members", self.store.members(model, klass)))
                    # unpark says whether it removed anything: a request admitted while ``members`` was read is gone
                    strays = [r for r in candidates if await self._timed("unpark", self.store.unpark(model, klass, r))]
                except StoreUnavailable:
                    return  # the upkeep loop notices; the next audit tries again
            if strays:
                log.warning("%d request(s) of %s were in the shared line but no longer parked here; taken out: %s",
                            len(strays), model, ", ".join(strays[:5]))
                self.metrics.line_strays_removed.inc(len(strays))
                self.lot.wake([model])

    # -- releases ----------------------------------------------------------------------------------------------------
    def release(self, ticket_id: str) -> None:
        """A ticket the ledger closed, closed in the store in the background."""
        if not self.mirror.release(ticket_id):
            return

        async def release() -> None:
            sent: bool | None = None
            try:
                await self._timed("release", self.store.release(ticket_id))
                sent = True
            except StoreUnavailable:
                sent = False
            finally:
                self.mirror.release_landed(ticket_id, sent)
        self._release_tasks.add(self._spawn(release()))

    async def releases_sent(self) -> None:
        """Wait for the releases in flight: a refusal may have counted one of them, so deciding again before they land
        would only be refused again."""
        if self._release_tasks:
            await asyncio.gather(*self._release_tasks, return_exceptions=True)
        else:
            await asyncio.sleep(0)

    def settle_charge(self, ticket_id: str, prompt_tokens: int, output_tokens: int) -> None:
        """A finished request's usage corrects its tenant's counter in the store too (whichever replica admitted it), in
        the background; a wake waits for it as for a release (``before_wake``). Nothing to do when fair share is not
        the store's."""
        if not self.mirror.shared_fair or not self.store_up:
            return

        async def settle() -> None:
            try:
                await self._timed("settle", self.store.settle(ticket_id, prompt_tokens, output_tokens))
            except StoreUnavailable:
                pass  # the estimate stands in the store
        self._release_tasks.add(self._spawn(settle()))

    # -- events and upkeep -------------------------------------------------------------------------------------------
    def _heard(self, event: StoreEvent) -> None:
        heard = self.mirror.heard(event, self.clock())
        if event.kind is EventKind.DEAD and event.replica != self.store.replica_id:  # this one's own: see _lapsed
            log.warning("replica %s was found dead: its parked requests left the shared lines", event.replica)
        self._apply(heard)

    def _apply(self, heard: Heard) -> None:
        for ticket_id in heard.releases:
            log.debug("request %s admitted on its claim after it was answered; its ticket is released", ticket_id)
            self.release(ticket_id)
        if heard.answers:
            self.lot.answer(list(heard.answers))
        if heard.wake is None:
            self.lot.wake()
        elif heard.wake:
            self.lot.wake(list(heard.wake))

    def _lapsed(self) -> None:
        """This replica's heartbeat had lapsed although it is alive (its beats were held up; the store restarted empty):
        the store may have taken its members out of every line; they go back at the wake loop's next turn. Called once
        the heartbeat is renewed, so the store cannot take them out again for the same lapse."""
        if self.core.depth():
            log.warning("this replica's heartbeat lapsed (held up past %.2f s): its %d parked request(s) go back in "
                        "line, at the back", self.config.store.heartbeat_seconds * self.config.store.dead_after_beats,
                        self.core.depth())
        self.mirror.rejoin = True
        self.lot.wake()

    async def _resync(self) -> None:
        """Bring the store and the mirror together: backlogged releases, tickets the store lost, tickets it holds."""
        mirror = self.mirror
        try:
            for ticket_id in list(mirror.release_backlog):
                await self._timed("release", self.store.release(ticket_id))
                mirror.release_backlog.discard(ticket_id)
            restored = await self._timed("restore", self.store.restore(mirror.to_restore()))
            mirror.restored()
            state = await self._timed("load", self.store.load())
        except StoreUnavailable as exc:
            log.warning("store resync failed (%s); retried when it is back", exc)
            return
        now = self.clock()
        for event in mirror.own_claims(state):  # admitted on their claims while this replica was not listening
            self._apply(mirror.own_claimed(event, now))
        mirror.loaded(state, now)
        if restored:
            log.warning("restored %d tickets the store had lost", restored)
        self.lot.wake()

    async def _upkeep(self) -> None:
        """The store's lease sweep, every ``STORE_UPKEEP_S``; whether it answers is the store's state here (a store
        back after an outage is resynchronised). The heartbeat is renewed elsewhere (``Store.start_liveness``)."""
        while True:
            try:
                expired = await self._timed("expire", self.store.expire(self.shared.offset + self.clock()))
                for ticket in expired:  # any replica's sweep closes a lapsed lease once; this one was first
                    self.mirror.lease_expired(ticket, self.clock())
                if not self.store_up:
                    log.warning("the shared store answers again")
                    self._spawn(self._resync())
                self.store_up = True
            except StoreUnavailable as exc:
                if self.store_up:
                    log.error("the shared store does not answer (%s); store.on_failure: %s", exc,
                              self.config.store.on_failure.value)
                self.store_up = False
            self.metrics.store_up.set(1 if self.store_up else 0)
            await asyncio.sleep(STORE_UPKEEP_S)

    # -- lifecycle ---------------------------------------------------------------------------------------------------
    async def open(self) -> None:
        """Before any Check: join the store, listen to its events and learn every ticket it holds."""
        try:
            await self._timed("heartbeat", self.store.open())
        except StoreUnavailable as exc:  # serve per store.on_failure; the upkeep loop resyncs once it answers
            log.error("the shared store does not answer at start-up (%s); store.on_failure: %s", exc,
                      self.config.store.on_failure.value)
            self.store_up = False
        connected = asyncio.Event()

        def on_connected() -> None:
            if connected.is_set():  # a reconnection: events may have been missed meanwhile
                self._spawn(self._resync())
            connected.set()
        self._tasks.append(asyncio.create_task(self.store.listen(self._heard, on_connected), name="store-events"))
        if self.store_up:
            await self._resync()
        self.metrics.store_up.set(1 if self.store_up else 0)
        try:
            await asyncio.wait_for(connected.wait(), self.config.store.timeout_seconds * 4)
        except asyncio.TimeoutError:
            log.warning("the store's event stream is not connected yet; other replicas' admissions arrive once it is")

    def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._upkeep(), name="store-upkeep"))
        loop = asyncio.get_running_loop()
        st = self.config.store

        def lapsed() -> None:  # called from the store's liveness thread
            try:
                loop.call_soon_threadsafe(self._lapsed)
            except RuntimeError:  # the loop is closed: this replica is stopping
                pass
        self.store.start_liveness(st.heartbeat_seconds, st.heartbeat_seconds * st.dead_after_beats, lapsed)

    async def stop(self, *others: asyncio.Task[None]) -> None:
        """Cancel ``others`` (the caller's) and every task of this shell, wait for them all, then leave the store."""
        tasks = [*others, *self._tasks, *self._background]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        await self.store.close()

    async def _timed(self, op: str, call: Awaitable[_T]) -> _T:
        """One store call, timed. A task cancelled during the call is cancelled when it returns, whatever it returned:
        redis-py can swallow a cancellation that arrives inside a call (a loop that went on would never stop)."""
        started = time.perf_counter()
        try:  # bounded by the store's own client timeout (store.timeout_seconds); no task per call
            result = await call
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise asyncio.CancelledError()
            return result
        except StoreUnavailable as exc:
            self.metrics.store_errors.labels(op).inc()
            raise StoreUnavailable(f"{op}: {exc}") from exc
        finally:
            timer = self._store_timers.get(op)
            if timer is None:  # a labelled child looked up once per op, not per call
                timer = self._store_timers[op] = self.metrics.store_seconds.labels(op)
            timer.observe(time.perf_counter() - started)

    def _spawn(self, work: Awaitable[None]) -> asyncio.Task[None]:
        """Run ``work`` in the background, tracked until done. A task cancelled before its first step (the shell
        stopping) closes ``work`` too, so a coroutine that never ran is not left unawaited."""
        async def run() -> None:
            await work
        task = asyncio.get_running_loop().create_task(run())
        if isinstance(work, Coroutine):
            task.add_done_callback(lambda _: work.close())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(self._release_tasks.discard)
        return task
