"""``sluice bench overhead``: what sluice adds to a request. The same engine is reached through Envoy with sluice (Lua
header strip, json_to_metadata, ext_authz Check on the control plane, access log) and through a plain Envoy route; at
50, 200 and 500 requests/s (open loop, fixed intervals) each path's end-to-end latency is measured by the client, and the
Check's own latency by the control plane's ``sluice_authz_check_seconds`` histogram (the difference of two scrapes
around each of its segments).

Each rate runs ROUNDS rounds; a round runs each path for one SEGMENT_S segment (after 20 unmeasured requests), the
order of the two paths rotated every round (as ``bench scale`` does), so both paths see the same drift in this shared
machine's load. Latencies are pooled over the rounds; the report also gives what sluice added in each round. "Added" is
sluice's quantile minus the plain path's (p50 and p99), not a quantile of per-request differences.

Targets at 200 requests/s (printed with a verdict; the exit status is 1 when one misses): the Check's p50 <= 1 ms and
p99 <= 5 ms, no request failed through sluice, and (one-token answers only) the added end-to-end p50 <= 2 ms.
``--stream`` keeps the Check and failure targets; ``--engines`` reports without targets (its rates follow the engines'
capacity).

The engine is the simulator at x1000 with 64 slots and one-token answers, so nearly all of a request's time is the path's.
Client, Envoys, control plane and engine share this machine's 2 cores: figures include that contention.

``--engines FILE``: front the engines a YAML file lists instead (a list of engine entries as in a config's ``engines:``, or a
mapping with that key; an entry with ``sim:`` is started as a simulator, any other is an engine already running, e.g. a real
llama.cpp server). The plain Envoy routes to the same engines round robin, so they must listen on 127.0.0.1. Each engine is
first measured alone, straight to it (no Envoy): a one-token request's latency and a 64-token request's decode rate, so
the report shows what the engines are. The machine's capacity for one-token requests is then measured through the plain
Envoy (closed loop, every slot kept busy), and the rates are 20, 40 and 60 % of it, so that both paths measure a path
rather than a queue. The report is ``bench/results/overhead-<file stem>.md``, with each engine's share of sluice's
successes and the failures by status and error code."""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench.common import (
    Target, closed_loop, exit_code, histogram, histogram_quantile, latency_plot, median, pct, paced, rotated_rounds, sim_world,
    verdicts, write_report,
)
from bench.plain import plain_envoy
from bench.workload import gateway

RATES = (50, 200, 500)
ROUNDS = 4
SEGMENT_S = 3.0
"""Seconds of measured traffic per path, rate and round (ROUNDS x SEGMENT_S per path and rate in all)."""
TARGET_RATE = 200
PATHS = ("plain Envoy", "Envoy + sluice")
BODY = {"model": "cortex", "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
STREAM_TOKENS = 32
STREAM_BODY = {**BODY, "max_tokens": STREAM_TOKENS, "ignore_eos": True, "stream": True}
"""``--stream``: a streamed answer of 32 tokens, each its own SSE chunk: what the response-side Lua filter costs per chunk
shows in the whole stream's time."""


async def open_loop(url: str, rate: int, seconds: float, body: dict[str, Any] | None = None,
                    served: Counter[str] | None = None, failed: Counter[str] | None = None) -> tuple[list[float], int]:
    """Send ``rate`` requests/s for ``seconds``; return latencies (ms) of the successes and the failure count. ``served``
    counts the successes by their ``x-sluice-engine``, ``failed`` the failures by status and error code."""
    latencies: list[float] = []
    failures = 0
    body = body or BODY

    async def one(session: aiohttp.ClientSession) -> None:
        nonlocal failures
        started = time.perf_counter()
        try:
            async with session.post(url, json=body) as response:
                payload = await response.read()
                if response.status == 200:
                    latencies.append((time.perf_counter() - started) * 1000)
                    if served is not None:
                        served[response.headers.get("x-sluice-engine", "?")] += 1
                else:
                    failures += 1
                    if failed is not None:
                        failed[f"{response.status} {_error_code(payload)}"] += 1
        except aiohttp.ClientError as exc:
            failures += 1
            if failed is not None:
                failed[type(exc).__name__] += 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for _ in range(20):  # warm the connection pool and both paths' caches
            await one(session)
        latencies.clear()
        failures = 0
        for counter in (served, failed):
            if counter is not None:
                counter.clear()
        await paced(rate, seconds, lambda: one(session))
    return latencies, failures


def _error_code(payload: bytes) -> str:
    try:
        return str(json.loads(payload)["error"].get("code") or "-")
    except (ValueError, KeyError, TypeError, AttributeError):
        return "-"


def _histogram(metrics_url: str) -> dict[float, float]:
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    return histogram(text, "sluice_authz_check_seconds")


def load_engines(path: str) -> list[dict[str, Any]]:
    """The engine entries of an ``--engines`` file: a list, or a mapping with an ``engines:`` list (a config file)."""
    data = yaml.safe_load(Path(path).read_text())
    if isinstance(data, dict):
        data = data.get("engines")
    if not isinstance(data, list) or not data or not all(isinstance(e, dict) and e.get("name") for e in data):
        raise SystemExit(f"{path}: expected a list of engine entries (name, url, ...) or a mapping with `engines:`")
    for entry in data:
        if "sim" not in entry and not entry.get("url"):
            raise SystemExit(f"{path}: engine {entry['name']!r} has neither url nor sim")
    return data


def _local_port(url: str) -> int:
    host, _, port = url.split("://", 1)[-1].rstrip("/").rpartition(":")
    if host not in ("127.0.0.1", "localhost") or not port.isdigit():
        raise SystemExit(f"{url}: the plain-Envoy comparison needs engines on 127.0.0.1:<port>")
    return int(port)


def _get_json(url: str) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return json.load(response)
    except (OSError, ValueError):
        return None


def _timed_post(url: str, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as response:
        answer = json.load(response)
    return time.perf_counter() - started, answer


def calibrate(entry: dict[str, Any]) -> dict[str, Any]:
    """One engine alone, straight to it: its model, slots, version, one-token latency and decode rate."""
    url = entry["url"].rstrip("/")
    listing = _get_json(url + "/v1/models") or {}
    model = (entry.get("models") or [m["id"] for m in listing.get("data", [])] or ["?"])[0]
    props = _get_json(url + "/props") or {}
    slots = entry.get("max_num_seqs") or props.get("total_slots") or 1
    body = {"model": model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
    for _ in range(3):
        _timed_post(url + "/v1/chat/completions", body)
    one = statistics.median(_timed_post(url + "/v1/chat/completions", body)[0] for _ in range(15))
    long = {**body, "max_tokens": 64, "ignore_eos": True}
    timings = [_timed_post(url + "/v1/chat/completions", long) for _ in range(3)]
    seconds = statistics.median(t for t, _ in timings)
    tokens = timings[0][1].get("usage", {}).get("completion_tokens", 64)
    return {"name": entry["name"], "url": url, "model": model, "slots": int(slots),
            "version": props.get("build_info", ""), "one_token_ms": one * 1000,
            "decode_tokens_per_s": (tokens - 1) / max(seconds - one, 1e-6)}


def _counts(counter: Counter[str]) -> str:
    return ", ".join(f"{key}: {n}" for key, n in counter.most_common()) or "-"


@dataclass
class RateRun:
    """One rate's measurements over its rounds: each path's latencies (ms, successes) and failures per round, the
    Check's histogram counts summed over sluice's segments, sluice's successes by ``x-sluice-engine`` and each path's
    failures by status and error code."""

    rate: int
    latencies: dict[str, list[list[float]]] = field(default_factory=lambda: {p: [] for p in PATHS})
    failures: dict[str, list[int]] = field(default_factory=lambda: {p: [] for p in PATHS})
    checks: Counter[float] = field(default_factory=Counter)
    served: Counter[str] = field(default_factory=Counter)
    failed_by: dict[str, Counter[str]] = field(default_factory=lambda: {p: Counter() for p in PATHS})

    def pooled(self, path: str) -> list[float]:
        return [ms for segment in self.latencies[path] for ms in segment]

    def added(self, q: float) -> float:
        """sluice's pooled quantile ``q`` (percent) minus the plain path's, ms."""
        return _quantile(self.pooled(PATHS[1]), q) - _quantile(self.pooled(PATHS[0]), q)

    def added_by_round(self, q: float) -> list[float]:
        return [_quantile(mine, q) - _quantile(theirs, q)
                for theirs, mine in zip(self.latencies[PATHS[0]], self.latencies[PATHS[1]])]

    def check(self, q: float) -> float:
        """The Check's quantile ``q`` (0..1), ms, server side, over sluice's segments."""
        return histogram_quantile({}, self.checks, q)

    def failed(self, path: str) -> int:
        return sum(self.failures[path])


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return median(values) if q == 50 else pct(values, q)


def overhead_targets(run: RateRun, one_token: bool) -> list[Target]:
    """The targets at ``run``'s rate (the bench's TARGET_RATE): Check p50 <= 1 ms, p99 <= 5 ms, no failure through
    sluice, and with one-token answers the added end-to-end p50 <= 2 ms."""
    at = f"{run.rate} requests/s"
    targets = [Target(f"Check p50 at {at}", run.check(0.5), 1.0, at_least=False, unit="ms"),
               Target(f"Check p99 at {at}", run.check(0.99), 5.0, at_least=False, unit="ms"),
               Target(f"requests failed through sluice at {at}", run.failed(PATHS[1]), 0, at_least=False)]
    if one_token:
        targets.append(Target(f"added end-to-end p50 at {at}", run.added(50), 2.0, at_least=False, unit="ms"))
    return targets


def measure_rate(rate: int, urls: dict[str, str], metrics_url: str, body: dict[str, Any], rounds: int = ROUNDS,
                 seconds: float = SEGMENT_S) -> RateRun:
    """``rounds`` rounds at ``rate``: each path (``urls``: PATHS -> chat completions URL) for ``seconds``, in an order
    rotated every round; the Check histogram scraped around each sluice segment."""
    run = RateRun(rate)
    for order in rotated_rounds(PATHS, rounds):
        for path in order:
            served: Counter[str] = Counter()
            failed: Counter[str] = Counter()
            before = _histogram(metrics_url) if path == PATHS[1] else {}
            latencies, failures = asyncio.run(open_loop(urls[path], rate, seconds, body, served, failed))
            if path == PATHS[1]:
                after = _histogram(metrics_url)
                run.checks.update({bound: after[bound] - before.get(bound, 0.0) for bound in after})
                run.served.update(served)
            run.latencies[path].append(latencies)
            run.failures[path].append(failures)
            run.failed_by[path].update(failed)
            print(f"{rate} requests/s, {path}: p50 {_quantile(latencies, 50):.2f} ms, p99 "
                  f"{_quantile(latencies, 99):.2f} ms, {failures} failed", flush=True)
    return run


def _row(run: RateRun) -> str:
    """One rate's line of the report table: both paths' p50 / p99, what sluice adds (pooled, then by round), the
    Check's own quantiles, the failures."""
    plain, mine = run.pooled(PATHS[0]), run.pooled(PATHS[1])
    by_round = " · ".join(f"{a:.2f} / {b:.2f}" for a, b in zip(run.added_by_round(50), run.added_by_round(99)))
    return (f"| {run.rate} | {_quantile(plain, 50):.2f} / {_quantile(plain, 99):.2f} | "
            f"{_quantile(mine, 50):.2f} / {_quantile(mine, 99):.2f} | "
            f"**{run.added(50):.2f} / {run.added(99):.2f}** | {by_round} | "
            f"{run.check(0.5):.3f} / {run.check(0.99):.3f} | {run.failed(PATHS[0])} / {run.failed(PATHS[1])} |")


TABLE_HEAD = ("| requests/s | plain Envoy p50 / p99 (ms) | Envoy + sluice p50 / p99 (ms) | added p50 / p99 (ms) | "
              "added p50 / p99 by round (ms) | Check p50 / p99 (ms, server) | failures plain / sluice |\n"
              + "|---" * 7 + "|")


def _outside(runs: list[RateRun], stream: bool) -> str:
    """A sentence on the rates the targets do not judge: where sluice added more than the 200 requests/s bounds."""
    over = [f"{r.rate} requests/s (added p50 {r.added(50):.2f} ms)" for r in runs
            if r.rate != TARGET_RATE and not stream and r.added(50) > 2.0]
    over += [f"{r.rate} requests/s (Check p99 {r.check(0.99):.3f} ms)" for r in runs
             if r.rate != TARGET_RATE and r.check(0.99) > 5.0]
    if not over:
        return f"At the other rates sluice also stayed within the {TARGET_RATE} requests/s bounds."
    return (f"The targets are set at {TARGET_RATE} requests/s; at other rates sluice went past those bounds at "
            + ", ".join(over) + ".")


def _series(runs: list[RateRun]) -> dict[str, list[tuple[float, float, float]]]:
    return {path: [(float(r.rate), _quantile(r.pooled(path), 50), _quantile(r.pooled(path), 99)) for r in runs]
            for path in PATHS}


def run_overhead_bench(engines_file: str | None = None, stream: bool = False) -> int:
    if engines_file is not None:
        return _run_on_engines(engines_file)
    return _run_on_simulator(stream)


def _run_on_engines(engines_file: str) -> int:
    entries = load_engines(engines_file)
    runs: list[RateRun] = []
    with gateway([dict(e) for e in entries], observe={"poll_interval_seconds": 1.0}) as config:
        engines = config["engines"]
        ports = [_local_port(e["url"]) for e in engines]
        measured = [calibrate(e) for e in engines]
        models = {m["model"] for m in measured}
        if len(models) != 1:
            raise SystemExit(f"the engines serve different models {sorted(models)}: the comparison needs one")
        body = {"model": models.pop(), "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
        load_before = os.getloadavg()
        with plain_envoy(ports) as plain_base:
            plain_url = plain_base + "/v1/chat/completions"
            # What this machine can carry (client, Envoy and every engine on the same cores): the engines' slots kept
            # busy through the plain Envoy.
            capacity = asyncio.run(closed_loop(plain_url, sum(m["slots"] for m in measured), 5.0, body))
            rates = sorted({max(1, round(capacity * share)) for share in (0.2, 0.4, 0.6)})
            urls = {PATHS[0]: plain_url, PATHS[1]: config["base_url"] + "/v1/chat/completions"}
            metrics_url = f"http://127.0.0.1:{config['controlplane']['metrics_port']}/metrics"
            runs = [measure_rate(rate, urls, metrics_url, body) for rate in rates]
        load_after = os.getloadavg()
    splits = []
    for run in runs:
        total = sum(run.served.values()) or 1
        splits.append(f"| {run.rate} | " + " | ".join(f"{run.served[m['name']]} ({run.served[m['name']] / total:.0%})"
                                                      for m in measured)
                      + f" | {_counts(run.failed_by[PATHS[0]])} | {_counts(run.failed_by[PATHS[1]])} |")
    name = "overhead-" + Path(engines_file).stem
    plot = latency_plot(_series(runs), name, f"what sluice adds to a one-token request ({Path(engines_file).stem})")
    engine_rows = "\n".join(
        f"| {m['name']} | {m['url']} | {m['version'] or '-'} | {m['slots']} | {m['one_token_ms']:.1f} | "
        f"{m['decode_tokens_per_s']:.0f} |" for m in measured)
    listing = Path(engines_file).read_text().rstrip()
    body_text = f"""Against the engines of `{engines_file}` (not simulators):

```yaml
{listing}
```

Each engine alone, straight to it (no Envoy, one request at a time; the decode rate from 64-token answers):

| engine | url | version | slots | one-token latency p50 (ms) | decode tokens/s (one request) |
|---|---|---|---|---|---|
{engine_rows}

Capacity: {capacity:.0f} one-token requests/s, measured through the plain Envoy with every slot kept busy (closed loop,
5 s); the rates are 20, 40 and 60 % of it. Open loop, {ROUNDS} rounds of {SEGMENT_S:g} s per rate and path, the paths'
order rotated every round; client mix: one aiohttp client, non-streaming chat completions (one user message, "ping")
answered with one token (`max_tokens` 1); the plain Envoy routes round robin to the same engines. Load average (1, 5,
15 min) before: {", ".join(f"{x:.1f}" for x in load_before)}; after: {", ".join(f"{x:.1f}" for x in load_after)}
(client, both Envoys, the control plane and the engines share this machine's {os.cpu_count()} cores, with whatever else
runs on it). No targets: the rates follow these engines' capacity.

{TABLE_HEAD}
{chr(10).join(_row(r) for r in runs)}

Where sluice sent them (successes by `x-sluice-engine`), and the failures by status and error code:

| requests/s | {" | ".join(m["name"] for m in measured)} | plain failures | sluice failures |
|---|{"---|" * len(measured)}---|---|
{chr(10).join(splits)}

![latency by rate]({plot})
"""
    path = write_report(name, f"sluice bench overhead --engines: what the gateway adds in front of {Path(engines_file).stem}",
                        body_text)
    print(body_text)
    print(f"report: {path}")
    return 0


def _run_on_simulator(stream: bool = False) -> int:
    engine = {"name": "fast", "sim": "spark", "speed": 1000, "max_num_seqs": 64}
    body = STREAM_BODY if stream else BODY
    name = "overhead-stream" if stream else "overhead"
    what = f"a streamed {STREAM_TOKENS}-token request" if stream else "a one-token request"
    with gateway([engine], observe={"poll_interval_seconds": 1.0}) as config:
        engine_port = int(config["engines"][0]["url"].rsplit(":", 1)[1])
        with plain_envoy([engine_port]) as plain_base:
            urls = {PATHS[0]: plain_base + "/v1/chat/completions",
                    PATHS[1]: config["base_url"] + "/v1/chat/completions"}
            metrics_url = f"http://127.0.0.1:{config['controlplane']['metrics_port']}/metrics"
            runs = [measure_rate(rate, urls, metrics_url, body) for rate in RATES]
    targets = overhead_targets(next(r for r in runs if r.rate == TARGET_RATE), one_token=not stream)
    plot = latency_plot(_series(runs), name, f"what sluice adds to {what}")
    shape = (f"streamed chat completions of {STREAM_TOKENS} tokens (`max_tokens` {STREAM_TOKENS}, `ignore_eos`, one "
             "SSE chunk each; the latency is the whole stream's)" if stream
             else "non-streaming chat completions answered with one token (`max_tokens` 1)")
    output = (f"fixed, {STREAM_TOKENS} tokens a request (`ignore_eos`)." if stream
              else "one token a request (`max_tokens` 1 caps the drawn end-of-sequence length).")
    headline = next(r for r in runs if r.rate == TARGET_RATE)
    doc = (__doc__ or "").replace("ROUNDS", str(ROUNDS)).replace("SEGMENT_S", f"{SEGMENT_S:g} s")
    report = f"""{doc}

Run: one simulated engine (`spark` profile, `max_num_seqs` 64, speed x1000), the control plane polling every 1 s; open
loop, {ROUNDS} rounds of {SEGMENT_S:g} s per rate and path (after 20 unmeasured requests each), the paths' order
rotated every round. Client mix: one aiohttp client, {shape}, one user message ("ping"), no `x-sluice-*` headers; the
plain Envoy routes round robin to the same engine.

{sim_world(["spark"], output)}

Headline at {TARGET_RATE} requests/s: sluice adds **{headline.added(50):.2f} ms at p50 and {headline.added(99):.2f} ms
at p99** end to end (by round, p50: {" / ".join(f"{x:.2f}" for x in headline.added_by_round(50))}; p99:
{" / ".join(f"{x:.2f}" for x in headline.added_by_round(99))}).

{TABLE_HEAD}
{chr(10).join(_row(r) for r in runs)}

{_outside(runs, stream)}

## Verdicts

{verdicts(targets)}

For scale, llm-d's endpoint picker reports P50 0.69 ms / P95 ~4.5 ms with a random picker at 500 QPS (its
published figure, not measured here).

![latency by rate]({plot})
"""
    path = write_report(name, "sluice bench overhead: what the gateway adds", report)
    print(report)
    print(f"report: {path}")
    return exit_code(targets)
