"""``sluice bench cag4``: seed 004's incident on the ``v100pp2`` simulated engine (152,432 KV tokens, max_num_seqs 4,
prefill 262 tok/s), through Envoy with sluice's admission and with admission bypassed (straight to the engine).

Workload (same in both arms): two 65,536-token prompts at t=0, then eight 8,192-token prompts arriving every 0.3 s; every
request asks for 4,096 tokens and generates all of them (``ignore_eos``: the seed's worst case) and streams. Two 65k requests plus two 8k ones at full length need 163,840 tokens: more KV than
the engine has, so an engine left to itself preempts (recomputing a prompt from scratch), which is what the seed measured.
Every prompt has a random head (``unique_prompt``): no two share a prefix, so the engine's prefix cache shares no KV
between them (the seed's prompts were distinct documents).
The simulator runs ``SPEED`` times faster than the profile; TTFT and parked times are reported in wall seconds and in
emulated seconds (x SPEED)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp

from bench.common import median, pct, pyplot, save_figure, write_report
from bench.workload import Result, bare_sim, gateway, sample_stats, sim_stats, stream_chat, unique_prompt

SPEED = 100.0
MODEL = "reasoning"
LONG_TOKENS, SHORT_TOKENS, MAX_TOKENS = 65_536, 8_192, 4_096
SHORT_COUNT, SHORT_GAP_S = 8, 0.3


async def _run_workload(base: str, stats_url: str) -> tuple[list[Result], list[tuple[float, dict[str, Any]]]]:
    samples: list[tuple[float, dict[str, Any]]] = []
    stop = asyncio.Event()
    t0 = time.perf_counter()
    sampler = asyncio.create_task(sample_stats(stats_url, stop, samples, t0))
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        async def later(delay: float, tag: str, tokens: int) -> Result:
            await asyncio.sleep(delay)
            return await stream_chat(session, base, tag, MODEL, unique_prompt(tokens), MAX_TOKENS, t0=t0,
                                     ignore_eos=True)

        jobs = [later(0.0, "65k", LONG_TOKENS), later(0.05, "65k", LONG_TOKENS)]
        jobs += [later(0.1 + i * SHORT_GAP_S, "8k", SHORT_TOKENS) for i in range(SHORT_COUNT)]
        results = await asyncio.gather(*jobs)
    stop.set()
    await sampler
    return list(results), samples


async def _time_to_413(base: str, count: int = 20) -> list[float]:
    body = b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "' + b"a" * (2 * 1024 * 1024) \
        + b'"}]}'
    out = []
    async with aiohttp.ClientSession() as session:
        for _ in range(count):
            started = time.perf_counter()
            async with session.post(base + "/v1/chat/completions", data=body,
                                    headers={"content-type": "application/json"}) as response:
                await response.read()
                assert response.status == 413, response.status
            out.append((time.perf_counter() - started) * 1000)
    return out


def _ttft_rows(results: list[Result]) -> list[str]:
    rows = []
    for tag in ("65k", "8k"):
        ttfts = [r.ttft_s for r in results if r.tag == tag and r.ttft_s is not None]
        parked = [r.parked_ms / 1000 for r in results if r.tag == tag]
        if not ttfts:
            rows.append(f"| {tag} | - | - | - |")
            continue
        rows.append(f"| {tag} | {median(ttfts):.2f} s ({median(ttfts) * SPEED:.0f} s) | "
                    f"{pct(ttfts, 95):.2f} s ({pct(ttfts, 95) * SPEED:.0f} s) | "
                    f"{median(parked):.2f} s / max {max(parked):.2f} s |")
    return rows


def _plot(arms: dict[str, list[tuple[float, dict[str, Any]]]]) -> str:
    plt = pyplot()
    fig, axes = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for label, samples in arms.items():
        t = [s[0] for s in samples]
        axes[0].plot(t, [s[1]["kv_usage"] * 100 for s in samples], label=label)
        axes[1].step(t, [s[1]["preemptions"] for s in samples], where="post", label=label)
    axes[0].axhline(100, color="grey", linestyle=":")
    axes[0].set_ylabel("engine KV used (%)")
    axes[1].set_ylabel("preemptions (cumulative)")
    axes[1].set_xlabel(f"wall seconds (simulator x{SPEED:g})")
    axes[0].legend()
    axes[0].set_title("seed 004 on v100pp2: two 65k prompts + eight 8k prompts")
    return save_figure(fig, "cag4")


def run_cag4_bench() -> int:
    engine = {"name": "v100", "sim": "v100pp2", "speed": SPEED}
    arms: dict[str, tuple[list[Result], list[tuple[float, dict[str, Any]]], dict[str, Any]]] = {}
    to_413: list[float] = []
    for label, backfill in (("through sluice (strict FIFO, the default)", False),
                            ("through sluice, admission.backfill on", True)):
        with gateway([dict(engine)], admission={"max_park_seconds": 240, "backfill": backfill}) as config:
            stats_url = config["engines"][0]["url"]
            results, samples = asyncio.run(_run_workload(config["base_url"], stats_url))
            arms[label] = (results, samples, sim_stats(stats_url))
            if not to_413:
                to_413 = asyncio.run(_time_to_413(config["base_url"]))
    with bare_sim("v100pp2", SPEED) as url:
        results, samples = asyncio.run(_run_workload(url, url))
        arms["admission bypassed (straight to the engine)"] = (results, samples, sim_stats(url))

    def ok(results: list[Result]) -> str:
        return f"{sum(1 for r in results if r.status == 200 and r.completion_tokens == MAX_TOKENS)}/{len(results)}"

    plot = _plot({label.split(" (")[0].split(",")[0] + (" + backfill" if "backfill" in label else ""): samples
                  for label, (_, samples, _) in arms.items()})
    summary = "\n".join(
        f"| {label} | {ok(results)} | {stats['preemptions']} | {stats['max_running_seen']} | "
        f"{max(s[1]['kv_usage'] for s in samples):.0%} |"
        for label, (results, samples, stats) in arms.items()
    )
    ttft = "\n\n".join(
        f"TTFT, {label} (parked time is the `x-sluice-parked-ms` header):\n\n"
        f"| prompt | TTFT p50 | TTFT p95 | parked p50 / max |\n|---|---|---|---|\n"
        + "\n".join(_ttft_rows(results))
        for label, (results, _, _) in arms.items()
    )
    body = f"""Simulator speed x{SPEED:g}: times are wall seconds, emulated seconds in brackets.

| arm | served in full | vllm:num_preemptions_total | max running | peak KV used |
|---|---|---|---|---|
{summary}

{ttft}

Time to a 413 for a 2 MiB body through Envoy (20 requests): median {median(to_413):.2f} ms, max {max(to_413):.2f} ms
(Envoy refuses it before any Check and before any engine sees it).

![KV and preemptions]({plot})
"""
    path = write_report("cag4", "sluice bench cag4: seed 004's KV incident", body)
    print(body)
    print(f"report: {path}")
    sluice_preemptions = [stats["preemptions"] for label, (_, _, stats) in arms.items() if "sluice" in label]
    return 0 if not any(sluice_preemptions) else 1
