"""``sluice bench t10``: seed 000's experiment on the ``thor`` and ``spark`` simulator profiles, sluice against the
strongest plain-Envoy arms over the same two engines, in one run.

Both boxes run ``max_num_seqs=2``; their decode tables are seed 000's measured rates. Each burst is N concurrent
streamed requests (N = 4, the fleet's slots, and 8, twice them) of 111 completion tokens each; throughput is completion
tokens over the burst's makespan in emulated time (wall x SPEED). Output-length model: every request generates exactly
its 111 tokens (``ignore_eos``), as in the seed's experiment. The control plane learns the boxes' rates from their
metrics during a warm-up; nothing about them is configured, and it runs its default poll interval (``observe``: nothing
set).

Capacity is measured first, straight to each engine: a 1-stream and a ``max_num_seqs``-stream burst (twice each, the
median kept). The best split of each burst (brute force over every split, from those measured rates) and the even
split's throughput are computed from them.

Arms, all in front of the same two simulated engines:
- ``sluice``: ``sluice up`` with its defaults.
- ``RR``: plain Envoy ``ROUND_ROBIN``, equal weights, no caps (the even split: overflow queues in the engines).
- ``RR+w+cap``, ``LR+w+cap``: ``ROUND_ROBIN`` / ``LEAST_REQUEST`` with each engine's ``load_balancing_weight`` its
  measured tok/s at ``max_num_seqs`` streams and its concurrency capped at ``max_num_seqs`` in Envoy (per-host
  ``max_connections`` over HTTP/1.1, one Envoy worker, overflow pending in Envoy), as ``bench steady`` configures them.
  With unequal weights Envoy's ``LEAST_REQUEST`` schedules hosts by ``weight / (active + 1) ^ active_request_bias``
  (bias 1, the default); ``choice_count`` applies only when every weight is equal.
- ``direct to Thor`` (8-way only): the seed's baseline, the burst straight to the slow box.

Rounds: ROUNDS, each running every arm once per burst size, the arm order rotated by one each round (as ``bench scale``
does), after WARMUP_BURSTS 8-way bursts through sluice. Between bursts the client waits GAP_S (longer than one default
poll interval), so every burst meets an idle fleet the control plane has seen idle.

Targets, per burst size, against the run's own figures (printed with a verdict; the exit status is 1 when one misses):
- sluice's median >= MEDIAN_SHARE of the best Envoy arm's median. At 4-way the best split is the even one, which any
  arm that splits 2/2 reaches (round robin does by construction): sluice can at best tie there, and MEDIAN_SHARE allows
  for the Check's milliseconds on a 4.4 s makespan.
- sluice's worst run >= FLOOR_SHARE of the best split computed from the measured rates (97%: the seed's best pooled
  4-way run, 98.6, against its even-split ceiling, 101.4).
- no request failed or was cut short, in any arm.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp

from enginesim.profiles import PROFILES
from bench.common import (
    Target, exit_code, median, pyplot, rotated_rounds, save_figure, sim_world, verdicts, write_report,
)
from bench.plain import PlainEnvoy, plain_envoy_arm
from bench.workload import gateway, sim_stats, stream_chat

SPEED = 1.0
"""Real time: the gateway's own few milliseconds per request would otherwise be magnified SPEED-fold in emulated
time."""
TOKENS = 111
ROUNDS = 5
WARMUP_BURSTS = 4
GAP_S = 1.5
"""Wall seconds between bursts: more than the control plane's default poll interval (1 s)."""
SIZES = (4, 8)
MEDIAN_SHARE = 0.99
FLOOR_SHARE = 0.97
ENVOY_ARMS = ("RR", "RR+w+cap", "LR+w+cap")
DIRECT = "direct to Thor"
BOXES = ("thor", "spark")


@dataclass(frozen=True, slots=True)
class Box:
    """A box's measured aggregate decode rates (tok/s) with one stream and with ``slots`` streams."""

    one: float
    full: float
    slots: int


def profile_box(name: str) -> Box:
    """A box as its simulator profile's decode table states it (seed 000's measured rates for thor and spark)."""
    p = PROFILES[name]
    return Box(p.decode_aggregate_tokens_per_s[0], p.decode_aggregate_tokens_per_s[p.max_num_seqs - 1], p.max_num_seqs)


def makespan_s(box: Box, requests: int) -> float:
    """Emulated seconds for ``requests`` TOKENS-token requests on ``box``: groups of ``slots`` at the full-batch rate,
    the remainder alone at the one-stream rate (exact for 2 slots: the remainder is at most one request)."""
    full, rest = divmod(requests, box.slots)
    return full * TOKENS * box.slots / box.full + (rest * TOKENS / box.one if rest else 0.0)


def best_assignment(n: int, spark: Box, thor: Box) -> tuple[float, int]:
    """(tok/s, requests on spark) of the best split of an n-way burst between the boxes (brute force)."""
    def rate(k: int) -> float:
        return n * TOKENS / max(makespan_s(spark, k), makespan_s(thor, n - k))
    best = max(range(n + 1), key=rate)
    return rate(best), best


def even_split(n: int, spark: Box, thor: Box) -> float:
    return n * TOKENS / max(makespan_s(spark, n // 2), makespan_s(thor, n - n // 2))


def capacity_weights(rates: Sequence[float]) -> list[int]:
    """Envoy ``load_balancing_weight`` per engine: its measured tok/s at full batch, rounded, at least 1."""
    return [max(1, round(r)) for r in rates]


def envoy_arm_specs(weights: list[int], slots: list[int]) -> dict[str, dict[str, Any]]:
    """The plain-Envoy arms' ``plain_envoy_arm`` keyword arguments, by arm name (``bench steady``'s configurations)."""
    return {
        "RR": {"lb_policy": "ROUND_ROBIN"},
        "RR+w+cap": {"lb_policy": "ROUND_ROBIN", "weights": weights, "max_per_host": slots, "concurrency": 1},
        "LR+w+cap": {"lb_policy": "LEAST_REQUEST", "weights": weights, "max_per_host": slots, "concurrency": 1},
    }


def t10_targets(runs: dict[str, dict[int, list[float]]], best: dict[int, float], failures: int) -> list[Target]:
    """Every target from the run's figures: ``runs`` = tok/s per run by arm and burst size, ``best`` = the best split's
    tok/s by burst size (from the measured rates)."""
    targets = []
    for n in sorted(best):
        mine = runs["sluice"][n]
        envoy = {arm: median(by_size[n]) for arm, by_size in runs.items() if arm in ENVOY_ARMS and by_size.get(n)}
        best_arm = max(envoy, key=lambda a: envoy[a])
        targets.append(Target(f"{n}-way: sluice median vs {MEDIAN_SHARE:.0%} of the best Envoy arm's ({best_arm}, "
                              f"{envoy[best_arm]:.1f})", median(mine), MEDIAN_SHARE * envoy[best_arm], unit="tok/s"))
        targets.append(Target(f"{n}-way: sluice's worst run vs {FLOOR_SHARE:.0%} of the best split ({best[n]:.1f})",
                              min(mine), FLOOR_SHARE * best[n], unit="tok/s"))
    targets.append(Target("requests failed or cut short, every arm", failures, 0, at_least=False))
    return targets


async def _bursts(base: str, n: int, count: int) -> list[tuple[float, int]]:
    """``count`` n-way bursts, one after another, from one client with kept-alive connections (as any production client
    keeps them): per burst (emulated tok/s, requests failed or cut short)."""
    out = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        await asyncio.gather(*(session.get(base + "/v1/models") for _ in range(n)))  # open the connections
        for i in range(count):
            if i:
                await asyncio.sleep(GAP_S)
            t0 = time.perf_counter()
            results = await asyncio.gather(*(stream_chat(session, base, "t10", "cortex", "Write about rivers.", TOKENS,
                                                         ignore_eos=True) for _ in range(n)))
            wall = time.perf_counter() - t0
            tokens = sum(r.completion_tokens for r in results)
            out.append((tokens / (wall * SPEED),
                        sum(1 for r in results if r.status != 200 or r.completion_tokens != TOKENS)))
    return out


def _burst_with_split(base: str, n: int, urls: dict[str, str]) -> tuple[float, int, str]:
    """One burst through ``base``: (tok/s, failures, "Spark a / Thor b" from the engines' own served counters)."""
    before = {name: sim_stats(url)["served"] for name, url in urls.items()}
    [(rate, failed)] = asyncio.run(_bursts(base, n, 1))
    after = {name: sim_stats(url)["served"] for name, url in urls.items()}
    return rate, failed, f"Spark {after['spark'] - before['spark']} / Thor {after['thor'] - before['thor']}"


def _measure_box(url: str, slots: int) -> Box:
    one = median([rate for rate, _ in asyncio.run(_bursts(url, 1, 2))])
    full = median([rate for rate, _ in asyncio.run(_bursts(url, slots, 2))])
    return Box(one, full, slots)


@contextmanager
def _envoys(ports: list[int], weights: list[int], slots: list[int]) -> Iterator[dict[str, PlainEnvoy]]:
    with ExitStack() as stack:
        yield {arm: stack.enter_context(plain_envoy_arm(ports, **spec))
               for arm, spec in envoy_arm_specs(weights, slots).items()}


def _plot(runs: dict[str, dict[int, list[float]]], best: dict[int, float]) -> str:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(SIZES), figsize=(10, 4.5), sharey=True)
    for ax, n in zip(axes, SIZES):
        labels = [arm for arm in runs if runs[arm].get(n)]
        for i, arm in enumerate(labels):
            ax.scatter([i] * len(runs[arm][n]), runs[arm][n], zorder=3)
            ax.hlines(median(runs[arm][n]), i - 0.25, i + 0.25, color="black")
        ax.axhline(best[n], linestyle=":", color="grey")
        ax.text(len(labels) - 0.5, best[n], f" best split {best[n]:.1f}", va="bottom", ha="right", fontsize=8)
        ax.set_xticks(range(len(labels)), labels, rotation=20, fontsize=8)
        ax.set_title(f"{n}-way bursts")
    axes[0].set_ylabel("tok/s (emulated)")
    fig.suptitle("t10: Thor + Spark, 111-token bursts, interleaved rounds")
    return save_figure(fig, "t10")


def _seed_numbers() -> str:
    return """Seed 000's published numbers (real boxes, its own gateway; quoted from the seed, not measured here):
per box, pool bypassed, Thor 18.18 / 50.71 tok/s and Spark 49.24 / 87.82 at 1 / 2 streams; 4-way pooled runs 98.64 /
97.99 / 97.72 / 66.39 / 50.82 tok/s against its even-split ceiling of 101.4; 8-way direct to Thor 51.66 median, pooled
66.92 median."""


def run_t10_bench() -> int:
    engines = [{"name": name, "sim": name, "speed": SPEED} for name in BOXES]
    slots = [PROFILES[name].max_num_seqs for name in BOXES]
    runs: dict[str, dict[int, list[float]]] = {arm: {n: [] for n in SIZES} for arm in ("sluice", *ENVOY_ARMS)}
    runs[DIRECT] = {8: []}
    splits: dict[str, dict[int, list[str]]] = {arm: {n: [] for n in SIZES} for arm in runs}
    failures = 0
    with gateway(engines) as config:
        urls = {e["name"]: e["url"].rstrip("/") for e in config["engines"]}
        ports = [int(urls[name].rsplit(":", 1)[1]) for name in BOXES]
        boxes = {name: _measure_box(urls[name], s) for name, s in zip(BOXES, slots)}
        weights = capacity_weights([boxes[name].full for name in BOXES])
        asyncio.run(_bursts(config["base_url"], 8, WARMUP_BURSTS))
        with _envoys(ports, weights, slots) as envoys:
            bases = {"sluice": config["base_url"], **{arm: e.base for arm, e in envoys.items()}, DIRECT: urls["thor"]}
            for number, order in enumerate(rotated_rounds(list(bases), ROUNDS), 1):
                for n in SIZES:
                    for arm in order:
                        if n not in runs[arm]:
                            continue
                        time.sleep(GAP_S)
                        rate, failed, split = _burst_with_split(bases[arm], n, urls)
                        runs[arm][n].append(rate)
                        splits[arm][n].append(split)
                        failures += failed
                        print(f"round {number}/{ROUNDS} {n}-way {arm}: {rate:.1f} tok/s, {split}, failed {failed}",
                              flush=True)
            configs = "\n".join(f"#### `{arm}` (`envoy --concurrency {e.concurrency}`)\n\n```yaml\n"
                                f"{e.bootstrap[e.bootstrap.index('    - name: engine'):]}```\n"
                                for arm, e in envoys.items())
    spark, thor = boxes["spark"], boxes["thor"]
    best = {n: best_assignment(n, spark, thor)[0] for n in SIZES}
    targets = t10_targets(runs, best, failures)
    plot = _plot(runs, best)
    rows = []
    for n in SIZES:
        envoy_best = max((a for a in ENVOY_ARMS), key=lambda a: median(runs[a][n]))
        for arm, by_size in runs.items():
            if not by_size.get(n):
                continue
            values = by_size[n]
            ratio = " / ".join(f"{v / e:.2f}" for v, e in zip(values, runs[envoy_best][n])) if arm == "sluice" else ""
            rows.append(f"| {n} | {arm} | {' / '.join(f'{v:.1f}' for v in values)} | {median(values):.1f} | "
                        f"{min(values):.1f} | {ratio} | {', '.join(sorted(set(splits[arm][n])))} |")
    split_rows = "\n".join(
        f"| {n}-way | {best_assignment(n, spark, thor)[0]:.1f} (Spark {best_assignment(n, spark, thor)[1]} / Thor "
        f"{n - best_assignment(n, spark, thor)[1]}) | {even_split(n, spark, thor):.1f} |" for n in SIZES)
    loses = [t for t in targets if not t.met]
    plain_words = ("sluice met every target." if not loses else
                   "Where sluice misses: " + "; ".join(t.line() for t in loses) + ".")
    for n in SIZES:
        top = max(ENVOY_ARMS, key=lambda a: median(runs[a][n]))
        if median(runs["sluice"][n]) < median(runs[top][n]):
            plain_words += (f" At {n}-way sluice's median is below the best Envoy arm's ({top}): "
                            f"{median(runs['sluice'][n]):.1f} against {median(runs[top][n]):.1f} tok/s "
                            f"({median(runs['sluice'][n]) / median(runs[top][n]) - 1:+.1%}).")
    seed_spark, seed_thor = profile_box("spark"), profile_box("thor")
    doc = __doc__ or ""
    for constant, value in (("WARMUP_BURSTS", str(WARMUP_BURSTS)), ("ROUNDS", str(ROUNDS)), ("GAP_S", f"{GAP_S:g} s"),
                            ("MEDIAN_SHARE", f"{MEDIAN_SHARE:.0%}"), ("FLOOR_SHARE", f"{FLOOR_SHARE:.0%}"),
                            ("SPEED", f"{SPEED:g}")):
        doc = doc.replace(constant, value)
    body = f"""{doc}
Run: simulator speed x{SPEED:g}, {ROUNDS} rounds, {WARMUP_BURSTS} warm-up bursts through sluice, {GAP_S:g} s between
bursts. Client mix: one aiohttp client, N streamed chat completions at once (prompt "Write about rivers.", `max_tokens`
{TOKENS}, `ignore_eos`), kept-alive connections, no `x-sluice-*` headers.

{sim_world(BOXES, f"fixed, every request generates exactly its {TOKENS} tokens (`ignore_eos`, the seed's shape).")}

## Measured capacity (straight to each engine, this run)

| box | 1 stream (tok/s) | {slots[0]} streams (tok/s) | profile table | Envoy weight |
|---|---|---|---|---|
{chr(10).join(f"| {name} | {boxes[name].one:.2f} | {boxes[name].full:.2f} | "
              f"{' / '.join(f'{r:g}' for r in PROFILES[name].decode_aggregate_tokens_per_s)} | {w} |"
              for name, w in zip(BOXES, weights))}

| burst | best split (brute force, measured rates) | even split |
|---|---|---|
{split_rows}

## Results

tok/s per run in round order; "sluice / best Envoy arm" is each round's ratio to the Envoy arm with the best median for
that burst size; splits are the engines' own served counts.

| burst | arm | tok/s per run | median | worst | sluice / best Envoy arm, by round | split |
|---|---|---|---|---|---|---|
{chr(10).join(rows)}

## Verdicts

{verdicts(targets)}

{plain_words}

Targets revised on 2026-12-04 (issue 41): the 4-way target was a fixed 98 tok/s in every run (seed 000's best pooled
run), below the even split ({even_split(4, seed_spark, seed_thor):.1f} from the profile tables), which round robin
reaches with no control plane at all; it is now judged against the best Envoy arm of the same run. The 8-way floor was
95% of the best split ({0.95 * best_assignment(8, seed_spark, seed_thor)[0]:.1f} from the profile tables); both sizes
now use {FLOOR_SHARE:.0%} of the best split computed from this run's measured rates. The control plane used to poll
every 0.25 s in this bench; it now runs the default (1 s).

![t10 runs]({plot})

{_seed_numbers()}

## Every Envoy arm's configuration

Each plain Envoy runs `envoy/bench-plain.yaml` with these clusters, as rendered (ports are this run's):

{configs}"""
    path = write_report("t10", "sluice bench t10: unequal boxes, seed 000, against weighted and capped Envoy", body)
    print(body[body.index("## Measured capacity"):body.index("## Every Envoy")])
    print(f"report: {path}")
    return exit_code(targets)
