"""Shed early: when a parked request is told at once that it would start too late. Pure: no I/O, no clock.

A parked request may be shed for its bound only inside its decision window, its first ``shed_decision_s`` in the lot
less ``ANSWER_MARGIN_S``; past it, it is **committed**, never shed for its bound again. Inside the window ``too_late``
sheds it, with its expected wait as Retry-After, when its expected start (waits.expected_start, its place in line) is
past its bound: with a TTFT deadline its park limit (``ttft_unmeetable``); without, ``wait_bound_s`` after it parked
(``overloaded``; ``park_timeout`` at ``max_park_s``)::

    overload_bound = max(overload_shed_after_ms, overload_shed_services x service)
    wait_bound     = min(max_park_s, overload_bound, max(lifo_after_ms, STANDING_SERVICES x service) if the line stands)

A request is shed ``overloaded`` only once its line has held parked requests without a break for ``overload_burst_s``
(its oldest parked that long ago): a burst that finds the line empty (a fan-out of sub-requests sent at once) is
committed whole and served in turn, however long its tail waits; a line that has stood longer is judged as above
(decision 0032). ``park_timeout`` at ``max_park_s`` has no such gate.

``service``: the model's mean time from admission to release (``ServiceTimes``), the engines' expected service until one
was released; the line *stands* while its class holds a committed request. An estimate that rests on the policy's
default decode rate (``StartEstimate.known`` False) sheds nobody.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from controlplane.core.fleet import Fleet
from controlplane.core.model import Decision, Parked, Reason
from controlplane.core.policy import Policy
from controlplane.core.waits import clamp_retry_after, deadline_text, expected_start, shed

ANSWER_MARGIN_S = 0.1
"""A parked request is committed this much before its decision window ends, so that a shed decided at the last moment
still reaches its client within ``shed_decision_s`` of its Check (the park sweep runs every 0.1 s)."""
STANDING_SERVICES = 2.0
"""While a line stands, a request without a deadline may still expect to wait this many of its model's service times
when that is longer than ``lifo_after_ms`` (a slow model's line turns over in service times, not seconds)."""
SERVICE_EWMA = 0.1
"""Weight of each release in a model's mean service time: about the last 10-20 releases count."""


class ServiceTimes:
    """Each model's recent seconds from admission to release, averaged with weight ``SERVICE_EWMA``."""

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}

    def record(self, model: str, held_s: float) -> None:
        before = self._seconds.get(model)
        self._seconds[model] = held_s if before is None else before + SERVICE_EWMA * (held_s - before)

    def get(self, model: str) -> float | None:
        return self._seconds.get(model)


def committed(parked: Parked, now: float, policy: Policy) -> bool:
    """Past its decision window: never shed for its bound again, served in its turn."""
    return now - parked.parked_at >= policy.shed_decision_s - ANSWER_MARGIN_S


def overload_bound_s(policy: Policy, service_s: float) -> float:
    """The overload bound for a model whose requests take ``service_s`` (module docstring)."""
    return max(policy.overload_shed_after_ms / 1000, policy.overload_shed_services * service_s)


def wait_bound_s(policy: Policy, service_s: float, standing: Callable[[], bool]) -> float:
    """How long after parking a request without a TTFT deadline may be expected to start (module docstring).
    ``standing``: whether its class's line holds a committed request. ``overload_shed_after_ms`` 0: ``max_park_s``
    alone; ``lifo_after_ms`` 0: no standing-line bound; ``overload_shed_services`` 0: no ``STANDING_SERVICES``."""
    bound = policy.max_park_s
    if policy.overload_shed_after_ms <= 0:
        return bound
    bound = min(bound, overload_bound_s(policy, service_s))
    target = policy.lifo_after_ms / 1000
    if target > 0 and standing():
        if policy.overload_shed_services > 0:
            target = max(target, STANDING_SERVICES * service_s)
        bound = min(bound, target)
    return bound


def too_late(parked: Parked, ahead: int, fleet: Fleet, now: float, policy: Policy, cached: Mapping[str, int],
             measured_s: float | None, standing: Callable[[], bool], queued_since: float) -> Decision | None:
    """The shed for ``parked`` (not committed, ``ahead`` requests in line before it) if it is expected to start past its
    bound, or None. ``cached``: its expected prefix-cache hits; ``measured_s``: its model's service time (None: none
    released yet); ``standing``: whether its class's line holds a committed request; ``queued_since``: when the oldest
    request in its class's line parked (the line has held parked requests since, without a break)."""
    model = parked.request.model
    assert model is not None
    start = expected_start(parked.request, fleet, policy, now, ahead, typical=measured_s is None, cached=cached)
    if not start.known:
        return None
    wait = start.wait_s
    retry = clamp_retry_after(wait, policy)
    if parked.ttft_bound:
        if now + wait <= parked.deadline:
            return None
        return shed(Reason.TTFT_UNMEETABLE,
                    f"{model}: expected to start in {wait:.1f} s ({ahead} ahead in line), too late for "
                    f"{deadline_text(parked.request)}", retry)
    bound = wait_bound_s(policy, start.service_s if measured_s is None else measured_s, standing)
    if now + wait <= parked.parked_at + bound:
        return None
    burst = now - queued_since < policy.overload_burst_s  # a burst into an empty line: served in turn
    if bound >= policy.max_park_s or (burst and now + wait > parked.parked_at + policy.max_park_s):
        return shed(Reason.PARK_TIMEOUT, f"{model}: expected to start in {wait:.1f} s ({ahead} ahead in line), "
                    f"past the {policy.max_park_s:g} s a request may wait", retry)
    if burst:
        return None
    return shed(Reason.OVERLOADED, f"{model} is overloaded: expected to start in {wait:.1f} s ({ahead} ahead in "
                f"line), past the {bound:.1f} s a request without a deadline may wait now", retry)
