"""Live decisions: a bounded fan-out of every final admission answer to the admin API's ``WatchDecisions`` watchers.

Each watcher has a queue of ``WATCH_QUEUE`` events. Publishing never waits: when a watcher's queue is full the event is
dropped for that watcher alone, counted (``sluice_admin_watch_dropped_total``), and the next event it does receive carries
how many it lost. A Check never slows down because someone is watching; with no watcher, publishing costs one test.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from controlplane.metrics import SluiceMetrics

WATCH_QUEUE = 1024


@dataclass(frozen=True, slots=True)
class DecisionEvent:
    at_unix: float
    request_id: str
    verdict: str
    reason: str
    engine: str
    model: str
    tenant: str
    parked_ms: float
    expected_ttft_s: float
    retry_after_s: int
    priority: str


class Watcher:
    def __init__(self, model: str | None, size: int) -> None:
        self.model = model
        self.queue: asyncio.Queue[DecisionEvent] = asyncio.Queue(maxsize=size)
        self.dropped = 0

    async def next(self) -> tuple[DecisionEvent, int]:
        """The next event and how many were dropped before it (since the previous one this watcher got)."""
        event = await self.queue.get()
        dropped, self.dropped = self.dropped, 0
        return event, dropped


class DecisionFeed:
    def __init__(self, metrics: SluiceMetrics, size: int = WATCH_QUEUE) -> None:
        self.metrics = metrics
        self.size = size
        self.watchers: list[Watcher] = []

    def subscribe(self, model: str | None = None, size: int | None = None) -> Watcher:
        watcher = Watcher(model or None, size or self.size)
        self.watchers.append(watcher)
        return watcher

    def unsubscribe(self, watcher: Watcher) -> None:
        if watcher in self.watchers:
            self.watchers.remove(watcher)

    def publish(self, event: DecisionEvent) -> None:
        for watcher in self.watchers:
            if watcher.model is not None and watcher.model != event.model:
                continue
            try:
                watcher.queue.put_nowait(event)
            except asyncio.QueueFull:
                watcher.dropped += 1
                self.metrics.watch_dropped.inc()
