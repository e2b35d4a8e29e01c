"""``ControlPlane.stop`` is bounded: a step that hangs (a store that stopped answering, say) is abandoned after
``controlplane.stop_step_seconds`` with a warning, and the steps after it still run (the gRPC port is closed)."""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import pytest

from controlplane.app import ControlPlane
from controlplane.config import parse_config


def test_a_hung_step_is_abandoned_and_the_servers_still_stop(caplog: pytest.LogCaptureFixture) -> None:
    config = parse_config({
        "controlplane": {"grpc_port": 0, "metrics_port": 0, "admin_port": 0, "stop_step_seconds": 0.5},
        "envoy": {"listen_port": 0, "admin_port": 0},
        "engines": [{"name": "nowhere", "url": "http://127.0.0.1:9"}],  # discard: nothing answers
    })
    hung = asyncio.Event()

    async def scenario() -> tuple[float, int]:
        plane = ControlPlane(config)
        await plane.start()
        real_stop = plane.service.stop

        async def stuck_store_close() -> None:  # what a store that never answers its close looks like to stop()
            await real_stop()
            hung.set()
            await asyncio.sleep(3600)

        plane.service.stop = stuck_store_close  # type: ignore[method-assign]  # its store's close hangs
        started = time.monotonic()
        await plane.stop()
        return time.monotonic() - started, plane.grpc_port

    with caplog.at_level(logging.WARNING, logger="sluice.controlplane"):
        took, port = asyncio.run(scenario())
    assert hung.is_set()
    assert took < 3.0, f"stop took {took:.1f} s with a 0.5 s bound per step"
    assert "admission service and store took over 0.5 s" in caplog.text
    with pytest.raises(OSError):  # the gRPC server after the hung step was stopped: nothing listens there
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_the_bound_is_read_and_checked() -> None:
    base = {"envoy": {"listen_port": 0, "admin_port": 0}, "engines": [{"name": "a", "url": "http://127.0.0.1:9"}]}
    assert parse_config(base).controlplane.stop_step_seconds == 5.0
    with pytest.raises(Exception, match="controlplane.stop_step_seconds"):
        parse_config({**base, "controlplane": {"stop_step_seconds": 0}})
