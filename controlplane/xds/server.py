"""The ADS servicer: a thin shell that moves requests and snapshot changes through ``AdsStream``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from controlplane.metrics import SluiceMetrics
from controlplane.xds.snapshot import SnapshotCache
from controlplane.xds.stream import AdsStream

log = logging.getLogger("sluice.xds")


class AdsServicer(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):
    def __init__(self, cache: SnapshotCache, metrics: SluiceMetrics) -> None:
        self.cache = cache
        self.metrics = metrics
        self.streams: set[AdsStream] = set()
        self.nacks_total = 0

    async def StreamAggregatedResources(  # noqa: N802 (gRPC method name)
        self, request_iterator: AsyncIterator[discovery_pb2.DiscoveryRequest], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[discovery_pb2.DiscoveryResponse]:
        stream = AdsStream()
        self.streams.add(stream)
        self.metrics.xds_streams.inc()
        events: asyncio.Queue[discovery_pb2.DiscoveryRequest | None] = asyncio.Queue()

        async def read() -> None:
            async for request in request_iterator:
                events.put_nowait(request)
            events.put_nowait(None)

        async def watch() -> None:
            generation = self.cache.generation
            while True:
                generation = await self.cache.wait_newer(generation)
                events.put_nowait(discovery_pb2.DiscoveryRequest(type_url=""))  # a wake-up, not from Envoy

        reader = asyncio.create_task(read())
        watcher = asyncio.create_task(watch())
        try:
            while (event := await events.get()) is not None:
                if event.type_url:
                    responses = stream.on_request(event, self.cache.snapshot)
                elif self.cache.snapshot is not None:
                    responses = stream.on_snapshot(self.cache.snapshot)
                else:
                    responses = []
                self._record_nacks(stream)
                for response in responses:
                    self.metrics.xds_responses.labels(response.type_url).inc()
                    yield response
        finally:
            reader.cancel()
            watcher.cancel()
            self.streams.discard(stream)
            self.metrics.xds_streams.dec()

    def _record_nacks(self, stream: AdsStream) -> None:
        while stream.nacks:
            nack = stream.nacks.pop(0)
            self.nacks_total += 1
            self.metrics.xds_nacks.labels(nack.type_url).inc()
            log.error(
                "Envoy %s rejected %s version %s (keeping its last good config): %s",
                stream.node_id, nack.type_url.rsplit(".", 1)[-1], nack.version, nack.message,
            )
