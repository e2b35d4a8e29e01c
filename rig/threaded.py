"""A real control plane on an event loop of its own, in a thread of this process: what the tests and the chaos bench use
when they must reach into it (its admission state, its metrics port) or block its loop on purpose."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from controlplane.app import ControlPlane
from controlplane.config import Config

T = TypeVar("T")


class ThreadedControlPlane:
    """A real ControlPlane (real grpc.aio servers on real ports) started on its own event loop in a daemon thread."""

    def __init__(self, config: Config, timeout: float = 30.0) -> None:
        self.timeout = timeout
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="controlplane")
        self.thread.start()
        self.plane = ControlPlane(config)
        self.call(self.plane.start())

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the control plane's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout or self.timeout)

    def close(self) -> None:
        self.call(self.plane.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
