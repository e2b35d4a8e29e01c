"""TTFT as clients see it, through the real Envoy: an engine that sends its headers at once (as vLLM does) and its first
token a known time later is timed at the token, not at the first byte, and that time is what the estimate's error, the
TTFT correction, the per-engine TTFT histogram and ``sluice admin engines`` all report.

The engine is the simulator at x10 with a tokenizer of 2 characters a token: a prompt of 6000 characters is 3000 tokens,
which thor prefills in 2 emulated seconds (0.2 s), while sluice, counting 4 characters a token, expects half of that. So
the first estimates are about 2x too low, and the correction must climb to about 2 for them to meet the known time."""

from __future__ import annotations

import http.client
import json
import re
import statistics
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

from rig.waits import wait_for
from tests.harness import Stack, start_stack

SPEED = 10.0
PROMPT_CHARS = 6000


def chat(tag: str, *, stream: bool = True) -> bytes:
    """A prompt that starts with ``tag``: every request's blocks differ from the first one on, so none hits the cache."""
    return json.dumps({"model": "cortex", "messages": [{"role": "user", "content": tag + "x" * (PROMPT_CHARS - len(tag))}],
                       "max_tokens": 3, "stream": stream}).encode()


def timed_stream(stack: Stack, body: bytes) -> tuple[float, float]:
    """One streamed request: seconds from sending it to its response headers, and to its first content delta."""
    where = urlsplit(stack.base_url)
    assert where.hostname is not None
    connection = http.client.HTTPConnection(where.hostname, where.port, timeout=30)
    try:
        started = time.perf_counter()
        connection.request("POST", "/v1/chat/completions", body=body, headers={"content-type": "application/json"})
        response = connection.getresponse()
        headers_at = time.perf_counter() - started
        assert response.status == 200, response.read()
        while line := response.readline():
            if line.startswith(b"data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                first_token_at = time.perf_counter() - started
                response.read()
                return headers_at, first_token_at
        raise AssertionError("the stream ended without a token")
    finally:
        connection.close()


def metric(stack: Stack, pattern: str) -> float:
    assert stack.controlplane is not None
    port = stack.controlplane.plane.http.port
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    found = re.search(pattern, text)
    return float(found[1]) if found else 0.0


def error_bucket(stack: Stack, le: str) -> float:
    return metric(stack, r'sluice_ttft_estimate_error_ratio_bucket\{engine="thor",le="' + re.escape(le) + r'"\} (\S+)')


def served(stack: Stack, n: int) -> None:
    """Wait until the access log has timed ``n`` first tokens on thor."""
    wait_for(lambda: metric(stack, r'sluice_engine_ttft_seconds_count\{engine="thor"\} (\S+)') >= n, timeout=10,
             what=f"{n} first tokens timed")


def test_first_token_is_timed_at_the_token_and_corrects_a_wrong_estimate(tmp_path: Path) -> None:
    engines = [{"name": "thor", "sim": "thor", "sim_args": ["--chars-per-token", "2"]}]
    stack = start_stack(engines, tmp_path, speed=SPEED, admission={"ttft_correction_gain": 0.5})
    try:
        timings = []
        for i in range(12):
            timings.append(timed_stream(stack, chat(f"{i:03d}")))
            served(stack, i + 1)
        known = [entry["ttft_s"] / SPEED for entry in stack.sim_log("thor")]  # the engine's own, in wall seconds
        assert min(known) > 0.18, known
        # Headers first: the first byte says nothing of the first token.
        assert all(headers < 0.5 * first for headers, first in timings), timings

        # The access log's TTFT follows the known time (Envoy and loopback add a few milliseconds).
        count = metric(stack, r'sluice_engine_ttft_seconds_count\{engine="thor"\} (\S+)')
        total = metric(stack, r'sluice_engine_ttft_seconds_sum\{engine="thor"\} (\S+)')
        assert count == 12 and abs(total / count - statistics.mean(known)) < 0.1 * statistics.mean(known) + 0.02
        thor = stack.engines()["thor"]
        assert thor.ttft_samples == 12
        assert abs(thor.ttft_p50_seconds - statistics.median(known)) < 0.1 * statistics.median(known) + 0.02
        assert metric(stack, r"sluice_gateway_seconds_count (\S+)") == 12

        # The first estimates were about 2x low, and the correction climbed to about the known error.
        assert error_bucket(stack, "1.5") < error_bucket(stack, "+Inf"), "the first requests' error was seen"
        assert 1.6 < thor.ttft_correction < 2.6, thor.ttft_correction
        # Once corrected, the estimates meet the known time.
        inside_before = error_bucket(stack, "1.25") - error_bucket(stack, "0.8")
        for i in range(12, 18):
            timed_stream(stack, chat(f"{i:03d}"))
            served(stack, i + 1)
        assert error_bucket(stack, "1.25") - error_bucket(stack, "0.8") - inside_before == 6

        # A non-streaming answer's first token is its whole body: timed, but not an estimate of the first token.
        errors_before = error_bucket(stack, "+Inf")
        request = urllib.request.Request(stack.base_url + "/chat/completions", data=chat("plain", stream=False),
                                         headers={"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 200
        served(stack, 19)
        assert error_bucket(stack, "+Inf") == errors_before
    finally:
        stack.close()


def test_the_end_to_end_error_is_measured_where_the_answer_length_is_known(tmp_path: Path) -> None:
    """Non-streaming answers carry their length (``usage``): each one's time at the engine is compared with the
    admission's estimate for that length, and once the engine's rates are measured the median error is within
    0.8-1.25x. A stream's length is the content deltas the Lua filter counted (no tenant, no usage object): it is
    measured too."""
    stack = start_stack([("thor", "thor")], tmp_path, speed=SPEED)
    try:
        body = json.dumps({"model": "cortex", "messages": [{"role": "user", "content": "a question"}],
                           "max_tokens": 60, "ignore_eos": True}).encode()

        def ask() -> None:
            request = urllib.request.Request(stack.base_url + "/chat/completions", data=body,
                                             headers={"content-type": "application/json"})
            with urllib.request.urlopen(request, timeout=30) as response:
                assert json.load(response)["usage"]["completion_tokens"] == 60

        def measured() -> float:
            return metric(stack, r'sluice_end_to_end_estimate_error_ratio_count\{engine="thor"\} (\S+)')

        for _ in range(4):  # the engine's rates measured from its first answers
            ask()
        wait_for(lambda: measured() >= 4, timeout=10, what="the warm-up's end-to-end errors")
        wait_for(lambda: stack.engines()["thor"].HasField("rates"), timeout=10, what="thor's measured rates")
        for _ in range(9):
            ask()
        wait_for(lambda: measured() >= 13, timeout=10, what="thirteen end-to-end errors")
        assert 0.8 <= stack.engines()["thor"].end_to_end_estimate_error_median <= 1.25, stack.engines()["thor"]
        timed_stream(stack, chat("streamed"))
        served(stack, 14)
        wait_for(lambda: measured() >= 14, timeout=10, what="the stream's end-to-end error")
    finally:
        stack.close()
