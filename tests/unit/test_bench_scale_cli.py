"""``sluice bench scale`` (and ``python -m sluice.bench.scale``) takes its sizes and window on the command line; a bad
value is refused before anything starts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sluice.bench.scale import parse_sizes


def test_sizes_are_counts_or_counts_polled_at_an_interval() -> None:
    assert parse_sizes("2,200, 1000,1000p1") == ("2", "200", "1000", "1000p1")
    assert parse_sizes("2,1000p0.5") == ("2", "1000p0.5")
    for bad in ("", "two", "0", "1000p", "1000p0", "2;200"):
        with pytest.raises(ValueError, match="sizes: expected engine counts"):
            parse_sizes(bad)


@pytest.mark.parametrize("argv", [["--sizes", "many"], ["--seconds", "0"]])
def test_a_bad_argument_is_a_usage_error_and_nothing_runs(argv: list[str]) -> None:
    for command in ([sys.executable, "-m", "sluice", "bench", "scale"], [sys.executable, "-m", "sluice.bench.scale"]):
        done = subprocess.run([*command, *argv], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, done.stderr
        assert "sizes: expected engine counts" in done.stderr or "--seconds: must be positive" in done.stderr


def test_help_describes_the_options_instead_of_running() -> None:
    done = subprocess.run([sys.executable, "-m", "sluice.bench.scale", "--help"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and "--sizes" in done.stdout and "--seconds" in done.stdout
