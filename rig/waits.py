"""Free loopback ports and polling waits (from a thread, ``wait_for``; inside an event loop, ``wait_until``), for the
tests and the benchmarks."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar


def free_port() -> int:
    """A loopback port free right now (``controlplane.store.valkeyserver.free_port``, the one definition)."""
    from controlplane.store.valkeyserver import free_port as pick

    return pick()


T = TypeVar("T")


def wait_for(predicate: Callable[[], T | None], timeout: float = 20.0, interval: float = 0.05,
             what: str = "condition") -> T:
    """Poll ``predicate`` until it returns something truthy (returned: never None); exceptions count as "not yet" (what
    is waited for may not be listening yet). TimeoutError names ``what`` and the last value or exception."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
            last = value
        except Exception as exc:  # the thing we wait for may not be listening yet
            last = exc
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


async def wait_until(predicate: Callable[[], object | Awaitable[object]], timeout: float = 5.0, interval: float = 0.005,
                     what: str = "condition") -> None:
    """``wait_for`` inside an event loop, for what the loop's own tasks bring about: awaits ``interval`` between calls
    of ``predicate`` (which may be a coroutine function) until it returns something truthy. Its exceptions propagate.
    TimeoutError names ``what`` and the last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what} (last: {value!r})")
        await asyncio.sleep(interval)


def wait_healthy(url: str, timeout: float = 15.0, alive: Callable[[], bool] | None = None) -> None:
    """Poll ``url + "/health"`` until it answers. RuntimeError as soon as ``alive`` (the serving process, when given)
    returns False; TimeoutError after ``timeout``."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=1).close()
            return
        except OSError as exc:
            if alive is not None and not alive():
                raise RuntimeError(f"{url} exited before answering /health") from exc
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url}/health did not answer within {timeout:g} s") from exc
            time.sleep(0.05)
