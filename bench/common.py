"""What every benchmark shares: where results go, the machine they ran on, and a markdown report."""

from __future__ import annotations

import asyncio
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from matplotlib.figure import Figure

from rig.waits import free_port as free_port, wait_for as wait_for

RESULTS = Path(__file__).resolve().parent / "results"


def envoy_cluster_total(admin_port: int, stat: str, clusters: Iterable[str]) -> int:
    """One of Envoy's per-cluster counters (``upstream_rq_total``, ``upstream_cx_total``...) summed over ``clusters``
    (admin ``/stats``): what Envoy sent or opened to the engines, the control plane's own traffic left out."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/stats?filter={stat}", timeout=10).read().decode()
    names = set(clusters)
    return sum(int(m.group(2)) for m in re.finditer(rf"^cluster\.(.+)\.{re.escape(stat)}: (\d+)$", text, re.M)
               if m.group(1) in names)


def cpu_seconds(pid: int, children: bool = False) -> float:
    """utime + stime of one process from /proc, 0 when it is gone; with ``children``, also its children's: the reaped
    ones (the kernel adds them to the parent's counters) and the running ones (a control plane's probe worker)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    if not children:
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    running = [int(p) for p in os.listdir("/proc") if p.isdigit() and _parent(int(p)) == pid]
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK") + sum(
        cpu_seconds(child, children=True) for child in running)


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, {platform.system()}"


def cpu_model() -> str:
    """The processor's model name (``/proc/cpuinfo``), or "unknown"."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def commit() -> str:
    """The checkout's commit, with ``+dirty`` when its tracked files outside ``bench/results/`` have uncommitted changes
    (a run rewrites its own reports and figures there before it writes the one that names the commit; "unknown"
    outside git)."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                                  cwd=Path(__file__).parent).stdout.strip()
        except OSError:
            return ""
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    changed = git("status", "--porcelain", "--untracked-files=no", "--", ":/", ":(top,exclude)bench/results")
    return head + ("+dirty" if changed else "")


def cpu_times(stat: str | None = None) -> tuple[int, ...]:
    """The machine's CPU time counters (``/proc/stat``'s first line: user, nice, system, idle, iowait, irq, softirq,
    steal, ...), in clock ticks."""
    if stat is None:
        with open("/proc/stat") as f:
            stat = f.readline()
    return tuple(int(x) for x in stat.split()[1:])


def stolen_share(before: tuple[int, ...], after: tuple[int, ...]) -> float:
    """The share of the machine's CPU time between two ``cpu_times`` readings that the hypervisor gave to other guests
    (the steal column, the eighth): this bench's host is a shared virtual machine, and a window with several percent
    stolen measures the neighbours as much as the gateway."""
    elapsed = sum(after) - sum(before)
    if len(after) < 8 or len(before) < 8 or elapsed <= 0:
        return 0.0
    return (after[7] - before[7]) / elapsed



_STARTED = (os.getloadavg(), cpu_times() if Path("/proc/stat").exists() else ())
"""The host's load average and CPU time counters when the bench process started (``write_report``'s "before")."""


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def pyplot() -> ModuleType:
    """matplotlib's pyplot on the file-only Agg backend (no display here)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Figure, name: str) -> str:
    """Write ``fig`` as ``bench/results/<name>.png``; the file name, for the report's image link."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path.name


def write_report(name: str, title: str, body: str) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.md"
    command = "sluice " + " ".join(sys.argv[1:]) if sys.argv[0].endswith("sluice") else " ".join(sys.argv)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    (load_before, times_before), load_after = _STARTED, os.getloadavg()
    stolen = stolen_share(times_before, cpu_times()) if times_before else 0.0

    def loads(values: tuple[float, float, float]) -> str:
        return " / ".join(f"{v:.2f}" for v in values)
    path.write_text(f"# {title}\n\n- command: `{command}`\n- when: {stamp}\n- commit: {commit()}\n"
                    f"- machine: {machine()}, {cpu_model()}\n- load (1 / 5 / 15 min): {loads(load_before)} at start, "
                    f"{loads(load_after)} at the end; CPU stolen by other guests meanwhile: {stolen:.1%}\n\n{body}\n")
    return path


async def paced(rate: float, seconds: float, start: Callable[[], Awaitable[object]]) -> None:
    """Open-loop arrivals: ``start()`` every ``1 / rate`` seconds for ``seconds`` on the clock (never waiting for the
    earlier ones to finish, so a slow server cannot slow the offered load), then wait for all of them."""
    tasks = []
    t0 = time.perf_counter()
    for i in range(int(rate * seconds)):
        delay = t0 + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(start()))
    await asyncio.gather(*tasks)


def latency_plot(series: Mapping[str, Sequence[tuple[float, float, float]]], name: str, title: str) -> str:
    """p50 (solid) and p99 (dashed) end-to-end latency by offered rate, one line pair per path; the PNG's file name."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, points in series.items():
        rates = [p[0] for p in points]
        ax.plot(rates, [p[1] for p in points], marker="o", label=f"{label} p50")
        ax.plot(rates, [p[2] for p in points], marker="x", linestyle="--", label=f"{label} p99")
    ax.set_xlabel("requests/s")
    ax.set_ylabel("end-to-end latency (ms)")
    ax.set_title(title)
    ax.legend()
    return save_figure(fig, name)


def histogram_quantile(before: Mapping[float, float], after: Mapping[float, float], q: float) -> float:
    """Quantile (ms) of the observations between two scrapes of a cumulative histogram (upper bound -> count),
    interpolated within the bucket (NaN when nothing was observed)."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return float("nan")
    target = q * counts[-1]
    lower, previous = 0.0, 0.0
    for bound, cumulative in zip(bounds, counts):
        if cumulative >= target:
            if bound == float("inf"):
                return lower * 1000
            share = (target - previous) / (cumulative - previous) if cumulative > previous else 1.0
            return (lower + (bound - lower) * share) * 1000
        lower, previous = bound, cumulative
    return lower * 1000


async def closed_loop(url: str, concurrency: int, seconds: float, body: dict[str, Any],
                      headers: Mapping[str, str] | None = None) -> float:
    """Successful requests/s with ``concurrency`` clients each sending the next request as soon as one is answered."""
    import aiohttp

    done = 0
    stop_at = time.perf_counter() + seconds

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            async with session.post(url, json=body) as response:
                await response.read()
                done += response.status == 200

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=dict(headers or {})) as session:
        started = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        return done / (time.perf_counter() - started)


@dataclass(frozen=True, slots=True)
class Target:
    """One target a bench checks, from what its run measured: met when ``measured >= bound`` (``at_least``) or
    ``measured <= bound`` (not ``at_least``); a NaN measurement (nothing observed) is a miss."""

    name: str
    measured: float
    bound: float
    at_least: bool = True
    unit: str = ""
    """Printed after both figures ("tok/s", "ms", ""...)."""

    @property
    def met(self) -> bool:
        if math.isnan(self.measured):
            return False
        return self.measured >= self.bound if self.at_least else self.measured <= self.bound

    def line(self) -> str:
        """``name: measured X unit (target >= Y unit): met`` (or ``**missed**``)."""
        unit = f" {self.unit}" if self.unit else ""
        return (f"{self.name}: measured {self.measured:.{_digits(self.measured)}f}{unit} (target "
                f"{'>=' if self.at_least else '<='} {self.bound:.{_digits(self.bound)}f}{unit}): "
                f"{'met' if self.met else '**missed**'}")


def _digits(value: float) -> int:
    """Decimals to print a figure with: integers as such, small figures with three, the rest with two."""
    if not math.isfinite(value) or value == int(value):  # nan, inf (a shed request's TTFT over a finite one)
        return 0
    return 3 if abs(value) < 1 else 2


def verdicts(targets: Sequence[Target]) -> str:
    """The targets as a markdown list, one verdict a line, then how many were met."""
    met = sum(t.met for t in targets)
    return "\n".join(f"- {t.line()}" for t in targets) + f"\n\n{met} of {len(targets)} targets met."


def exit_code(targets: Sequence[Target]) -> int:
    """0 when every target is met (and there is at least one), 1 otherwise."""
    return 0 if targets and all(t.met for t in targets) else 1


def sim_world(profiles: Iterable[str], output: str) -> str:
    """What the simulated engines assume, in a paragraph for a report: ``output`` (the bench's output-length model, in
    its words), then each profile's tokenizer, chunked prefill and context-dependent decode (``enginesim/profiles.py``),
    and how they differ from sluice's estimator's priors."""
    from enginesim.profiles import PROFILES

    parts = []
    for name in dict.fromkeys(profiles):
        p = PROFILES[name]
        parts.append(f"`{name}` {p.chars_per_token:g} characters a token, {p.template_tokens_per_message} template "
                     f"tokens a message, chunked prefill of {p.prefill_chunk_tokens} tokens a step, decode "
                     f"{p.decode_slowdown_per_1k_tokens:.1%} slower per 1,000 tokens of mean context")
    return (f"Simulated world (`enginesim/profiles.py`): output lengths: {output} Tokenizer and engine model: "
            + "; ".join(parts) + ". sluice's estimator assumes 4 characters a token, no template tokens, prefill "
            "beside decode and context-free decode: it has to learn the difference from the engines' metrics.")


ItemT = TypeVar("ItemT")


def rotated_rounds(items: Sequence[ItemT], rounds: int) -> list[list[ItemT]]:
    """Each round's order of ``items``: rotated by one more each round, so none always runs first or last."""
    return [list(items[r % len(items):]) + list(items[:r % len(items)]) for r in range(rounds)]


def by_round(figures: Mapping[str, Any], key: str) -> list[float]:
    """One arm's ``key`` in each round of a cell (its ``rounds``: each round's own figures), or the pooled figure alone
    when the arm ran a single round."""
    return [r[key] for r in figures.get("rounds") or [figures]]


def interleaved(arms: Sequence[ItemT], rounds: int) -> list[tuple[int, ItemT]]:
    """(round, arm) in the order a cell runs them: every arm once a round, the arms' order rotated each round
    (``rotated_rounds``), so no arm always runs first or last or always after the same one."""
    return [(number, arm) for number, order in enumerate(rotated_rounds(arms, rounds)) for arm in order]


# -- Prometheus expositions ----------------------------------------------------------------------------------------------
def parse_samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample of metric ``name`` (exactly, e.g. ``sluice_store_seconds_bucket``) in a Prometheus exposition: its
    labels and value."""
    out = []
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, labels = head.partition("{")
        if metric != name:
            continue
        out.append((dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', labels)), float(value)))
    return out


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(v for have, v in parse_samples(text, name) if all(have.get(k) == w for k, w in labels.items()))


def histogram(text: str, name: str, **labels: str) -> dict[float, float]:
    """A histogram's cumulative buckets (upper bound -> count), summed over the label sets that match ``labels``."""
    out: dict[float, float] = {}
    for have, value in parse_samples(text, name + "_bucket"):
        if all(have.get(k) == w for k, w in labels.items()):
            bound = float("inf") if have["le"] == "+Inf" else float(have["le"])
            out[bound] = out.get(bound, 0.0) + value
    return out


def scrape(port: int) -> str:
    """The Prometheus exposition a local control plane serves on ``port``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return str(response.read().decode())
