"""``bench steady``'s open mix replayed through the pure core (no Envoy, no network): thor + spark at speed x10 (seed
000 rates, 2 slots each), prompts and end-of-sequence answer lengths drawn as the bench draws them, arrivals at 85-110%
of the pair's capacity, the park sweep every 0.1 s. Under "shed early" no request is answered 503 after its decision
window, and the requests served meet the bench's 2 s TTFT target where a queue that sheds nobody (strict FIFO, no
overload bound: a capped Envoy with sluice's routing) lets them wait past it.

``replay`` prints nothing; ``python -m tests.unit.test_overload_replay`` prints its figures for every cell (the ones
bench/results/shed-early.md quotes)."""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass

import pytest

from controlplane.core.admission import AdmissionCore
from controlplane.core.model import InferenceRequest, Outcome, Verdict
from controlplane.core.ledger import Ledger
from controlplane.core.fleet import BatchRates, RateTables
from controlplane.core.policy import Policy
from tests.unit.coreinputs import engine

SPEED = 10.0
RATES = {"thor": {1: 18.18 * SPEED, 2: 50.71 / 2 * SPEED}, "spark": {1: 49.24 * SPEED, 2: 87.82 / 2 * SPEED}}
PREFILL = {"thor": 1500.0 * SPEED, "spark": 4000.0 * SPEED}
SLO_S = 2.0
CAPACITY = (50.71 + 87.82) / 248.0 * SPEED
"""Requests per wall second at the cortex profile's mean answer (248 tokens)."""
FIFO = Policy(lifo_after_ms=0, overload_shed_after_ms=0)
"""Strict FIFO that sheds nobody before ``max_park_s``: what a capped Envoy's pending queue does, with sluice's routing."""
CELLS = ((0.85, "poisson", 30.0), (0.95, "constant", 30.0), (0.95, "poisson", 30.0), (1.1, "constant", 40.0))


@dataclass(frozen=True)
class Replayed:
    arrived: int
    served: int
    good: int
    """Served with TTFT within ``SLO_S``."""
    shed: int
    late_shed: int
    """Shed after more than 1 s parked."""
    ttft_p90: float

    def goodput(self, seconds: float) -> float:
        return self.good / seconds


def replay(policy: Policy, level: float, seconds: float, seed: int, arrival: str) -> Replayed:
    rng = random.Random(seed)
    core = AdmissionCore(policy, Ledger(lease_seconds=600))
    for i in range(core.output_lengths.min_samples):  # a warm control plane: the model's lengths are known
        core.record_output("cortex", max(1, round(random.Random(i).lognormvariate(math.log(180), 0.8))))
    views = [engine("thor", decode=18.18 * SPEED, prefill=PREFILL["thor"]),
             engine("spark", decode=49.24 * SPEED, prefill=PREFILL["spark"])]
    tables = RateTables(decode_by_batch={name: BatchRates(rates) for name, rates in RATES.items()})
    count = int(level * CAPACITY * seconds)
    times = (sorted(rng.uniform(0, seconds) for _ in range(count)) if arrival == "poisson"
             else [i / (level * CAPACITY) for i in range(count)])
    jobs: dict[str, tuple[float, int, int]] = {}
    events: list[tuple[float, int, str]] = []  # (time, kind: 0 stream ends, 1 sweep, 2 arrival, id)
    for i, at in enumerate(times):
        prompt = int(min(4000, max(32, rng.lognormvariate(math.log(500), 0.8))))
        jobs[f"r{i}"] = (at, prompt, max(1, round(rng.lognormvariate(math.log(180), 0.8))))
        events.append((at, 2, f"r{i}"))
    events += [(tick / 10, 1, "") for tick in range(1, int(seconds * 40))]
    heapq.heapify(events)
    ttfts: list[float] = []
    shed_after: list[float] = []

    def answered(outcome: Outcome, now: float) -> None:
        if outcome.ticket is not None:
            at, prompt, tokens = jobs[outcome.request_id]
            name = outcome.ticket.engine
            rate, prefill = RATES[name][2], prompt / PREFILL[name]
            ttfts.append(now - at + prefill + 1 / rate)
            heapq.heappush(events, (now + prefill + tokens / rate, 0, f"{outcome.ticket.ticket_id}|{tokens}"))
        elif outcome.decision.verdict is not Verdict.PARK:
            shed_after.append(outcome.parked_for)

    while events:
        now, kind, name = heapq.heappop(events)
        if kind == 2:
            request = InferenceRequest("POST", "/v1/chat/completions", "cortex", prompt_tokens=jobs[name][1])
            answered(core.check(name, request, core.fleet(views, now, tables), now), now)
        elif kind == 0:
            ticket, tokens = name.split("|")
            core.release(ticket, now)
            core.record_output("cortex", int(tokens))
            for outcome in core.wake(core.fleet(views, now, tables), now):
                answered(outcome, now)
        elif core.depth():
            for outcome in core.expire_parked(core.fleet(views, now, tables), now):
                answered(outcome, now)
    assert not core.depth(), "every request answered"
    ttfts.sort()
    return Replayed(count, len(ttfts), sum(1 for t in ttfts if t <= SLO_S), len(shed_after),
                    sum(1 for s in shed_after if s > 1.0), ttfts[math.ceil(len(ttfts) * 0.9) - 1] if ttfts else 0.0)


@pytest.mark.parametrize(("level", "arrival", "seconds"), CELLS)
def test_shed_early_never_sheds_late_and_serves_more_in_time_than_a_queue(level: float, arrival: str,
                                                                          seconds: float) -> None:
    """Over three draws (one may go either way: a refusal on an estimate too late costs a request a luckier queue
    served in time)."""
    early = [replay(Policy(), level, seconds, 1000 + seed, arrival) for seed in range(3)]
    queue = [replay(FIFO, level, seconds, 1000 + seed, arrival) for seed in range(3)]
    assert all(r.late_shed == 0 for r in early), early
    assert sum(r.good for r in early) >= sum(r.good for r in queue), (early, queue)
    assert sum(r.good for r in early) >= 0.9 * sum(r.served for r in early), early  # what it serves, it serves in time


def main() -> None:
    """Every cell's figures, averaged over 8 seeds: sluice's defaults; a standing line held to the 4 s overload bound
    instead of ``lifo_after_ms``'s 2 s; the queue that sheds nobody."""
    for name, policy in (("defaults", Policy()), ("standing bound 4 s", Policy(lifo_after_ms=4000)),
                         ("fifo, no shedding", FIFO)):
        for level, arrival, seconds in CELLS:
            runs = [replay(policy, level, seconds, 1000 + seed, arrival) for seed in range(8)]

            def mean(values: list[float]) -> float:
                return sum(values) / len(values)
            print(f"{name:19s} {level:.0%} {arrival:8s} arrived {mean([r.arrived for r in runs]):.1f} served "
                  f"{mean([r.served for r in runs]):.1f} good {mean([r.good for r in runs]):.1f} goodput "
                  f"{mean([r.goodput(seconds) for r in runs]):.2f} req/s shed {mean([r.shed for r in runs]):.1f} "
                  f"(after > 1 s: {mean([r.late_shed for r in runs]):.1f}) TTFT p90 "
                  f"{mean([r.ttft_p90 for r in runs]):.2f} s")


if __name__ == "__main__":
    main()
