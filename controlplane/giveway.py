"""Background work on the control plane's event loop gives way to Checks between its slices.

Three jobs run on the loop that answers Checks and grow with the fleet: applying the probe worker's reports
(``Observation._run_worker``), the staleness pass (``ControlPlane._watch_staleness``) and the fallback weights
(``XdsPublisher._weights_in_slices``). Each runs in slices and pauses between them with ``give_way``.

Why a timer and not ``asyncio.sleep(0)``: grpc.aio delivers every step of a Check as an event of its own (its poller thread
writes a byte to a socket pair the loop watches), and every turn runs what is ready before the events that arrived
meanwhile, so after ``sleep(0)`` each of a Check's four or five steps would wait behind a slice. Behind a timer the loop
waits in epoll between slices, so a Check's steps run back to back, and the control plane's thread leaves the CPU to
Envoy instead of holding it for a whole batch (figures: docs/decisions/0010-background-work-in-slices.md).

The cost: background work runs at most one slice per ``BACKGROUND_PAUSE_S``. At 1000 engines polled every second (1000
reports a second, 4 a slice) that is a quarter of the loop's time in pauses, and a starved worker's backlog of 900 reports
is applied over about 0.3 s instead of at once.
"""

from __future__ import annotations

import asyncio

BACKGROUND_PAUSE_S = 0.001
"""The pause between two slices of background work: longer than a Check's steps take back to back (about 0.1 ms each),
short enough that the slices still keep up at 1000 engines."""


async def give_way() -> None:
    """Pause a background job between two slices so that Checks which arrived meanwhile are answered first."""
    await asyncio.sleep(BACKGROUND_PAUSE_S)
