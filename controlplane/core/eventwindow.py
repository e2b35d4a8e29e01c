"""A count of events over a sliding window: the rate bounds of dynamic adapter loads (adapterloads.py) and of
preemptions (preempt.py). Pure: times are passed in."""

from __future__ import annotations

from collections import deque

MINUTE_S = 60.0
"""The window of every ``..._per_minute`` bound."""


class EventWindow:
    """When the recent events happened, the oldest dropped as they leave the window."""

    def __init__(self, window_s: float = MINUTE_S) -> None:
        self.window_s = window_s
        self._at: deque[float] = deque()

    def allows(self, now: float, limit: int) -> bool:
        """Whether one more event at ``now`` keeps at most ``limit`` in any ``window_s`` (fewer than ``limit`` within
        the window's last stretch before ``now``)."""
        while self._at and self._at[0] <= now - self.window_s:
            self._at.popleft()
        return len(self._at) < limit

    def note(self, now: float) -> None:
        self._at.append(now)
