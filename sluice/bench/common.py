"""What every benchmark shares: where results go, the machine they ran on, and a markdown report."""

from __future__ import annotations

import os
import platform
import statistics
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def free_port() -> int:
    """A port free right now (the only definition; tests and benches import it). It can be taken before the caller binds
    it: prefer binding port 0 and asking the server what it bound; this is for processes that cannot report back."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, {platform.system()}"


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
    path.write_text(f"# {title}\n\n- command: `{command}`\n- when: {stamp}\n- machine: {machine()}\n\n{body}\n")
    return path
