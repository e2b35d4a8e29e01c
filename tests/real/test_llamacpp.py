"""A real mainline llama.cpp ``llama-server`` (two of them, 2 slots each, one thread each) behind sluice's real control plane
and the real Envoy: the request path through the official openai client, discovery and observation of the real
``/props``, ``/slots`` and ``/metrics``, caps from ``total_slots``, a client leaving mid-stream, a context overflow, the
engine killed mid-stream, version floors against the real ``build_info``, and a broken observation mapping caught.

The model is random weights (rig/llama.py): answers are gibberish, so tests assert shapes and counts, not text.
``ignore_eos`` (a llama.cpp sampling option) makes a request generate exactly ``max_tokens``."""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import dataclasses
import json
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from controlplane.core.engines import EngineView, Flavor, ServedModel
from controlplane.core.policy import Policy
from controlplane.core.request import parse_request
from controlplane.metrics import SluiceMetrics
from controlplane.observe import parse
from controlplane.observe.tokenizer import PromptTokenizer
from sluice.admin.v1 import admin_pb2
from rig.llama import BUILD_INFO, MODEL_ID
from rig.waits import free_port, wait_for
from tests.harness import Stack
from tests.real.llamastack import CTX, PARALLEL, Engine, post, start_real_stack

NAMES = {"llama-a", "llama-b"}


def client_for(stack: Stack, timeout: float = 60) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=timeout)


def controlplane_metrics(stack: Stack) -> str:
    assert stack.controlplane is not None
    port = stack.controlplane.plane.http.port
    text: str = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return text


def idle(stack: Stack, engines: list[Engine]) -> None:
    """No sluice ticket open and no slot busy on any engine (each test starts from a quiet fleet)."""
    wait_for(lambda: stack.status().open_tickets == 0, timeout=30, what="every ticket released")
    wait_for(lambda: not any(s["is_processing"] for e in engines for s in e.slots()), timeout=30, what="every slot idle")


def observation_problems(stack: Stack, engines: list[Engine]) -> list[str]:
    """What sluice's view of each real engine gets wrong, against the engine's own ``/props`` and ``/slots`` (empty: right).
    The same check runs in test_discovery_and_observation and, under a broken mapping, must find something."""
    problems = []
    seen = stack.engines()
    for real in engines:
        props, slots = real.props(), real.slots()
        per_slot = props["default_generation_settings"]["n_ctx"]
        e = seen[real.name]
        want = {"flavor": "llamacpp", "version": props["build_info"], "models": [MODEL_ID],
                "discovered_concurrency": props["total_slots"], "kv_capacity_tokens": per_slot * props["total_slots"],
                "missing_gauges": [], "ready": True, "stale": False}
        got = {"flavor": e.flavor, "version": e.version, "models": list(e.models),
               "discovered_concurrency": e.discovered_concurrency, "kv_capacity_tokens": e.kv_capacity_tokens,
               "missing_gauges": list(e.missing_gauges), "ready": e.ready, "stale": e.stale}
        problems += [f"{real.name}.{k}: sluice has {got[k]!r}, the engine says {want[k]!r}" for k in want if got[k] != want[k]]
        if len(slots) != props["total_slots"] or any(s["n_ctx"] != per_slot for s in slots):
            problems.append(f"{real.name}: /slots disagrees with /props")
        for gauge in ("running", "waiting", "kv_usage"):
            if getattr(e, gauge) < 0:
                problems.append(f"{real.name}.{gauge}: unknown (-1)")
    if 'sluice_observer_degraded{engine="llama-a"} 0.0' not in controlplane_metrics(stack):
        problems.append("llama-a: sluice_observer_degraded is not 0")
    return problems


# -- the request path, through the official openai client ------------------------------------------------------------


def test_chat_completion_non_streaming(stack: Stack) -> None:
    raw = client_for(stack).chat.completions.with_raw_response.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "hello"}], max_tokens=8, extra_body={"ignore_eos": True})
    completion = raw.parse()
    assert raw.headers["x-sluice-engine"] in NAMES
    assert raw.headers["x-sluice-route-reason"]
    assert completion.model == MODEL_ID
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 8 and completion.usage.prompt_tokens > 0


def test_chat_completion_streaming_with_usage(stack: Stack) -> None:
    with client_for(stack).chat.completions.with_streaming_response.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "hello"}], max_tokens=12, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    ) as response:
        assert response.headers["x-sluice-engine"] in NAMES
        assert response.headers["content-type"].startswith("text/event-stream")
        chunks = list(response.parse())
    deltas = [c for c in chunks if c.choices]
    assert len(deltas) >= 12  # a content delta per token, and the final one with finish_reason
    assert deltas[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


def test_completions(stack: Stack) -> None:
    client = client_for(stack)
    raw = client.completions.with_raw_response.create(model=MODEL_ID, prompt="Once upon a time", max_tokens=4,
                                                      extra_body={"ignore_eos": True})
    assert raw.headers["x-sluice-engine"] in NAMES
    completion = raw.parse()
    assert completion.usage is not None and completion.usage.completion_tokens == 4
    with client.completions.with_streaming_response.create(
        model=MODEL_ID, prompt="Once", max_tokens=3, stream=True, extra_body={"ignore_eos": True}
    ) as streamed:
        assert streamed.headers["x-sluice-engine"] in NAMES
        pieces = [c for c in streamed.parse() if c.choices]
    assert pieces[-1].choices[0].finish_reason == "length"


def test_model_list_through_envoy(stack: Stack) -> None:
    assert [m.id for m in client_for(stack).models.list().data] == [MODEL_ID]


def test_unknown_model_is_404_before_the_engine(stack: Stack, engines: list[Engine]) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client_for(stack).chat.completions.create(model="gpt-nothing", messages=[{"role": "user", "content": "x"}])
    assert caught.value.response.json()["error"]["code"] == "model_not_found"


# -- discovery and observation ---------------------------------------------------------------------------------------


def test_discovery_and_observation(stack: Stack, engines: list[Engine]) -> None:
    """/props (total_slots, per-slot n_ctx, build_info), /slots and /v1/models of the real engine, as sluice sees them."""
    props = engines[0].props()
    assert props["build_info"] == BUILD_INFO
    assert props["total_slots"] == PARALLEL
    # Mainline splits -c over the slots: each slot has CTX / PARALLEL tokens, which is one request's limit.
    assert props["default_generation_settings"]["n_ctx"] == CTX // PARALLEL
    listing = json.load(urllib.request.urlopen(engines[0].url + "/v1/models", timeout=5))
    assert [m["id"] for m in listing["data"]] == [MODEL_ID]
    try:
        wait_for(lambda: observation_problems(stack, engines) == [] or None, timeout=15, what="sluice's view to match")
    except TimeoutError:
        pytest.fail("sluice's view of the real engines is wrong:\n" + "\n".join(observation_problems(stack, engines)))


def test_admin_cli_shows_the_real_engines(stack: Stack, engines: list[Engine]) -> None:
    """After some traffic, ``sluice admin engines`` shows flavour, version, capacity, cap and measured rates."""
    client = client_for(stack)
    for _ in range(4):
        client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "rate me"}], max_tokens=48,
                                       extra_body={"ignore_eos": True})
    target = stack.admin_target

    def engines_json() -> dict[str, Any]:
        out = subprocess.run([sys.executable, "-m", "sluice", "admin", "engines", "--json", "--target", target],
                             capture_output=True, text=True, timeout=30, check=True)
        return {e["name"]: e for e in json.loads(out.stdout)["engines"]}

    def measured() -> dict[str, Any] | None:
        got = engines_json()
        rates = [got[n].get("rates", {}).get("generationTokensPerS", -1) for n in NAMES]
        return got if any(r > 0 for r in rates) else None

    shown = wait_for(measured, timeout=20, what="a generation rate measured")
    per_slot = engines[0].props()["default_generation_settings"]["n_ctx"]
    for name in NAMES:
        e = shown[name]
        assert (e["flavor"], e["version"], e["models"]) == ("llamacpp", BUILD_INFO, [MODEL_ID])
        assert int(e["kvCapacityTokens"]) == per_slot * PARALLEL and e["discoveredConcurrency"] == PARALLEL
        # --json prints every field, zeros and empty lists too: a key that is missing fails here, never reads as 0
        assert e["missingGauges"] == [] and e["stale"] is False, e
        assert e["running"] >= 0 and 0 <= e["kvUsage"] <= 1, e  # -1 is unknown
    table = subprocess.run([sys.executable, "-m", "sluice", "admin", "engines", "--target", target],
                           capture_output=True, text=True, timeout=30, check=True).stdout.splitlines()
    assert table[0].split()[:3] == ["ENGINE", "FLAVOR", "VERSION"]
    assert any(line.startswith("llama-a") and "llamacpp" in line and BUILD_INFO in line for line in table)


def test_kv_usage_follows_the_slots(stack: Stack, engines: list[Engine]) -> None:
    """Mainline has no KV gauge: sluice's KV usage comes from /slots, and rises while a long request holds a slot."""
    idle(stack, engines)
    client = client_for(stack, timeout=120)
    done = threading.Event()

    def long_one() -> None:
        try:
            client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "word " * 300}],
                                           max_tokens=400, extra_body={"ignore_eos": True})
        finally:
            done.set()

    worker = threading.Thread(target=long_one)
    worker.start()
    try:
        busy = wait_for(lambda: next((e.name for e in engines if any(s["is_processing"] for s in e.slots())), None),
                        timeout=20, what="a busy slot")
        total = CTX  # both slots' context
        seen = wait_for(lambda: stack.engines()[busy].kv_usage > 300 / total * 0.9 or None, timeout=20,
                        what="sluice's KV usage to count the held prompt")
        assert seen
        assert stack.engines()[busy].running == 1
    finally:
        worker.join(120)
    assert done.is_set()


# -- caps from total_slots -------------------------------------------------------------------------------------------


def test_burst_parks_beyond_the_slots_and_serves_all(stack: Stack, engines: list[Engine]) -> None:
    """12 requests at once on 2 engines x 2 slots: at most 4 run, the rest park in sluice and are all served; no engine
    ever holds more busy slots than it has, nor defers a request (it never received one it could not start)."""
    idle(stack, engines)
    burst, slots_total = 12, PARALLEL * len(engines)
    peak = {e.name: 0 for e in engines}
    deferred = {e.name: 0.0 for e in engines}
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.is_set():
            for e in engines:
                peak[e.name] = max(peak[e.name], sum(1 for s in e.slots() if s["is_processing"]))
                deferred[e.name] = max(deferred[e.name], e.metrics()["llamacpp:requests_deferred"])
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "go"}], "max_tokens": 160, "ignore_eos": True}
    admitted_before = stack.status().tickets_admitted_total
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=burst) as pool:
            results = list(pool.map(lambda _: post(stack.base_url, "/chat/completions", body, timeout=180), range(burst)))
    finally:
        sampling.set()
        sampler.join(5)
    assert [status for status, _, _ in results] == [200] * burst
    assert all(json.loads(payload)["usage"]["completion_tokens"] == 160 for _, _, payload in results)
    parked = [h for _, h, _ in results if "x-sluice-parked-ms" in h]
    assert len(parked) >= burst - slots_total, f"only {len(parked)} of {burst} parked"
    assert {h["x-sluice-engine"] for _, h, _ in results} == NAMES
    assert max(peak.values()) == PARALLEL, f"busy slots sampled: {peak}"  # the sampler saw the engines full, never over
    assert deferred == {e.name: 0.0 for e in engines}, f"an engine queued requests itself: {deferred}"
    assert stack.status().tickets_admitted_total - admitted_before == burst
    wait_for(lambda: stack.status().open_tickets == 0, timeout=10, what="tickets released")
    assert stack.status().tickets_expired_total == 0


# -- a client leaving mid-stream -------------------------------------------------------------------------------------


def test_client_disconnect_mid_stream_releases_the_ticket_and_the_slot(stack: Stack, engines: list[Engine]) -> None:
    idle(stack, engines)
    client = client_for(stack, timeout=120)
    predicted_before = {e.name: e.metrics()["llamacpp:tokens_predicted_total"] for e in engines}
    with client.chat.completions.with_streaming_response.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "a long story"}], max_tokens=1900, stream=True,
        extra_body={"ignore_eos": True},
    ) as response:
        engine = next(e for e in engines if e.name == response.headers["x-sluice-engine"])
        tokens = iter(response.parse())
        for _ in range(5):
            next(tokens)
        assert stack.status().open_tickets == 1
        assert any(s["is_processing"] for s in engine.slots())
    # Leaving the block closed the connection after 5 of 1,900 tokens.
    wait_for(lambda: stack.status().open_tickets == 0, timeout=10, what="the ticket released")
    wait_for(lambda: not any(s["is_processing"] for s in engine.slots()), timeout=10, what="the engine's slot freed")
    assert stack.status().tickets_expired_total == 0
    # The slot freed because the engine cancelled the request, not because it finished it: it counted far fewer than
    # the 1,900 tokens a finished request adds to its predicted-token counter (once it counted the request at all).
    def generated() -> float:
        return engine.metrics()["llamacpp:tokens_predicted_total"] - predicted_before[engine.name]

    wait_for(lambda: generated() >= 5, timeout=10, what="the cancelled request's tokens counted")
    assert generated() < 1000, f"the engine generated {generated():.0f} tokens after the client left"


# -- context length ----------------------------------------------------------------------------------------------------


def test_context_overflow_is_a_400_before_the_engine(stack: Stack, engines: list[Engine]) -> None:
    idle(stack, engines)
    per_slot = engines[0].props()["default_generation_settings"]["n_ctx"]
    before = [e.metrics() for e in engines]
    cases = [
        # max_tokens alone beyond one slot's context
        {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": per_slot + 1},
        # a prompt beyond it (a token per "word " for this tokenizer; sluice estimates 4 characters a token)
        {"model": MODEL_ID, "messages": [{"role": "user", "content": "word " * (per_slot + 100)}], "max_tokens": 1},
    ]
    for body in cases:
        status, headers, payload = post(stack.base_url, "/chat/completions", body)
        assert status == 400, payload
        assert json.loads(payload)["error"]["code"] == "context_length_exceeded"
        assert "x-sluice-engine" not in headers
    after = [e.metrics() for e in engines]
    for b, a in zip(before, after):
        for counter in ("llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total", "llamacpp:n_decode_total"):
            assert a[counter] == b[counter], f"{counter} moved: the request reached an engine"
    # The same overflowing prompt sent to the engine directly is refused by the engine itself, later and differently.
    status, _, payload = post(engines[0].url, "/v1/chat/completions", cases[1])
    assert status == 400 and json.loads(payload)["error"]["type"] == "exceed_context_size_error"


# -- version floors against the real build_info --------------------------------------------------------------------


def _reload(stack: Stack, raw: dict[str, Any], path: Path) -> None:
    path.write_text(yaml.safe_dump(raw))
    done = subprocess.run([sys.executable, "-m", "sluice", "admin", "reload", str(path), *stack.admin_args()],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


def test_version_floors_against_the_real_build_info(stack: Stack) -> None:
    build = int(BUILD_INFO.split("-")[0][1:])
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    try:
        for floor, admitted in ((f"b{build}", True), (f"b{build - 500}", True), (f"b{build + 1}", False)):
            raw = copy.deepcopy(stack.raw)
            raw["version_floors"] = {"tiny": floor}
            _reload(stack, raw, stack.work_dir / f"{floor}.yaml")  # reloads may only name files under admin.reload_dir
            status, headers, payload = post(stack.base_url, "/chat/completions", body)
            if admitted:
                assert status == 200 and headers["x-sluice-engine"] in NAMES, (floor, payload)
            else:
                error = json.loads(payload)["error"]
                assert (status, error["code"]) == (503, "version_floor"), (floor, payload)
                assert "llama-a" in error["message"] and int(headers["retry-after"]) >= 1
    finally:
        _reload(stack, stack.raw, stack.work_dir / "original.yaml")
    assert post(stack.base_url, "/chat/completions", body)[0] == 200


# -- the engine killed mid-stream --------------------------------------------------------------------------------------


def test_engine_killed_mid_stream(tmp_path: Path) -> None:
    """A lone engine SIGKILLed while it streams: the client's stream ends with an error (never hangs), the ticket comes
    back, the engine goes stale, a new request is a clear 503 with Retry-After, and a restarted engine serves again."""
    lone = Engine("lone", free_port(), tmp_path / "lone.log")
    lone.start()
    stack = start_real_stack([lone], tmp_path)
    try:
        client = client_for(stack, timeout=30)
        with pytest.raises(Exception) as caught:  # httpx's RemoteProtocolError: the body ended mid-chunk
            with client.chat.completions.with_streaming_response.create(
                model=MODEL_ID, messages=[{"role": "user", "content": "story"}], max_tokens=1900, stream=True,
                extra_body={"ignore_eos": True},
            ) as response:
                assert response.headers["x-sluice-engine"] == "lone"
                got = 0
                for chunk in response.parse():
                    got += 1
                    if got == 5:
                        assert lone.process is not None
                        lone.process.kill()
                        lone.process.wait()
                    assert got < 1900, "the stream went on after the engine died"
        assert not isinstance(caught.value, AssertionError), caught.value
        wait_for(lambda: stack.status().open_tickets == 0, timeout=10, what="the ticket released")
        assert stack.status().tickets_expired_total == 0
        status, headers, payload = post(stack.base_url, "/chat/completions",
                                        {"model": MODEL_ID, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
        assert status == 503, payload
        assert json.loads(payload)["error"]["code"] in ("upstream_unavailable", "no_ready_engine")
        assert int(headers["retry-after"]) >= 1
        wait_for(lambda: stack.engines()["lone"].stale, timeout=10, what="the dead engine stale")
        wait_for(lambda: stack.status().open_tickets == 0, timeout=10, what="every ticket released")
        lone.start()  # same port: the operator restarts it
        wait_for(lambda: not stack.engines()["lone"].stale, timeout=20, what="the engine fresh again")
        status, headers, _ = post(stack.base_url, "/chat/completions",
                                  {"model": MODEL_ID, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
        assert status == 200 and headers["x-sluice-engine"] == "lone"
    finally:
        stack.close()
        lone.stop()


# -- a broken observation mapping is caught ----------------------------------------------------------------------------


def test_a_broken_llamacpp_mapping_fails_the_observation_check(
    stack: Stack, engines: list[Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rename the llama.cpp busy-slots gauge in sluice's mapping (as an engine rename would look): the same observation
    check test_discovery_and_observation passes must now report the engines degraded with the gauge missing and unknown."""
    spec = parse.SPECS[Flavor.LLAMACPP]
    renamed = "llamacpp:requests_processing_renamed"
    monkeypatch.setitem(parse.SPECS, Flavor.LLAMACPP, dataclasses.replace(
        spec, running=(renamed,), required=(renamed, *spec.required[1:])))

    def broken() -> list[str] | None:
        problems = observation_problems(stack, engines)
        complete = all(any(p.startswith(f"{e.name}.missing_gauges") for p in problems) for e in engines)
        return problems if complete and any("sluice_observer_degraded is not 0" in p for p in problems) else None

    problems = wait_for(broken, timeout=15, what="the broken mapping noticed")
    assert any(renamed in p for p in problems) and any("running: unknown" in p for p in problems), problems
    monkeypatch.undo()
    wait_for(lambda: observation_problems(stack, engines) == [] or None, timeout=15, what="the mapping restored")


def test_admin_drain_keeps_requests_off_a_real_engine(stack: Stack) -> None:
    """Drain one real engine: everything goes to the other; undrain: both serve again."""
    admin = stack.admin()
    admin.DrainEngine(admin_pb2.DrainEngineRequest(name="llama-a", drained=True), timeout=5)
    try:
        body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
        served = {post(stack.base_url, "/chat/completions", body)[1]["x-sluice-engine"] for _ in range(4)}
        assert served == {"llama-b"}
    finally:
        admin.DrainEngine(admin_pb2.DrainEngineRequest(name="llama-a", drained=False), timeout=5)


def test_first_token_through_sluice_next_to_the_clients(stack: Stack, engines: list[Engine]) -> None:
    """llama-server streams its headers before its first token: sluice times the token itself. Over a few streamed
    requests one at a time, each engine's TTFT as sluice reports it (``sluice admin engines``, the access log's first
    token) lies between llama.cpp's own prompt time (its ``timings.prompt_ms``) and the client's TTFT, which adds the
    gateway's part; the three are printed side by side."""
    idle(stack, engines)
    client_ttfts: dict[str, list[float]] = {}
    prompt_ms: dict[str, list[float]] = {}
    for i in range(8):
        body = {"model": MODEL_ID, "messages": [{"role": "user", "content": f"{i} tell me about rivers " * 20}],
                "max_tokens": 4, "stream": True}
        request = urllib.request.Request(stack.base_url + "/chat/completions", data=json.dumps(body).encode(),
                                         headers={"content-type": "application/json"})
        started = time.perf_counter()
        first: float | None = None
        with urllib.request.urlopen(request, timeout=60) as response:
            engine = response.headers["x-sluice-engine"]
            for line in response:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                if first is None and chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                    first = time.perf_counter() - started
                if "timings" in chunk:
                    prompt_ms.setdefault(engine, []).append(float(chunk["timings"]["prompt_ms"]))
        assert first is not None
        client_ttfts.setdefault(engine, []).append(first)
        idle(stack, engines)
    wait_for(lambda: sum(e.ttft_samples for e in stack.engines().values()) >= 8, timeout=10,
             what="every first token timed by the access log")
    seen = stack.engines()
    for engine, ttfts in client_ttfts.items():
        reported = seen[engine].ttft_p50_seconds
        own = sorted(prompt_ms.get(engine, [0.0]))[len(prompt_ms.get(engine, [0.0])) // 2] / 1000
        client = sorted(ttfts)[len(ttfts) // 2]
        print(f"{engine}: llama.cpp prompt {own * 1000:.1f} ms, sluice first token {reported * 1000:.1f} ms, "
              f"client first token {client * 1000:.1f} ms ({len(ttfts)} requests)")
        assert seen[engine].ttft_samples >= len(ttfts)
        assert 0.8 * own <= reported <= client + 0.005, (own, reported, client)


def test_prompt_tokens_against_llamacpps_own_counts(stack: Stack, engines: list[Engine]) -> None:
    """Non-streaming answers carry llama.cpp's ``usage.prompt_tokens``: sluice compares each with its Check's estimate
    and learns from it. The error before any learning (the prior, 4 characters a token) and the samples counted are
    printed; every counted sample is one the engine reported."""
    idle(stack, engines)
    before = {name: e.prompt_token_samples for name, e in stack.engines().items()}
    counts = []
    for i in range(6):
        body = {"model": MODEL_ID, "max_tokens": 2,
                "messages": [{"role": "system", "content": "You answer briefly."},
                             {"role": "user", "content": f"{i}: " + "describe a river delta " * (5 + 10 * i)}]}
        status, _, payload = post(stack.base_url, "/chat/completions", body)
        assert status == 200
        counts.append(json.loads(payload)["usage"]["prompt_tokens"])
    wait_for(lambda: sum(e.prompt_token_samples - before[n] for n, e in stack.engines().items()) >= 6, timeout=10,
             what="every prompt count received")
    for name, e in stack.engines().items():
        print(f"{name}: {e.prompt_token_samples} prompt counts, median count / estimate "
              f"{e.prompt_tokens_error_median:.2f}, {e.prompt_chars_per_token:.2f} characters a token, "
              f"{e.prompt_template_tokens_per_message:.1f} template tokens a message (llama.cpp counted {counts})")
    counted = [e for n, e in stack.engines().items() if e.prompt_token_samples > before[n]]
    assert counted and all(e.prompt_tokens_error_median > 0 for e in counted)


def test_a_long_prompt_counted_by_llamacpps_own_tokenizer(engines: list[Engine]) -> None:
    """``admission.tokenize_above_chars``'s count (observe/tokenizer.py: ``/apply-template``, then ``/tokenize``) is
    llama.cpp's own: the same chat sent to the engine reports the same ``usage.prompt_tokens``. The Check's prior
    estimate is printed beside it."""
    real = engines[0]
    view = EngineView(real.name, real.url, None, models=(ServedModel(MODEL_ID),), stale=False, flavor=Flavor.LLAMACPP)

    class Fleet:
        engines = (view,)

    class Observation:
        def fleet(self, now: float) -> Fleet:
            return Fleet()

    class Core:
        policy = Policy(tokenize_above_chars=100, tokenize_timeout_ms=5000)
        samples: list[int] = []

        def observe_prompt_tokens(self, model: str, engine: str, shape: Any, counted: int, estimated: int) -> None:
            self.samples.append(counted)

    body = {"model": MODEL_ID, "max_tokens": 1,
            "messages": [{"role": "system", "content": "You answer briefly."},
                         {"role": "user", "content": "Name the rivers of a delta, " * 40}]}
    raw = json.dumps(body).encode()
    request = parse_request("POST", "/v1/chat/completions", raw)
    core = Core()
    tokenizer = PromptTokenizer(core, Observation(), SluiceMetrics(), lambda: 0.0)  # type: ignore[arg-type]

    async def count() -> int:
        try:
            return (await tokenizer.counted(request, raw)).prompt_tokens
        finally:
            await tokenizer.stop()

    counted = asyncio.run(count())
    status, _, payload = post(real.url + "/v1", "/chat/completions", body)
    assert status == 200
    engine_count = json.loads(payload)["usage"]["prompt_tokens"]
    print(f"llama.cpp counts {engine_count} prompt tokens; /tokenize {counted}; the prior {request.prompt_tokens}")
    assert counted == engine_count and core.samples == [engine_count]
