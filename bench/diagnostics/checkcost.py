"""CPU per Check and per probe report on the control plane's real path (``ControlPlane`` minus gRPC), at N engines
(2026-12-04, d3c7eb5). Not part of the product or of ``make test``: a diagnostic whose figures have no host noise in
them, unlike ``bench scale``'s end-to-end ones.

    python bench/diagnostics/checkcost.py 2 1000        # per-Check and per-report CPU at 2 and at 1000 engines
    python bench/diagnostics/checkcost.py 1000 --count  # ... and how often a model's output tail was rebuilt

One real report first: a ``bench scale`` farm engine (``bench/farm.py``, real-size vLLM 0.11 text) probed by an
``EnginePoller``. Then, per size, a ``ControlPlane`` of that many engines (as ``bench scale`` configures them: cap 256,
no chip class) is warmed with 12 rounds of that report for every engine (rates jittered 5%, the running count 0-1),
and 3 x 3000 Checks run as ``authz.py`` makes them (``parse_request``, ``AdmissionService.check``, ``record_outcome``;
the ticket released 3 ms later), 10 ms of simulated time apart; with more than 2 engines, 3 reports land before each
Check as the probe worker's reader lands them (``Observation.probed``, then ``refresh_rows``): 300 a second, the
default probe budget. Process CPU (``time.process_time``) around those calls only.
"""

from __future__ import annotations

import asyncio
import gc
import json
import random
import subprocess
import sys
import time
from dataclasses import replace
from typing import Any

from controlplane.app import ControlPlane
from controlplane.config import parse_config
from controlplane.core import output_length
from controlplane.core.engines import EngineRates, EngineView
from controlplane.core.request import parse_request
from controlplane.observe.poller import EnginePoller

BODY = b'{"model": "reasoning", "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}'


def _engines(count: int, url: str) -> list[dict[str, Any]]:
    return [{"name": f"e{i}", "url": url, "max_num_seqs": 256, "models": ["reasoning"], "flavor": "vllm"}
            for i in range(count)]


def _config(engines: list[dict[str, Any]]) -> Any:
    return parse_config({"controlplane": {"grpc_port": 1, "metrics_port": 2}, "envoy": {"listen_port": 3, "admin_port": 4},
                         "engines": engines})


def real_report() -> tuple[EngineView, EngineRates]:
    """A farm engine's view and rates, as its third probe reports them."""
    farm = subprocess.Popen([sys.executable, "-c", "from bench.farm import main_engines; main_engines()",
                             "--engines", "1"], stdout=subprocess.PIPE, text=True)
    try:
        assert farm.stdout is not None
        port = json.loads(farm.stdout.readline())["ports"][0]
        config = _config(_engines(1, f"http://127.0.0.1:{port}"))
        got: list[tuple[EngineView, EngineRates | None]] = []

        async def probe() -> None:
            poller = EnginePoller(config.engines[0], config.observe, lambda v, r: got.append((v, r)))
            for _ in range(3):
                await poller.poll_once()
                await asyncio.sleep(1.1)
            poller.close()

        asyncio.run(probe())
    finally:
        farm.terminate()
        farm.wait(10)
    view, rates = got[-1]
    assert rates is not None
    return view, rates


async def measure(size: int, view0: EngineView, rates0: EngineRates) -> list[tuple[float, float]]:
    now = [1000.0]
    plane = ControlPlane(_config(_engines(size, "http://127.0.0.1:9")), clock=lambda: now[0])
    pollers: dict[str, EnginePoller] = {}
    for config in plane.config.engines:
        poller = EnginePoller(config, plane.config.observe, plane.observation.probed, clock=lambda: now[0])
        plane.observation.pollers.append(poller)
        pollers[config.name] = poller
    rng = random.Random(1)
    names = list(pollers)

    def report(name: str) -> tuple[EnginePoller, EngineView, EngineRates]:
        assert view0.sample is not None and rates0.prefill_tokens_per_s and rates0.decode_tokens_per_s_each
        rates = replace(rates0, prefill_tokens_per_s=rates0.prefill_tokens_per_s * rng.uniform(0.95, 1.05),
                        decode_tokens_per_s_each=rates0.decode_tokens_per_s_each * rng.uniform(0.95, 1.05))
        sample = replace(view0.sample, taken_at=now[0], running=float(rng.choice((0, 0, 1))))
        view = replace(view0, name=name, url=pollers[name].config.url, chip_class=name, sample=sample,
                       last_ok_at=now[0], rates=rates)
        return pollers[name], view, rates

    def land(batch: list[tuple[EnginePoller, EngineView, EngineRates]]) -> None:
        for poller, view, rates in batch:
            poller._view = view  # what the probe worker's reader does with a report (observation._apply_frame)
            plane.observation.probed(view, rates)
        plane.observation.refresh_rows(now[0])

    for _ in range(12):
        now[0] += 1.0
        land([report(n) for n in names])

    async def checks(count: int) -> tuple[float, float]:
        check_s = report_s = 0.0
        reports = 0
        for i in range(count):
            now[0] += 0.01
            if size > 2:
                batch = [report(names[rng.randrange(size)]) for _ in range(3)]
                started = time.process_time()
                land(batch)
                report_s += time.process_time() - started
                reports += len(batch)
            started = time.process_time()
            parsed = parse_request("POST", "/v1/chat/completions", BODY, {"content-type": "application/json"},
                                   plane.service.settings.policy)
            outcome = await plane.service.check(f"r{i}", parsed)
            plane.service.record_outcome("reasoning", outcome, parsed, "")
            check_s += time.process_time() - started
            now[0] += 0.003
            assert outcome.ticket is not None, outcome.decision
            plane.service.release_ticket(outcome.ticket.ticket_id)
            await asyncio.sleep(0)
        return check_s / count * 1e6, report_s / reports * 1e6 if reports else 0.0

    await checks(300)
    gc.collect()
    gc.freeze()  # as the process does after start-up
    try:
        return [await checks(3000) for _ in range(3)]
    finally:
        gc.unfreeze()


def main() -> None:
    sizes = [int(a) for a in sys.argv[1:] if a.isdigit()] or [2, 1000]
    rebuilds = [0]
    if "--count" in sys.argv:
        build = output_length.OutputTail.of.__func__  # type: ignore[attr-defined]

        def counted(cls: type[output_length.OutputTail], lengths: Any) -> Any:
            rebuilds[0] += 1
            return build(cls, lengths)

        setattr(output_length.OutputTail, "of", classmethod(counted))
    view0, rates0 = real_report()
    for size in sizes:
        rebuilds[0] = 0
        runs = asyncio.run(measure(size, view0, rates0))
        checks = " / ".join(f"{c:.0f}" for c, _ in runs)
        reports = " / ".join(f"{r:.0f}" for _, r in runs)
        tail = f", output tail rebuilt {rebuilds[0]} times" if "--count" in sys.argv else ""
        print(f"{size} engines: CPU per Check {checks} us; per report {reports} us{tail}", flush=True)


if __name__ == "__main__":
    main()
