"""Background slices give way to Checks (controlplane/giveway.py).

grpc.aio hands each step of a Check to the event loop as an I/O event: its poller thread writes a byte to a socket pair
the loop watches. A Check is four or five such steps. Here a socket pair plays the Check: five round trips, each a turn
of the loop started by a byte arriving, while a background job runs slices of CPU work. What the test counts is how
many slices ran before the five steps were done: that is what a Check arriving during a batch of probe reports waits.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable

from controlplane.giveway import BACKGROUND_PAUSE_S, give_way
from rig.waits import wait_until

STEPS = 5
SLICE_S = 0.002


def slices_during_a_check(pause: Callable[[], Awaitable[None]]) -> int:
    async def run() -> int:
        loop = asyncio.get_running_loop()
        slices = 0
        stop = False

        async def background() -> None:
            nonlocal slices
            while not stop:
                end = time.perf_counter() + SLICE_S  # a slice of reports: CPU, no await
                while time.perf_counter() < end:
                    pass
                slices += 1
                await pause()

        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        theirs.setblocking(False)
        done: asyncio.Future[int] = loop.create_future()
        steps = 0

        def step() -> None:  # one step of the Check: a turn of the loop started by a byte, answered with a byte
            nonlocal steps
            ours.recv(1)
            steps += 1
            if steps == STEPS:
                done.set_result(slices)
            else:
                theirs.send(b"x")

        loop.add_reader(ours.fileno(), step)
        job = asyncio.ensure_future(background())
        await wait_until(lambda: slices > 0, what="the job running its slices")
        at_arrival = slices
        theirs.send(b"x")
        at_done = await done
        stop = True
        await job
        loop.remove_reader(ours.fileno())
        ours.close()
        theirs.close()
        return at_done - at_arrival

    return asyncio.run(run())


def test_a_check_arriving_during_background_work_waits_for_at_most_the_slice_in_progress() -> None:
    # The slice running when the Check's first byte lands, and at most one more if the host stalls this process.
    assert BACKGROUND_PAUSE_S > 0
    assert slices_during_a_check(give_way) <= 2


def test_without_the_pause_every_step_of_the_check_waits_behind_a_slice() -> None:
    """What ``give_way`` replaced: ``sleep(0)`` puts the next slice on the ready queue, and each turn of the loop runs it
    before the event that arrived meanwhile."""
    async def sleep_zero() -> None:
        await asyncio.sleep(0)

    assert slices_during_a_check(sleep_zero) >= STEPS - 1
