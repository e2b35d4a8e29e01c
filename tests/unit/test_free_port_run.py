"""``free_port_run``: the base port a test or bench gives ``sluice up --replicas`` has every replica's strided port free,
below the kernel's ephemeral range (where no port-0 bind or outgoing connection can take it after the check), and never
twice in one process. ``free_port`` is a run of one."""

from __future__ import annotations

import socket

from controlplane.store.valkeyserver import _ephemeral_floor, free_port, free_port_run
from sluice.up import REPLICA_PORT_STRIDE


def test_every_strided_port_is_free_below_the_ephemeral_range_and_never_handed_out_twice() -> None:
    seen: set[int] = set()
    for _ in range(20):
        base = free_port_run(3, REPLICA_PORT_STRIDE)
        ports = [base + REPLICA_PORT_STRIDE * i for i in range(3)]
        assert ports[-1] < _ephemeral_floor()
        assert not seen & set(ports)
        seen.update(ports)
        for port in ports:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", port))  # raises if the port was not free



def test_a_single_free_port_is_below_the_ephemeral_range_too() -> None:
    ports = {free_port() for _ in range(50)}
    assert len(ports) == 50 and max(ports) < _ephemeral_floor()
