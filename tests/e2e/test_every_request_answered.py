"""Every request answered under overload, through the real Envoy: 2000 clients connect, then all send at once, to two
engines of 2 slots; five rounds in a row, every one of the 2000 gets an HTTP answer, a 200 or an error in the OpenAI
shape (a 503 with a Retry-After). Nothing is dropped: a connection closed after the request with nothing written is
what Envoy's delayed close did when its timer ran out before a busy worker had flushed the response
(``envoy.delayed_close_timeout_seconds``, now 0: close once the response is flushed)."""

from __future__ import annotations

import asyncio
import collections
import json
import subprocess
import sys
from pathlib import Path

from rig.waits import wait_until
from tests.harness import start_stack

CLIENTS = 2000
ROUNDS = 5
BODY = json.dumps({"model": "cortex", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20}).encode()
REQUEST = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: sluice\r\ncontent-type: application/json\r\n"
           b"content-length: " + str(len(BODY)).encode() + b"\r\nconnection: close\r\n\r\n" + BODY)


def verdict(raw: bytes) -> str:
    """``200``, ``<status> <error code>`` for an answer in the OpenAI shape, or what was wrong with it."""
    if not raw:
        return "no answer"
    head, _, payload = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = lines[0].split(" ")[1]
    if status == "200":
        return "200"
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    try:
        error = json.loads(payload)["error"]
        shaped = isinstance(error["message"], str) and isinstance(error["type"], str)
    except (ValueError, KeyError, TypeError):
        return f"{status} not in the OpenAI shape"
    if status == "503" and not headers.get("retry-after", "").isdigit():
        return "503 without retry-after"
    return f"{status} {error.get('code')}" if shaped else f"{status} not in the OpenAI shape"


async def burst(port: int) -> collections.Counter[str]:
    gate = asyncio.Event()
    seen: collections.Counter[str] = collections.Counter()
    connected = 0

    async def client() -> None:
        nonlocal connected
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        connected += 1
        try:
            await gate.wait()
            writer.write(REQUEST)
            await writer.drain()
            seen[verdict(await asyncio.wait_for(reader.read(), timeout=120))] += 1
        except (OSError, asyncio.TimeoutError) as exc:
            seen[f"client error {type(exc).__name__}"] += 1
        finally:
            writer.close()

    clients = [asyncio.create_task(client()) for _ in range(CLIENTS)]
    # Every connection open before anyone sends (a client that ended already failed to connect: gather raises it).
    await wait_until(lambda: connected == CLIENTS or any(c.done() for c in clients), timeout=60, interval=0.05,
                     what="every connection open")
    gate.set()
    await asyncio.gather(*clients)
    return seen


def test_2000_at_once_five_rounds_every_request_answered(tmp_path: Path) -> None:
    """Two processes spin on the machine's two cores meanwhile: a busy host is when a worker falls behind."""
    stack = start_stack([("a", "thor"), ("b", "spark")], tmp_path, speed=10.0)
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        for _ in range(ROUNDS):
            seen = asyncio.run(burst(stack.config.envoy.listen_port))
            wrong = {k: n for k, n in seen.items() if k != "200" and not k.startswith("503 ")}
            assert not wrong and sum(seen.values()) == CLIENTS, seen
            assert seen["200"] >= 4, seen  # the slots were used
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
        stack.close()
