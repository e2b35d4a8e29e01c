"""The probe worker: every engine's poller in a process of its own, so probing a large fleet never takes the event loop
that answers Checks (issue 9, item 5; docs/architecture.md, Fleet scale).

The control plane starts ``python -m controlplane.observe.worker`` when ``observe.probe_process`` says so and writes one
frame to its stdin (``WorkerSetup``). The worker runs a real ``EnginePoller`` per engine (the same code, first probe
round, stagger and backoff) and reports on stdout, in batches every ``FLUSH_S`` (``encode_batch``): ``("ready",)`` once
the first round is done (at once; the control plane answers no Check before it), ``("probed", view, rates)`` after a
good probe, ``("failed", view)`` after a failed one. The control plane unpickles a report when it applies it, a few per
turn of its loop (decision 0010), and its ``EnginePoller``s hold the views (``adopt``). Both processes read
``time.monotonic`` on one host. The worker exits when its stdin closes; the control plane restarts a worker that dies.
It runs at nice ``WORKER_NICE`` and, with ``observe.worker_priority: idle``, under ``SCHED_IDLE`` (decision 0011);
starved past ``observe.worker_starved_after_seconds`` (``starved_for``) it reports ``("starved", seconds_late)`` and
stops, and the control plane restarts it at nice only (``Observation._run_worker``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import struct
import sys
from dataclasses import dataclass, replace
from typing import Any

from controlplane.config import EngineConfig, ObserveConfig
from controlplane.core.engines import EngineRates, EngineView
from controlplane.observe.poller import EnginePoller, first_round

_LENGTH = struct.Struct(">I")
log = logging.getLogger("sluice.observe.worker")


@dataclass(frozen=True, slots=True)
class WorkerSetup:
    engines: tuple[EngineConfig, ...]
    observe: ObserveConfig
    log_level: int = logging.INFO
    idle: bool = False
    """Run under ``SCHED_IDLE`` and stop once starved (``observe.worker_priority``); False: nice only."""


def encode(frame: Any) -> bytes:
    body = pickle.dumps(frame, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(body)) + body


def encode_batch(reports: list[Any]) -> bytes:
    """One write of several reports, each still pickled (``decode_report`` opens one): a 4-byte big-endian length and a
    pickle (parent and child are the same program; nothing else writes to the pipe)."""
    return encode([pickle.dumps(report, protocol=pickle.HIGHEST_PROTOCOL) for report in reports])


def decode_report(raw: bytes) -> Any:
    return pickle.loads(raw)


async def read_frame(reader: asyncio.StreamReader) -> Any:
    """The next frame; ``asyncio.IncompleteReadError`` at the end of the stream."""
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    return pickle.loads(await reader.readexactly(length))


FLUSH_S = 0.01
"""How long a probe's report may wait for others to share its write: nothing next to a poll interval of a second."""


async def run_worker(setup: WorkerSetup, out: asyncio.StreamWriter | Any, stdin_closed: asyncio.Future[None]) -> None:
    loop = asyncio.get_running_loop()
    pending: list[Any] = []

    def flush() -> None:
        if pending:
            out.write(encode_batch(pending))
            pending.clear()

    def send(frame: Any) -> None:
        if not pending:
            loop.call_later(FLUSH_S, flush)
        pending.append(frame)

    def probed(view: EngineView, rates: EngineRates | None) -> None:
        send(("probed", view, rates))

    def failed(view: EngineView) -> None:
        send(("failed", view))

    pollers = [EnginePoller(e, setup.observe, probed, on_failure=failed) for e in setup.engines]
    timeout = setup.observe.poll_timeout_seconds
    starved: asyncio.Future[float] = (asyncio.ensure_future(starved_for(setup.observe.worker_starved_after_seconds))
                                      if setup.idle else loop.create_future())
    ends: list[asyncio.Future[Any]] = [stdin_closed, starved]
    first = asyncio.ensure_future(first_round(pollers, timeout, lambda poller: failed(poller.view(0.0))))
    tasks: list[asyncio.Future[Any]] = [first]
    try:
        await asyncio.wait([first, *ends], return_when=asyncio.FIRST_COMPLETED)
        if first.done():
            first.result()
            send(("ready",))
            flush()  # the control plane answers no Check before it: not a moment later than needed
            interval = setup.observe.poll_interval_seconds
            wave = setup.observe.wave_s
            tasks += [asyncio.create_task(p.run(interval * (1 + i / max(1, len(pollers))), wave),
                                          name=f"poll-{p.config.name}") for i, p in enumerate(pollers)]
            await asyncio.wait(ends, return_when=asyncio.FIRST_COMPLETED)
        if starved.done():
            log.warning("starved of CPU at idle priority (a timer fired %.1f s late); stopping for a restart at nice %d",
                        starved.result(), WORKER_NICE)
            send(("starved", starved.result()))
            flush()
            if isinstance(out, asyncio.StreamWriter):
                await out.drain()  # the report must reach the control plane before this process ends
    finally:
        starved.cancel()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for poller in pollers:
            poller.close()


STARVATION_TICK_S = 0.25
"""How often the idle worker looks at its own timer (``starved_for``)."""


async def starved_for(bound_s: float, tick_s: float = STARVATION_TICK_S) -> float:
    """Returns once a ``tick_s`` timer fires more than ``bound_s`` late (how late): under ``SCHED_IDLE`` that happens only
    when other work keeps every core busy, and the worker's probes are then as late."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + tick_s
        await asyncio.sleep(tick_s)
        late = loop.time() - due
        if late > bound_s:
            return late


WORKER_NICE = 10
"""The worker yields the CPU to the control plane when both want it: a probe a few ms late costs nothing, a Check does.
Not 19: on a host that Envoy or the control plane saturates, a worker with a tenth of their weight still probes (late),
where at 19 (a seventieth) it could starve until every engine went stale. Under ``SCHED_IDLE`` (``observe.worker_priority:
idle``, the default) it yields at once instead, and this is the priority it is restarted at when idle starves it."""


def go_idle() -> bool:
    """This process under ``SCHED_IDLE``; False where the platform has no such policy or refuses it (it stays at nice).
    There is no way back without ``CAP_SYS_NICE`` (the kernel treats it as nice 20), hence a restart when starved."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError) as exc:
        log.warning("cannot run at idle priority (%s); probing at nice %d", exc, WORKER_NICE)
        return False
    return True


async def _main() -> None:
    os.nice(WORKER_NICE)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    setup: WorkerSetup = await read_frame(reader)
    logging.basicConfig(level=setup.log_level, format="%(asctime)s %(levelname)s %(name)s[worker]: %(message)s")
    if setup.idle and not go_idle():
        setup = replace(setup, idle=False)
    transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, sys.stdout)
    writer = asyncio.StreamWriter(transport, protocol, None, loop)
    stdin_closed: asyncio.Future[None] = loop.create_future()

    async def watch_stdin() -> None:
        await reader.read()  # returns at EOF: the control plane is gone
        stdin_closed.set_result(None)
    watcher = asyncio.create_task(watch_stdin())
    try:
        await run_worker(setup, writer, stdin_closed)
    finally:
        watcher.cancel()


if __name__ == "__main__":
    asyncio.run(_main())
