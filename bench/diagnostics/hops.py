"""Hop-by-hop timing of ``bench scale`` requests (session 21's diagnosis of the 1000-engine tail). Not part of the product
or of ``make test``: it needs ``hop-timing.patch`` applied to the control plane (``git apply
bench/diagnostics/hop-timing.patch``; ``git checkout controlplane/`` to undo), which makes the access-log servicer and the
Check handler write their timings to the files the environment names.

    python bench/diagnostics/hops.py run 1000 15 /tmp/hops/a   # one segment; writes /tmp/hops/a.{als,chk,client.json}
    python bench/diagnostics/hops.py show /tmp/hops/a /tmp/hops/b

A request's time splits into: cli_pre (client send to Envoy's start), body, to_cp (Envoy holds the body until the Check's
handler starts), check (the handler), back (its answer until Envoy's first byte to the engine), upstream (the engine),
down, cli_post. ``show`` prints each hop's p50/p90/p99 and its mean over the slowest 2%, then the share of requests held
1.5 ms or more past a typical 2-engine value at each hop, and how many requests opened a new engine connection (the
first time the access log shows its upstream local port). The warm-up's requests are counted with the window's.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from typing import Any

TYPICAL_US = {"cli_pre": 450, "body": 200, "to_cp": 900, "check": 900, "back": 450, "upstream": 330, "down": 10,
              "cli_post": 400}
"""Roughly each hop's p50 at 2 engines on the bench machine: a request more than 1.5 ms past it was held there."""


def run(size: str, seconds: float, out: str) -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from sluice.bench import scale
    from sluice.bench.common import median, paced, pct

    os.environ["DIAG_HOPS_ALS"], os.environ["DIAG_HOPS_CHECKS"] = out + ".als", out + ".chk"
    for path in (out + ".als", out + ".chk"):
        if os.path.exists(path):
            os.remove(path)
    sent: list[dict[str, Any]] = []

    async def open_loop(session: Any, url: str, rate: int, seconds: float) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []

        async def one() -> None:
            rid, wall, started = uuid.uuid4().hex, time.time(), time.perf_counter()
            async with session.post(url, json=scale.BODY, headers={"x-request-id": rid}) as response:
                await response.read()
                status = response.status
            rows.append({"rid": rid, "wall": wall, "status": status, "engine": "", "farm": "",
                         "ms": (time.perf_counter() - started) * 1000})
        await paced(rate, seconds, one)
        sent.extend(rows)
        return rows

    scale.open_loop = open_loop  # the segment's own client, with request ids and wall-clock send times
    segment = scale.run_segment(size, seconds)
    latencies = [r["ms"] for r in segment["rows"]]
    print(size, "p50 %.2f p99 %.2f" % (median(latencies), pct(latencies, 99)), "new connections",
          segment["new_connections"])
    with open(out + ".client.json", "w") as fh:
        json.dump(sent, fh)


def load(prefix: str) -> list[dict[str, Any]]:
    with open(prefix + ".client.json") as fh:
        client = {r["rid"]: r for r in json.load(fh)}
    entries, checks, seen_ports = {}, {}, set()
    with open(prefix + ".als") as fh:
        for line in fh:
            f = line.split()
            port = f[-1]
            if f[0] != "-":
                entries[f[0]] = ([int(x) for x in f[1:-1]], port not in seen_ports)
            seen_ports.add(port)
    with open(prefix + ".chk") as fh:
        for line in fh:
            f = line.split()
            checks[f[0]] = (int(f[1]), int(f[2]))
    rows = []
    for rid, c in client.items():
        if rid not in entries or rid not in checks:
            continue
        (start, rx, first_up, last_up_tx, first_up_rx, last_up_rx, _first_down, last_down), new = entries[rid]
        check_start, check_us = checks[rid]
        total, pre = c["ms"] * 1000, start - c["wall"] * 1e6
        rows.append({"total": total, "cli_pre": pre, "body": rx, "to_cp": check_start - (start + rx), "check": check_us,
                     "back": (start + first_up) - (check_start + check_us), "upstream": first_up_rx - last_up_tx,
                     "down": last_down - last_up_rx, "cli_post": total - pre - last_down, "new_connection": new})
    return rows


def show(prefixes: list[str]) -> None:
    def q(xs: list[float], p: float) -> float:
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]

    for prefix in prefixes:
        rows = load(prefix)
        tail = sorted(rows, key=lambda r: r["total"])[-max(1, len(rows) // 50):]
        print(f"{prefix}: {len(rows)} requests; us: p50 p90 p99 | mean of the slowest 2% | held 1.5 ms+ there")
        for hop in ("total", *TYPICAL_US):
            xs = [r[hop] for r in rows]
            held = (100 * sum(x - TYPICAL_US[hop] > 1500 for x in xs) / len(xs)) if hop in TYPICAL_US else float("nan")
            print("  %-9s %7.0f %7.0f %7.0f | %7.0f | %5.2f%%" % (hop, q(xs, 50), q(xs, 90), q(xs, 99),
                                                              sum(r[hop] for r in tail) / len(tail), held))
        print("  new engine connections: %d of %d requests, %d of the slowest %d" % (
            sum(r["new_connection"] for r in rows), len(rows), sum(r["new_connection"] for r in tail), len(tail)))


if __name__ == "__main__":
    if sys.argv[1:2] == ["run"]:
        run(sys.argv[2], float(sys.argv[3]), sys.argv[4])
    else:
        show(sys.argv[2:])
