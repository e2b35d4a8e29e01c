"""``sluice bench scale`` (and ``python -m bench.scale``) takes its sizes and window on the command line; a bad
value is refused before anything starts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bench.common import cpu_seconds
from bench.common import cpu_times, stolen_share
from bench.common import rotated_rounds
from bench.scale import parse_sizes, summarize
from rig.waits import wait_for


def test_sizes_are_counts_or_counts_polled_at_an_interval() -> None:
    assert parse_sizes("2,200, 1000,1000p1") == ("2", "200", "1000", "1000p1")
    assert parse_sizes("2,1000p0.5") == ("2", "1000p0.5")
    for bad in ("", "two", "0", "1000p", "1000p0", "2;200"):
        with pytest.raises(ValueError, match="sizes: expected engine counts"):
            parse_sizes(bad)


@pytest.mark.parametrize("argv", [["--sizes", "many"], ["--seconds", "0"], ["--rounds", "0"]])
def test_a_bad_argument_is_a_usage_error_and_nothing_runs(argv: list[str]) -> None:
    for command in ([sys.executable, "-m", "sluice", "bench", "scale"], [sys.executable, "-m", "bench.scale"]):
        done = subprocess.run([*command, *argv], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, done.stderr
        assert any(why in done.stderr for why in ("sizes: expected engine counts", "--seconds: must be positive",
                                                  "--rounds: must be at least 1")), done.stderr


def test_help_describes_the_options_instead_of_running() -> None:
    done = subprocess.run([sys.executable, "-m", "bench.scale", "--help"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and "--sizes" in done.stdout and "--seconds" in done.stdout


def test_rounds_interleave_the_sizes_in_an_order_rotated_each_round() -> None:
    assert rotated_rounds(("2", "200", "1000"), 4) == [["2", "200", "1000"], ["200", "1000", "2"],
                                                       ["1000", "2", "200"], ["2", "200", "1000"]]


def test_a_size_pools_its_rounds_latencies_and_sums_its_counts() -> None:
    def segment(latencies: list[float], decisions: float, inf_count: float, scrape_ms: float) -> dict[str, object]:
        rows = [{"status": 200, "engine": "e0", "farm": "e0", "ms": ms, "at": i / 100} for i, ms in enumerate(latencies)]
        return {"engines": 2, "label": "2", "rows": rows, "checks": {0.001: inf_count, float("inf"): inf_count},
                "decisions": decisions, "cpu_s": 1.0, "wall_s": 4.0, "ready_s": 3.0, "load": 0.5,
                "scrape_ms": scrape_ms, "new_connections": 3, "stolen": scrape_ms / 1000}

    quick, slow = segment([1.0] * 100, 100, 100, 20.0), segment([1.0] * 97 + [50.0, 60.0, 70.0], 100, 100, 40.0)
    result = summarize([quick, slow])
    assert result["sent"] == 200 and result["decisions"] == 200 and result["matched"] == 200
    assert result["round_p99"] == [1.0, 60.0]
    assert result["p99"] == 50.0  # the slow round's three outliers are 1.5% of the pooled requests
    assert result["cp_cpu"] == 0.25 and result["check_p99"] <= 1.0
    assert result["scrape_ms"] == 30.0  # the median segment's scrape
    assert result["new_connections"] == 6
    assert result["stolen"] == [0.02, 0.04]  # each window's, in round order


def test_the_hypervisor_s_share_is_the_steal_column_over_all_cpu_time() -> None:
    before = cpu_times("cpu  1000 0 500 8000 10 0 5 100 0 0")
    after = cpu_times("cpu  1300 0 600 8500 10 0 5 200 0 0")  # 1000 ticks in all, 100 of them stolen
    assert stolen_share(before, after) == 0.1
    assert stolen_share(before, before) == 0.0
    assert stolen_share((1, 2, 3, 4), (2, 3, 4, 5)) == 0.0  # a kernel without the steal column
    assert len(cpu_times()) >= 8  # this machine's own /proc/stat


def test_the_control_plane_s_cpu_includes_a_running_child() -> None:
    """The probe worker is a running child of the control plane: its CPU counts (it is the probing at 1000 engines)."""
    child = subprocess.Popen([sys.executable, "-c", "import time\nend = time.process_time() + 0.6\n"
                              "while time.process_time() < end: pass\ntime.sleep(30)"])
    try:
        before = cpu_seconds(os.getpid(), children=True)
        # The child spins 0.6 s of CPU, then sleeps: alive, not reaped.
        wait_for(lambda: cpu_seconds(os.getpid(), children=True) - before >= 0.4, timeout=20,
                 what="the child's CPU counted")
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()
