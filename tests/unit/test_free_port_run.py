"""``free_port_run``: the base port a test or bench gives ``sluice up --replicas`` has every replica's strided port free,
outside the kernel's ephemeral range (where no port-0 bind or outgoing connection can take it after the check), and never
twice in one process. ``free_port`` is a run of one."""

from __future__ import annotations

import socket

import pytest

from controlplane.store import valkeyserver
from controlplane.store.valkeyserver import _ephemeral_range, free_port, free_port_run
from sluice.up import REPLICA_PORT_STRIDE


def test_every_strided_port_is_free_outside_the_ephemeral_range_and_never_handed_out_twice() -> None:
    seen: set[int] = set()
    for _ in range(20):
        base = free_port_run(3, REPLICA_PORT_STRIDE)
        ports = [base + REPLICA_PORT_STRIDE * i for i in range(3)]
        low, high = _ephemeral_range()
        assert ports[-1] < low or ports[0] > high
        assert not seen & set(ports)
        seen.update(ports)
        for port in ports:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", port))  # raises if the port was not free



def test_a_single_free_port_is_outside_the_ephemeral_range_too() -> None:
    low, high = _ephemeral_range()
    ports = {free_port() for _ in range(50)}
    assert len(ports) == 50 and all(p < low or p > high for p in ports)


@pytest.mark.parametrize("ephemeral", [(10500, 60999), (1024, 65535), (15000, 65000)])
def test_a_host_whose_ephemeral_range_leaves_little_room_still_gets_free_runs(
        monkeypatch: pytest.MonkeyPatch, ephemeral: tuple[int, int]) -> None:
    """Above the range when below has no room; the kernel's picks when neither side has (a container's 1024-65535)."""
    monkeypatch.setattr(valkeyserver, "_ephemeral_range", lambda: ephemeral)
    for _ in range(10):
        base = free_port_run(2, REPLICA_PORT_STRIDE)
        for port in (base, base + REPLICA_PORT_STRIDE):
            assert port <= 65535
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", port))
