"""sluice's configuration: one YAML file, validated all-or-nothing.

Two layers, like the endpoint picker's: the raw YAML (every field optional) is merged over defaults, then every field is
checked and every problem is reported at once with its dotted path (``engines[1].url: ...``). The result is frozen.

A config names the ports of every process, Envoy's limits, the observation cadence, the ticket lease and the engines. An engine
with ``sim: <profile>`` is a simulator that ``sluice up`` starts itself; any other engine is already running elsewhere.

What this module does not do, on purpose:

- **No I/O in validation.** ``parse_config`` is pure. An engine URL's hostname is resolved afterwards, by
  ``await resolve_engines(config)`` (``loop.getaddrinfo``, every engine at once), which whoever loads a config runs: the
  control plane at start-up and on every reload (``await load_resolved_config(path)`` does both steps, the file read in a
  thread), ``sluice up`` and ``sluice envoy`` before they render anything. A name that does not resolve is still a config
  problem with its dotted path, and refuses the config (or the reload).
- **No simulator profiles.** ``sim:`` is only checked to be a name here; which profiles exist, and what a simulated engine
  defaults to, belong to the layer that starts simulators (``sluice/simulated.py``: ``sluice up`` and the tests' harness).
  That layer writes the profile's ``max_num_seqs`` into the config it hands the control plane for a vLLM-flavoured simulator
  that names none (vLLM reports no cap; the SGLang and llama.cpp simulators report theirs like the real engines do), so the
  control plane never depends on the test double.
- **Port 0** is accepted for ``controlplane.grpc_port``, ``controlplane.metrics_port``, ``envoy.listen_port`` and
  ``envoy.admin_port``: any free port, for a process that reports what it bound (the tests bind every server that way).
  ``sluice up`` and ``sluice envoy`` need fixed ports (they refuse 0 where another process must find the port).

Each default is written once: the admission defaults are ``Policy``'s own field defaults (``DEFAULTS["admission"]`` is
derived from them), and ``RELOADABLE`` alone names what a reload may change (``changed_sections``, ``Config.restart_needed``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import ipaddress
import re
import socket
from collections.abc import Iterator
from dataclasses import MISSING, dataclass, fields, replace
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import yaml

from controlplane.core.adapters import AdapterPolicy
from controlplane.core.engines import Flavor
from controlplane.core.model import Priority
from controlplane.core.policy import Box, ModelPolicy, Policy, version_key
from controlplane.core.fairshare import FairMode, FairShare
from controlplane.core.reserve import oversubscribed
from controlplane.core.tenants import PRIORITY_RANK, Tenant, Tenants
from ratelimit.config import parse_limits
from controlplane.names import CLIENT_HEADERS, ENGINE_HEADER, TICKET_HEADER

BUNDLED_CONFIG = "default.yaml"
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
_RESERVED_PREFIX = "sluice_"


class OnFailure(enum.StrEnum):
    """``envoy.on_controlplane_failure``: what Envoy does when the control plane does not answer a Check."""

    OPEN = "open"
    """Unpinned requests follow each model's last capacity weights."""
    CLOSED = "closed"
    """503 + Retry-After."""


class OnStale(enum.StrEnum):
    """``observe.on_stale``: whether an engine whose probes stopped answering is still admitted to."""

    OPEN = "open"
    """Still admitted, after fresh engines (seed 004's choice)."""
    CLOSED = "closed"


class EngineFlavor(enum.StrEnum):
    """``engines[].flavor``: ``auto`` (detected from ``/metrics``) or one ``Flavor``."""

    AUTO = "auto"
    VLLM = Flavor.VLLM.value
    SGLANG = Flavor.SGLANG.value
    LLAMACPP = Flavor.LLAMACPP.value
    TGI = Flavor.TGI.value

    @property
    def configured(self) -> Flavor | None:
        """The flavour to parse with, or None to detect it."""
        return None if self is EngineFlavor.AUTO else Flavor(self.value)


class SimFlavor(enum.StrEnum):
    """``engines[].sim_flavor``: the metric dialect a simulator speaks (``enginesim.exposition.Dialect``, which a unit test
    keeps equal: the config does not import the simulator)."""

    VLLM_V1 = "vllm-v1"
    VLLM_V0 = "vllm-v0"
    SGLANG = "sglang"
    LLAMACPP = "llamacpp"

    @property
    def vllm(self) -> bool:
        return self in (SimFlavor.VLLM_V1, SimFlavor.VLLM_V0)


_E = TypeVar("_E", bound=enum.StrEnum)


@dataclass(frozen=True, slots=True)
class ServerTls:
    """A gRPC listener's TLS (``controlplane.tls``, ``admin.tls``): its certificate chain and key (PEM files), and for
    mutual TLS the CA whose signature a client's certificate must carry (then a client without one cannot connect). Files
    are read when the server starts, not when the config is validated."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None

    @property
    def mutual(self) -> bool:
        return self.client_ca_file is not None


@dataclass(frozen=True, slots=True)
class ClientTls:
    """``envoy.controlplane_tls``: how Envoy's ``sluice_controlplane`` cluster (ADS, ext_authz, access log) speaks TLS: the
    CA that signed the control plane's certificate, Envoy's own client certificate and key (for mutual TLS), and the name
    the control plane's certificate must carry (SNI and the subject alternative name checked; default the control plane's
    host)."""

    ca_file: str
    cert_file: str | None = None
    key_file: str | None = None
    server_name: str | None = None


class ConfigError(ValueError):
    """Every problem found in a config, one per line, each with its dotted path."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("invalid config:\n  " + "\n  ".join(problems))
        self.problems = problems


@dataclass(frozen=True, slots=True)
class ReplicaAddress:
    """One control-plane replica as Envoy reaches it: gRPC (ADS, ext_authz, access log) and HTTP (the retry redirector)."""

    host: str
    grpc_port: int
    metrics_port: int


@dataclass(frozen=True, slots=True)
class ControlPlaneConfig:
    host: str
    grpc_port: int
    metrics_port: int
    max_check_queue_ms: float
    """A Check whose handler starts more than this long after Envoy sent it (read from the gRPC deadline Envoy sets) is
    shed at once with 503 ``controlplane_overloaded``: an overloaded control plane answers, it never times out."""
    overload_retry_after_seconds: int
    """Retry-After on ``controlplane_overloaded``."""
    max_pending_rpcs: int
    """grpc-core's pending-call limits (soft and hard): calls beyond them are cancelled by gRPC itself, which Envoy would
    treat as an ext_authz error. Sized well above every parking lot together."""
    stop_step_seconds: float = 5.0
    """Shutdown: each step (background tasks, the store, observation, the servers, the limiter, tracing) gets at most
    this long; one that overruns is abandoned with a warning, so a stop never hangs on a dead store."""
    admin_host: str = "127.0.0.1"
    """The admin API's own listener (never the Envoy-facing port). A non-loopback address needs an admin token source."""
    admin_port: int = 18001
    """0: any free port (the control plane reports the one it bound, like ``grpc_port``)."""
    tls: ServerTls | None = None
    """TLS on the Envoy-facing gRPC port (ADS, ext_authz, access log); with ``client_ca_file``, mutual TLS: only a client
    (Envoy) whose certificate that CA signed gets a connection. None: plaintext."""
    replicas: tuple[ReplicaAddress, ...] = ()
    """Every control-plane replica sharing one store (this one included); empty: just this one. Envoy's bootstrap lists
    each replica's gRPC address in the control plane's cluster, and every replica publishes every replica's redirector,
    so all replicas serve identical xDS resources (same content hashes, same versions)."""

    def addresses(self, bound_metrics_port: int | None = None) -> tuple[ReplicaAddress, ...]:
        """The replicas Envoy uses: the configured list, or this control plane alone."""
        return self.replicas or (ReplicaAddress(self.host, self.grpc_port, bound_metrics_port or self.metrics_port),)


@dataclass(frozen=True, slots=True)
class AdminConfig:
    """Who may use the admin API. A token is a line ``name:secret`` (or just ``secret``, named ``default``); a token file
    holds one per line (``#`` comments allowed), the environment variable one. Mutating calls (reload, drain, undrain,
    floors) always need a token; with no token source configured they are all refused."""

    token_file: str | None = None
    token_env: str | None = None
    require_token_for_reads: bool = False
    """Reads (status, engines, explain, policy, watch) need a token too."""
    reload_dir: str | None = None
    """A reload may name the running config file, or a file under this directory; no other path (None: only the
    running file)."""
    tls: ServerTls | None = None
    """TLS on the admin listener (server certificate only: callers authenticate with the bearer token)."""

    @property
    def has_token_source(self) -> bool:
        return bool(self.token_file or self.token_env)


@dataclass(frozen=True, slots=True)
class TracingConfig:
    """``tracing``: OpenTelemetry traces of the Checks, opt-in (``controlplane/tracing.py``). Off, a Check costs nothing
    more. On, every Check is one span (a child of the client's W3C ``traceparent`` when it sends one) exported over OTLP/HTTP
    (JSON) in batches, and an admitted request reaches its engine with a ``traceparent`` naming that span. The field defaults
    are the section's defaults (``DEFAULTS["tracing"]`` is derived from them). Read once at start-up: a change needs a
    restart."""

    enabled: bool = False
    otlp_endpoint: str = "http://127.0.0.1:4318/v1/traces"
    """The collector's OTLP/HTTP traces URL, path included (the OTLP default port and path). Headers a collector wants
    (credentials) come from the standard ``OTEL_EXPORTER_OTLP_TRACES_HEADERS`` variable, so they stay out of the file."""
    service_name: str = "sluice-controlplane"
    """The spans' ``service.name``."""
    sample_ratio: float = 1.0
    """Share of Checks traced (0..1) among those that arrive without a ``traceparent``; a client's own sampled flag is
    followed (parent-based sampling), so a trace the client records is never cut at the gateway."""
    export_timeout_seconds: float = 10.0
    """Longest one batch export may take (retries included); also bounds how long a stopping control plane flushes."""


@dataclass(frozen=True, slots=True)
class EnvoyConfig:
    listen_host: str
    listen_port: int
    """The OpenAI-compatible listener clients call."""
    admin_port: int
    max_request_bytes: int
    """Bodies larger than this get 413 from Envoy before any Check (bytes)."""
    access_log_flush_seconds: float
    """How often Envoy flushes buffered access-log entries to the control plane."""
    access_log_buffer_bytes: int
    """Envoy sends its buffered access-log entries as soon as they reach this many bytes, besides every
    ``access_log_flush_seconds``. 1 (the default): every entry goes out the moment its stream ends, so a ticket is
    released (and a parked request woken for its slot) without waiting for the flush timer. The completion signal's
    latency is then Envoy's and the control plane's own. ``bench steady`` thor+spark capped 95% measured the time a
    freed slot stays empty while requests are parked: median 6.7 ms wall with 16384 bytes and a 5 ms flush, 2.7 ms with
    1 (a capped Envoy's own pending queue: 0.6-1.0 ms). A larger value batches entries at high request rates, at the
    cost of that latency: fewer gRPC messages for the control plane to read."""
    stream_idle_timeout_seconds: float
    """Longest silence on a stream (between tokens, or while a Check is pending) before Envoy resets it."""
    connect_timeout_seconds: float
    """Connect timeout to an engine."""
    client_headers_kept: tuple[str, ...]
    """``x-sluice-*`` request headers a client may send (inputs, never routing); every other one is stripped."""
    on_controlplane_failure: OnFailure
    """``open``: Envoy routes unpinned requests by each model's last capacity weights; ``closed``: 503 + retry-after."""
    failure_retry_after_seconds: int
    """Retry-After on the fail-closed 503."""
    weight_change_threshold: float
    """Fallback weights are re-pushed over RDS only when one moves by more than this fraction."""
    max_downstream_connections: int
    """Client connections Envoy accepts at once; more are refused."""
    engine_overflow_headroom: int
    """Envoy's per-engine circuit breaker allows the engine's cap plus this many requests at once; beyond it Envoy answers
    503 ``engine_overloaded`` + retry-after itself. Admitted traffic never reaches it: it bounds the fail-open path."""
    engine_max_requests_unknown_cap: int
    """The per-engine circuit breaker for an engine whose cap is neither configured nor reported."""
    request_headers_timeout_seconds: float
    """A client must finish sending its request headers within this long (slow-header connections are closed, 408)."""
    concurrency: int
    """Envoy's worker threads (its ``--concurrency``). Each worker keeps its own connection pool per engine, so more
    workers open more connections to each engine; 2 suits the 2-core hosts sluice is benchmarked on. Set it to the
    cores Envoy may use on a larger host."""
    delayed_close_timeout_seconds: float
    """How long Envoy waits for a client to close a connection Envoy is closing (Envoy's default is 1 s: a stream cut by
    a dying engine then ends for the client a second late)."""
    retry_on_engine_failure: bool
    """An engine that fails before its first byte (connect failure, reset, 503) is retried once on another engine through
    a new Check (an internal redirect), never on the same engine."""
    controlplane_tls: ClientTls | None = None
    """TLS from Envoy to the control plane's gRPC port (the bootstrap cluster's ``transport_socket``); needed exactly when
    ``controlplane.tls`` is set, with a client certificate when that asks for one."""


class ProbeProcess(enum.StrEnum):
    AUTO = "auto"
    ON = "on"
    OFF = "off"


class WorkerPriority(enum.StrEnum):
    IDLE = "idle"
    NICE = "nice"


PROBE_PROCESS_MIN_ENGINES = 64
"""``observe.probe_process: auto`` probes in a worker process from this many engines on: below it one event loop does
both comfortably (bench/results/scale.md: 200 engines held p99 within 1.5x in-loop), and a process costs ~40 MB."""


@dataclass(frozen=True, slots=True)
class ObserveConfig:
    poll_interval_seconds: float
    poll_timeout_seconds: float
    stale_after_polls: int
    models_refresh_seconds: float
    max_backoff_seconds: float
    on_stale: OnStale
    """``open``: a stale engine is still admitted to (after fresh ones; seed 004's choice); ``closed``: it is not."""
    rate_ring_size: int
    """Samples kept per (model, chip class) for the prefill and solo-decode medians."""
    rate_min_samples: int
    """A median is trusted only from this many samples on."""
    prefill_sample_min_tokens: int
    """A prefill-rate sample needs at least this many prompt tokens in its interval (tiny prompts mislead)."""
    probe_process: ProbeProcess = ProbeProcess.AUTO
    """Where probes run (``controlplane/observe/worker.py``): ``auto`` (a worker process from
    ``PROBE_PROCESS_MIN_ENGINES`` engines on), ``on``, ``off`` (on the control plane's event loop)."""
    max_probes_per_second: float = 300.0
    """The fleet's probe budget (0: none). With more engines than ``poll_interval_seconds`` x this, each engine is polled
    every ``engines / max_probes_per_second`` seconds instead (``for_fleet``), and goes stale after that many times
    ``stale_after_polls``."""
    probe_wave_seconds: float = 0.1
    """In the probe worker, probes fall due on each engine's own schedule and start together on the next multiple of
    this (on the monotonic clock; 0: each on its own). See ``wave_s``."""
    worker_priority: WorkerPriority = WorkerPriority.IDLE
    """The probe worker's CPU scheduling (``observe/worker.py``, ``WORKER_NICE``): ``idle`` (Linux ``SCHED_IDLE``, at nice
    10 elsewhere or when it is refused) runs probes only on CPU nothing else wants; ``nice`` keeps it a normal process at
    nice 10. Why idle: docs/decisions/0011-probe-worker-idle.md. The failure mode: on a host whose cores are all busy
    an idle worker gets almost no CPU, so it watches its own lateness and, once ``worker_starved_after_seconds`` late,
    stops; the control plane restarts it at nice 10 for ``WORKER_IDLE_RETRY_S`` (``sluice_probe_worker_starved_total``
    counts it)."""
    worker_starved_after_seconds: float = 2.0
    """How late the idle probe worker's own timer may fire before it counts as starved (see ``worker_priority``)."""
    filter_metrics: bool = True
    """Ask vLLM engines for only the samples sluice reads (``/metrics?name[]=...``, prometheus_client's own filter;
    ``observe/parse.py``, ``metrics_path``): about 6 KB a probe instead of 54 KB for vLLM 0.11. An engine (or a proxy
    before it) that refuses the query or answers it without a required gauge is probed whole from then on by itself
    (``EnginePoller.poll_once``). Off: every probe fetches the whole exposition."""

    @property
    def wave_s(self) -> float:
        """The probe wave in effect: ``probe_wave_seconds``, at most a quarter of the poll interval.

        Probes that start together share the event loop's turns and the worker's writes to the control plane. Each
        engine is still probed once per interval on average (the schedule does not drift; only the start waits). The
        failure mode: a probe starts up to one wave late, and the wave's probes arrive at the engines and the control
        plane together (at 1000 engines polled every second, 100 probes every 100 ms). Only the probe worker runs waves;
        probes on the control plane's own loop (``probe_process: off``, or a fleet below ``PROBE_PROCESS_MIN_ENGINES``)
        start each on its own timer, since a wave's parses would hold the loop that answers Checks. Why:
        docs/decisions/0012-probe-waves-in-worker.md."""
        return min(self.probe_wave_seconds, self.poll_interval_seconds / 4)

    def for_fleet(self, engines: int) -> ObserveConfig:
        """This config as a fleet of ``engines`` runs it: the poll interval stretched to keep the fleet's probes within
        ``max_probes_per_second``. A probe of a real-size vLLM exposition costs the probe worker about 0.6 ms of CPU and
        the control plane about 0.1 ms on the bench machine, so 1000 engines a second are most of its two cores, and
        Checks queue behind them (``bench/results/scale.md``: end-to-end p99 7x the 2-engine one at 1000 engines polled
        every second, 1.3x at one probe every 3 s). With hundreds of engines sharing the traffic, each one's probe
        matters less: sluice's own admissions are in the ledger at once, and the probe adds what bypassed it.

        Discovery (``models_refresh_seconds``: ``/v1/models`` and ``/version``, two more requests) stretches by the same
        factor: at 1000 engines every third probe was a discovery (two of every five of the worker's requests), and the
        probe worker took 32% of a core with no traffic (29% after; two runs each of a harness over ``run_worker`` and
        the bench farm). The failure mode: a model or version change is seen up to ``models_refresh_seconds`` x the factor
        later (33 s at 1000 engines)."""
        budget = self.max_probes_per_second
        if budget <= 0 or engines <= budget * self.poll_interval_seconds:
            return self
        stretch = engines / (budget * self.poll_interval_seconds)
        return replace(self, poll_interval_seconds=engines / budget,
                       models_refresh_seconds=self.models_refresh_seconds * stretch)

    def probes_in_worker(self, engines: int) -> bool:
        return self.probe_process is ProbeProcess.ON or (
            self.probe_process is ProbeProcess.AUTO and engines >= PROBE_PROCESS_MIN_ENGINES)

    @property
    def stale_after_s(self) -> float:
        return self.poll_interval_seconds * self.stale_after_polls


class StoreBackend(enum.StrEnum):
    MEMORY = "memory"
    """One process holds the ledger (the default for ``make run``); a restart forgets it."""
    VALKEY = "valkey"
    """Valkey or Redis holds it (controlplane/store/valkey.py): several replicas share one exact ledger, and a restarted
    replica picks it up."""


class StoreOnFailure(enum.StrEnum):
    """``store.on_failure``: what a Check gets while the shared store cannot be reached."""

    OPEN = "open"
    """Admitted on this replica's own ledger (its caps exact for its own admissions, counted in
    ``sluice_store_fail_open_total``); written back to the store when it returns."""
    CLOSED = "closed"
    """503 ``store_unavailable`` + retry-after; parked requests keep waiting."""


@dataclass(frozen=True, slots=True)
class StoreConfig:
    backend: StoreBackend = StoreBackend.MEMORY
    url: str | None = None
    """``redis://host:port/db`` (``rediss://`` for TLS). With ``valkey`` and no url, ``sluice up`` starts a server."""
    prefix: str = "sluice"
    """Every key and the event channel start with this (several sluice deployments may share one server)."""
    replica_id: str | None = None
    """This replica's name in the store (heartbeat, parked members, metrics); default: host-pid-random."""
    on_failure: StoreOnFailure = StoreOnFailure.OPEN
    timeout_seconds: float = 0.5
    """One store call's bound; past it the call counts as a failure (``on_failure``)."""
    heartbeat_seconds: float = 0.05
    """How often a replica says it is alive (from a thread of its own); each time it also looks for dead replicas."""
    dead_after_beats: int = 5
    """A replica silent for this many heartbeats is dead: its parked requests leave every line at once (its tickets
    stay). 5 x 0.05 s: a survivor admits past a dead replica's members within about 0.3 s."""
    session_ttl_seconds: float = 3600.0
    reserve_attempts: int = 3
    """Admissions tried per Check when other replicas keep taking the chosen slot first; then the request parks."""
    claim_seconds: float = 0.25
    """How long an admission the store refused only for the line stays with the parked request as its claim: the store
    admits it when the request heads the line within that time and it still fits (controlplane/store/base.py). 0: no
    claims (each parked request waits for its own replica's wake)."""
    max_connections: int = 64
    """Connections a replica opens to the store at most; calls beyond wait for one (up to ``timeout_seconds``)."""


class RateLimitOnFailure(enum.StrEnum):
    """``ratelimit.on_failure``: what a tenant's request gets while the limiter's store cannot be reached."""

    OPEN = "open"
    """Admitted uncharged (counted in ``sluice_ratelimit_errors_total`` and as ``store_error`` decisions)."""
    CLOSED = "closed"
    """503 ``ratelimit_unavailable`` + retry-after."""


@dataclass(frozen=True, slots=True)
class RateLimitConfig:
    """``ratelimit``: how the tenants' limiter (``ratelimit/``) runs. Its store is the ledger's: the Valkey at
    ``store.url`` when ``store.backend`` is ``valkey`` (so every replica draws on one budget), else this process's
    memory. Read at start-up (a change needs a restart); the tenants and their limits are reloadable."""

    on_failure: RateLimitOnFailure = RateLimitOnFailure.OPEN
    timeout_seconds: float = 0.5
    """One limiter call's bound (pool wait, connect, reply); past it the call fails and ``on_failure`` applies."""
    max_connections: int = 64
    """Connections to the limiter's Valkey per replica. A call beyond them waits for one, and redis-py's pool does not
    hand them out in order (``sluice bench ratelimit``: 64 callers on 32 connections had a p99 near a second), so this
    should cover the Checks a replica charges at once."""
    failure_retry_after_seconds: int = 1
    """Retry-After on ``ratelimit_unavailable`` (``on_failure: closed``)."""
    concurrency_retry_after_seconds: float = 1.0
    """Retry-After of a refusal by ``concurrent_requests`` (when a slot frees is not predictable)."""


@dataclass(frozen=True, slots=True)
class TicketConfig:
    lease_seconds: float
    """A ticket whose access-log entry never arrives is reaped after this long (seconds)."""
    reap_interval_seconds: float
    idle_reap_grace_seconds: float
    """A ticket older than this is reaped when its engine reports nothing running and nothing waiting."""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    name: str
    url: str
    host: str
    """``url``'s host: as written by ``parse_config``, an IP address once ``resolve_engines`` ran (Envoy's EDS endpoints
    take addresses, not names)."""
    port: int
    max_num_seqs: int | None
    models: tuple[str, ...]
    """Models served, as configured; discovery from ``/v1/models`` adds to these."""
    sim: str | None
    """Simulator profile ``sluice up`` starts for this engine, or None for an engine running elsewhere."""
    sim_speed: float
    flavor: EngineFlavor
    """``auto`` (detected from ``/metrics``) or one of ``vllm``, ``sglang``, ``llamacpp``, ``tgi``."""
    chip_class: str
    """Engines of one chip class share prefill/decode medians; defaults to the engine's own name."""
    sim_flavor: SimFlavor
    """Metric dialect the simulator speaks (``vllm-v1``, ``vllm-v0``, ``sglang``, ``llamacpp``)."""
    prefill_tokens_per_s: float | None = None
    """Operator's anchor for this engine's prefill rate, used until one is measured."""
    decode_tokens_per_s: float | None = None
    """Operator's anchor for one request's decode rate on this engine, used until measured."""
    sim_model: str | None = None
    """Model id a simulator serves instead of its profile's."""
    max_loras: int | None = None
    """LoRA adapter slots (vLLM's ``--max-loras``), >= 1; None: what the engine's ``lora_requests_info`` reports."""


AUTHZ_TIMEOUT_GRACE_S = 10.0
"""Margin between the longest park and Envoy's limits, so a full park never becomes an authz error or a stream reset."""

#: Sections a running control plane can take from a reloaded file; the others shape processes, ports or Envoy's
#: listener (changing the listener would drain every open stream) and need a restart. Engines added or removed by a
#: reload reach Envoy over CDS/EDS; ``sluice up`` does not start or stop simulators for them.
RELOADABLE = ("admission", "models", "version_floors", "boxes", "observe.on_stale", "engines", "tenants", "fairness",
              "adapters")


@dataclass(frozen=True, slots=True)
class Config:
    controlplane: ControlPlaneConfig
    envoy: EnvoyConfig
    observe: ObserveConfig
    tickets: TicketConfig
    engines: tuple[EngineConfig, ...]
    source: str
    policy: Policy = Policy()
    admin: AdminConfig = AdminConfig()
    store: StoreConfig = StoreConfig()
    tracing: TracingConfig = TracingConfig()
    tenants: Tenants = Tenants()
    """API keys, priorities and limits per tenant (``controlplane/core/tenants.py``); none: authentication off."""
    ratelimit: RateLimitConfig = RateLimitConfig()

    @property
    def authz_timeout_s(self) -> float:
        """Envoy's ext_authz timeout: tied to the stream idle timeout, not to the (reloadable) park bound, so the listener
        never changes on a policy reload. Validation keeps ``max_park_s + grace`` below it."""
        return self.envoy.stream_idle_timeout_seconds - AUTHZ_TIMEOUT_GRACE_S

    def restart_needed(self, other: Config) -> list[str]:
        """Sections that differ between this config and ``other`` outside ``RELOADABLE`` (a section some of whose fields
        are reloadable, like ``observe``, is compared without them)."""
        changed = []
        for name in _PROCESS_SECTIONS:
            mine, theirs = getattr(self, name), getattr(other, name)
            reloadable = {f.split(".", 1)[1]: getattr(theirs, f.split(".", 1)[1]) for f in RELOADABLE
                          if f.startswith(name + ".")}
            if replace(mine, **reloadable) != theirs:
                changed.append(name)
        return changed


_PROCESS_SECTIONS = ("controlplane", "envoy", "observe", "tickets", "admin", "store", "tracing", "ratelimit")
"""The sections read once, when a process starts (less any field ``RELOADABLE`` names)."""
_POLICY_PARTS = ("models", "version_floors", "boxes")
"""Sections of the config that become ``Policy`` fields of the same name; ``admission`` is the rest of ``Policy``."""


def _section_value(config: Config, name: str) -> object:
    """What a reloadable section (a ``RELOADABLE`` name) holds in ``config``."""
    if name == "admission":
        return replace(config.policy, models={}, version_floors=(), boxes=(), fairness=FairShare(),
                       adapters=AdapterPolicy())
    if name == "adapters":
        return config.policy.adapters
    if name == "fairness":  # its own settings: on under ``auto``, the weights and shares follow ``tenants``
        return replace(config.policy.fairness, enabled=False, weights={}, reserved={})
    if name in _POLICY_PARTS:
        return getattr(config.policy, name)
    section, _, attribute = name.partition(".")
    value = getattr(config, section)
    return getattr(value, attribute) if attribute else value


def changed_sections(old: Config, new: Config) -> list[str]:
    """The ``RELOADABLE`` sections that differ between ``old`` and ``new``, in ``RELOADABLE``'s order (what a reload
    reports as changed)."""
    return [name for name in RELOADABLE if _section_value(old, name) != _section_value(new, name)]


DEFAULTS: dict[str, Any] = {
    "controlplane": {"host": "127.0.0.1", "grpc_port": 18000, "metrics_port": 9090, "max_check_queue_ms": 1000.0,
                     "overload_retry_after_seconds": 1, "max_pending_rpcs": 100000, "stop_step_seconds": 5.0,
                     "admin_host": "127.0.0.1",
                     "admin_port": 18001, "tls": None, "replicas": []},
    "admin": {"token_file": None, "token_env": None, "require_token_for_reads": False, "reload_dir": None, "tls": None},
    "envoy": {
        "listen_host": "127.0.0.1",
        "listen_port": 8080,
        "admin_port": 9901,
        "max_request_bytes": 1048576,
        "access_log_flush_seconds": 0.005,
        "access_log_buffer_bytes": 1,
        "stream_idle_timeout_seconds": 300.0,
        "connect_timeout_seconds": 1.0,
        "client_headers_kept": list(CLIENT_HEADERS),
        "on_controlplane_failure": "open",
        "failure_retry_after_seconds": 5,
        "weight_change_threshold": 0.10,
        "max_downstream_connections": 50000,
        "engine_overflow_headroom": 2,
        "engine_max_requests_unknown_cap": 256,
        "request_headers_timeout_seconds": 10.0,
        "retry_on_engine_failure": True,
        "delayed_close_timeout_seconds": 0.0,
        "concurrency": 2,
        "controlplane_tls": None,
    },
    "observe": {
        "poll_interval_seconds": 1.0,
        "poll_timeout_seconds": 0.8,
        "stale_after_polls": 3,
        "models_refresh_seconds": 10.0,
        "max_backoff_seconds": 10.0,
        "on_stale": "open",
        "rate_ring_size": 64,
        "rate_min_samples": 5,
        "prefill_sample_min_tokens": 256,
        "probe_process": "auto",
        "max_probes_per_second": 300.0,
        "probe_wave_seconds": 0.1,
        "worker_priority": "idle",
        "worker_starved_after_seconds": 2.0,
        "filter_metrics": True,
    },
    "tickets": {"lease_seconds": 900.0, "reap_interval_seconds": 5.0, "idle_reap_grace_seconds": 5.0},
    "store": {f.name: (f.default.value if isinstance(f.default, enum.Enum) else f.default)
              for f in fields(StoreConfig)},
    "admission": {},  # filled in below from Policy's own defaults
    "tracing": {f.name: f.default for f in fields(TracingConfig)},
    "ratelimit": {f.name: (f.default.value if isinstance(f.default, enum.Enum) else f.default)
                  for f in fields(RateLimitConfig)},
    "fairness": {"enabled": FairShare().mode.value, "prompt_weight": FairShare().prompt_weight,
                 "output_weight": FairShare().output_weight, "default_weight": FairShare().default_weight},
    "adapters": {"swap_seconds": AdapterPolicy().swap_s, "swap_min_samples": AdapterPolicy().swap_min_samples,
                 "models": {}},
}
_POLICY_NAME = {"max_park_seconds": "max_park_s", "retry_after_min_seconds": "retry_after_min_s", "retry_after_max_seconds": "retry_after_max_s",
                "serve_half_life_seconds": "serve_half_life_s",
                "ttft_correction_half_life_seconds": "ttft_correction_half_life_s",
                "shed_decision_seconds": "shed_decision_s"}
"""``admission`` keys whose ``Policy`` field is spelled differently; every other key is the field's own name."""
_CONFIG_NAME = {field: key for key, field in _POLICY_NAME.items()}
DEFAULTS["admission"] = {_CONFIG_NAME.get(f.name, f.name): f.default for f in fields(Policy)
                         if f.name not in _POLICY_PARTS and f.default is not MISSING}
_MODEL_FIELDS = {"decode_floor_tokens_per_s", "solo_decode_tokens_per_s", "kv_bytes_per_token", "max_ttft_ms"}
_BOX_FIELDS = {"name", "engines", "kv_budget_tokens", "kv_budget_bytes"}


class _Checker:
    def __init__(self) -> None:
        self.problems: list[str] = []

    def section(self, raw: dict[str, Any], name: str) -> dict[str, Any]:
        value = raw.get(name, {})
        if value is None:
            value = {}
        if not isinstance(value, dict):
            self.problems.append(f"{name}: must be a mapping")
            value = {}
        unknown = set(value) - set(DEFAULTS[name])
        for key in sorted(unknown):
            self.problems.append(f"{name}.{key}: unknown field")
        return {**DEFAULTS[name], **value}

    def number(self, path: str, value: Any, *, minimum: float, integer: bool = False, maximum: float | None = None) -> Any:
        kinds = (int,) if integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds):
            self.problems.append(f"{path}: must be {'an integer' if integer else 'a number'}, got {value!r}")
            return minimum
        if value < minimum or (maximum is not None and value > maximum):
            bound = f">= {minimum}" + (f" and <= {maximum}" if maximum is not None else "")
            self.problems.append(f"{path}: must be {bound}, got {value!r}")
        return value

    def port(self, path: str, value: Any, *, any_free: bool = False) -> int:
        """A TCP port; ``any_free``: 0 is allowed too, meaning whichever port the process gets (it reports it)."""
        return int(self.number(path, value, minimum=0 if any_free else 1, maximum=65535, integer=True))

    def entries(self, section: str, items: list[Any] | dict[str, Any],
                fields: set[str]) -> Iterator[tuple[int | str, str, dict[str, Any]]]:
        """(index or key, dotted path, mapping) for each mapping in a list section (``boxes[0]``) or a mapping section
        (``models.cortex``); non-mappings and unknown keys are reported."""
        pairs = items.items() if isinstance(items, dict) else enumerate(items)
        for i, item in pairs:
            path = f"{section}.{i}" if isinstance(items, dict) else f"{section}[{i}]"
            if not isinstance(item, dict):
                self.problems.append(f"{path}: must be a mapping")
                continue
            for key in sorted(set(item) - fields):
                self.problems.append(f"{path}.{key}: unknown field")
            yield i, path, item

    def flag(self, path: str, value: Any) -> bool:
        if not isinstance(value, bool):
            self.problems.append(f"{path}: must be true or false, got {value!r}")
            return False
        return value

    def choice(self, path: str, value: Any, kind: type[_E]) -> _E:
        allowed = [member.value for member in kind]
        if not isinstance(value, str) or value not in allowed:
            self.problems.append(f"{path}: must be one of {', '.join(allowed)}, got {value!r}")
            return kind(allowed[0])
        return kind(value)

    def optional_text(self, path: str, value: Any) -> str | None:
        if value is None:
            return None
        return self.text(path, value)

    def text(self, path: str, value: Any) -> str:
        if not isinstance(value, str) or not value:
            self.problems.append(f"{path}: must be a non-empty string")
            return ""
        return value

    def files(self, path: str, value: Any, known: tuple[str, ...]) -> dict[str, str | None] | None:
        """A TLS block: None when absent (or refused: its problems reported), else each of ``known`` (a non-empty path
        string, or None when not given)."""
        if value is None:
            return None
        if not isinstance(value, dict):
            self.problems.append(f"{path}: must be a mapping of {', '.join(known)}")
            return None
        before = len(self.problems)
        for key in sorted(set(value) - set(known)):
            self.problems.append(f"{path}.{key}: unknown field")
        block = {key: self.optional_text(f"{path}.{key}", value.get(key)) for key in known}
        return block if len(self.problems) == before else None  # a block with a bad field is refused whole, once


def _server_tls(c: _Checker, path: str, value: Any, *, mutual: bool) -> ServerTls | None:
    """``controlplane.tls`` (``mutual``: may name ``client_ca_file``) or ``admin.tls``: a certificate and its key, both or
    neither."""
    block = c.files(path, value, ("cert_file", "key_file", "client_ca_file") if mutual else ("cert_file", "key_file"))
    if block is None:
        return None
    cert, key, ca = block["cert_file"], block["key_file"], block.get("client_ca_file")
    if not cert or not key:
        c.problems.append(f"{path}: needs both cert_file and key_file (TLS is all or nothing)")
        return None
    return ServerTls(cert, key, ca)


def _client_tls(c: _Checker, path: str, value: Any) -> ClientTls | None:
    block = c.files(path, value, ("ca_file", "cert_file", "key_file", "server_name"))
    if block is None:
        return None
    if not block["ca_file"]:
        c.problems.append(f"{path}.ca_file: needed (the CA that signed the control plane's certificate)")
        return None
    if bool(block["cert_file"]) != bool(block["key_file"]):
        c.problems.append(f"{path}: cert_file and key_file go together (Envoy's client certificate and its key)")
        return None
    return ClientTls(block["ca_file"], block["cert_file"], block["key_file"], block["server_name"])


def parse_config(raw: Any, source: str = "<memory>") -> Config:
    """Validate a raw mapping into a frozen ``Config``; raise ``ConfigError`` listing every problem."""
    c = _Checker()
    if not isinstance(raw, dict):
        raise ConfigError(["(top): the config must be a mapping"])
    for key in sorted(set(raw) - {*DEFAULTS, "engines", "models", "version_floors", "boxes", "tenants"}):
        c.problems.append(f"{key}: unknown field")

    cp = c.section(raw, "controlplane")
    controlplane = ControlPlaneConfig(
        host=c.text("controlplane.host", cp["host"]),
        grpc_port=c.port("controlplane.grpc_port", cp["grpc_port"], any_free=True),
        metrics_port=c.port("controlplane.metrics_port", cp["metrics_port"], any_free=True),
        max_check_queue_ms=float(c.number("controlplane.max_check_queue_ms", cp["max_check_queue_ms"], minimum=1)),
        overload_retry_after_seconds=int(c.number("controlplane.overload_retry_after_seconds",
                                                  cp["overload_retry_after_seconds"], minimum=1, integer=True)),
        max_pending_rpcs=int(c.number("controlplane.max_pending_rpcs", cp["max_pending_rpcs"], minimum=1000,
                                      integer=True)),
        stop_step_seconds=float(c.number("controlplane.stop_step_seconds", cp["stop_step_seconds"], minimum=0.1,
                                         maximum=600)),
        admin_host=c.text("controlplane.admin_host", cp["admin_host"]),
        admin_port=c.port("controlplane.admin_port", cp["admin_port"], any_free=True),
        tls=_server_tls(c, "controlplane.tls", cp["tls"], mutual=True),
        replicas=_parse_replicas(c, cp["replicas"], cp["host"]),
    )
    am = c.section(raw, "admin")
    admin = AdminConfig(
        token_file=c.optional_text("admin.token_file", am["token_file"]),
        token_env=c.optional_text("admin.token_env", am["token_env"]),
        require_token_for_reads=c.flag("admin.require_token_for_reads", am["require_token_for_reads"]),
        reload_dir=c.optional_text("admin.reload_dir", am["reload_dir"]),
        tls=_server_tls(c, "admin.tls", am["tls"], mutual=False),
    )
    if not is_loopback(controlplane.admin_host) and not admin.has_token_source:
        c.problems.append(f"controlplane.admin_host: {controlplane.admin_host!r} is not a loopback address; an admin "
                          "listener reachable from other hosts needs admin.token_file or admin.token_env")
    ev = c.section(raw, "envoy")
    kept = ev["client_headers_kept"]
    if not isinstance(kept, list) or not all(isinstance(h, str) and h.lower().startswith("x-sluice-") for h in kept):
        c.problems.append("envoy.client_headers_kept: must be a list of x-sluice-* header names")
        kept = []
    for internal in (ENGINE_HEADER, TICKET_HEADER):
        if internal in [h.lower() for h in kept]:
            c.problems.append(f"envoy.client_headers_kept: {internal} can never come from a client")
    envoy = EnvoyConfig(
        listen_host=c.text("envoy.listen_host", ev["listen_host"]),
        listen_port=c.port("envoy.listen_port", ev["listen_port"], any_free=True),
        admin_port=c.port("envoy.admin_port", ev["admin_port"], any_free=True),
        max_request_bytes=int(c.number("envoy.max_request_bytes", ev["max_request_bytes"], minimum=1024, integer=True)),
        access_log_flush_seconds=float(
            c.number("envoy.access_log_flush_seconds", ev["access_log_flush_seconds"], minimum=0.001)
        ),
        access_log_buffer_bytes=int(c.number("envoy.access_log_buffer_bytes", ev["access_log_buffer_bytes"], minimum=1,
                                             maximum=16 * 1024 * 1024, integer=True)),
        stream_idle_timeout_seconds=float(
            c.number("envoy.stream_idle_timeout_seconds", ev["stream_idle_timeout_seconds"], minimum=1)
        ),
        connect_timeout_seconds=float(c.number("envoy.connect_timeout_seconds", ev["connect_timeout_seconds"], minimum=0.01)),
        client_headers_kept=tuple(h.lower() for h in kept),
        on_controlplane_failure=c.choice("envoy.on_controlplane_failure", ev["on_controlplane_failure"], OnFailure),
        failure_retry_after_seconds=int(c.number("envoy.failure_retry_after_seconds", ev["failure_retry_after_seconds"],
                                                 minimum=1, integer=True)),
        weight_change_threshold=float(c.number("envoy.weight_change_threshold", ev["weight_change_threshold"],
                                               minimum=0)),
        max_downstream_connections=int(c.number("envoy.max_downstream_connections", ev["max_downstream_connections"],
                                                minimum=1, integer=True)),
        engine_overflow_headroom=int(c.number("envoy.engine_overflow_headroom", ev["engine_overflow_headroom"],
                                              minimum=0, integer=True)),
        engine_max_requests_unknown_cap=int(c.number("envoy.engine_max_requests_unknown_cap",
                                                     ev["engine_max_requests_unknown_cap"], minimum=1, integer=True)),
        request_headers_timeout_seconds=float(c.number("envoy.request_headers_timeout_seconds",
                                                       ev["request_headers_timeout_seconds"], minimum=0.1)),
        delayed_close_timeout_seconds=float(c.number("envoy.delayed_close_timeout_seconds",
                                                     ev["delayed_close_timeout_seconds"], minimum=0)),
        concurrency=int(c.number("envoy.concurrency", ev["concurrency"], minimum=1, integer=True)),
        retry_on_engine_failure=c.flag("envoy.retry_on_engine_failure", ev["retry_on_engine_failure"]),
        controlplane_tls=_client_tls(c, "envoy.controlplane_tls", ev["controlplane_tls"]),
    )
    _check_tls_pair(c, controlplane.tls, envoy.controlplane_tls, server_given=cp["tls"] is not None,
                    client_given=ev["controlplane_tls"] is not None)
    ob = c.section(raw, "observe")
    observe = ObserveConfig(
        poll_interval_seconds=float(c.number("observe.poll_interval_seconds", ob["poll_interval_seconds"], minimum=0.05)),
        poll_timeout_seconds=float(c.number("observe.poll_timeout_seconds", ob["poll_timeout_seconds"], minimum=0.01)),
        stale_after_polls=int(c.number("observe.stale_after_polls", ob["stale_after_polls"], minimum=1, integer=True)),
        models_refresh_seconds=float(c.number("observe.models_refresh_seconds", ob["models_refresh_seconds"], minimum=0.1)),
        max_backoff_seconds=float(c.number("observe.max_backoff_seconds", ob["max_backoff_seconds"], minimum=0.05)),
        on_stale=c.choice("observe.on_stale", ob["on_stale"], OnStale),
        rate_ring_size=int(c.number("observe.rate_ring_size", ob["rate_ring_size"], minimum=1, integer=True)),
        rate_min_samples=int(c.number("observe.rate_min_samples", ob["rate_min_samples"], minimum=1, integer=True)),
        prefill_sample_min_tokens=int(c.number("observe.prefill_sample_min_tokens", ob["prefill_sample_min_tokens"],
                                               minimum=0, integer=True)),
        probe_process=c.choice("observe.probe_process", ob["probe_process"], ProbeProcess),
        max_probes_per_second=float(c.number("observe.max_probes_per_second", ob["max_probes_per_second"], minimum=0)),
        probe_wave_seconds=float(c.number("observe.probe_wave_seconds", ob["probe_wave_seconds"], minimum=0)),
        worker_priority=c.choice("observe.worker_priority", ob["worker_priority"], WorkerPriority),
        worker_starved_after_seconds=float(c.number("observe.worker_starved_after_seconds",
                                                    ob["worker_starved_after_seconds"], minimum=0.05)),
        filter_metrics=c.flag("observe.filter_metrics", ob["filter_metrics"]),
    )
    if observe.rate_min_samples > observe.rate_ring_size:
        c.problems.append("observe.rate_min_samples: must not exceed observe.rate_ring_size")
    if observe.poll_timeout_seconds > observe.poll_interval_seconds:
        c.problems.append("observe.poll_timeout_seconds: must not exceed observe.poll_interval_seconds")
    tk = c.section(raw, "tickets")
    tickets = TicketConfig(
        lease_seconds=float(c.number("tickets.lease_seconds", tk["lease_seconds"], minimum=1)),
        reap_interval_seconds=float(c.number("tickets.reap_interval_seconds", tk["reap_interval_seconds"], minimum=0.01)),
        idle_reap_grace_seconds=float(c.number("tickets.idle_reap_grace_seconds", tk["idle_reap_grace_seconds"],
                                               minimum=0.1)),
    )
    st = c.section(raw, "store")
    store = StoreConfig(
        backend=c.choice("store.backend", st["backend"], StoreBackend),
        url=c.optional_text("store.url", st["url"]),
        prefix=c.text("store.prefix", st["prefix"]),
        replica_id=c.optional_text("store.replica_id", st["replica_id"]),
        on_failure=c.choice("store.on_failure", st["on_failure"], StoreOnFailure),
        timeout_seconds=float(c.number("store.timeout_seconds", st["timeout_seconds"], minimum=0.01)),
        heartbeat_seconds=float(c.number("store.heartbeat_seconds", st["heartbeat_seconds"], minimum=0.05)),
        dead_after_beats=int(c.number("store.dead_after_beats", st["dead_after_beats"], minimum=2, integer=True)),
        session_ttl_seconds=float(c.number("store.session_ttl_seconds", st["session_ttl_seconds"], minimum=1)),
        reserve_attempts=int(c.number("store.reserve_attempts", st["reserve_attempts"], minimum=1, integer=True)),
        claim_seconds=float(c.number("store.claim_seconds", st["claim_seconds"], minimum=0)),
        max_connections=int(c.number("store.max_connections", st["max_connections"], minimum=1, integer=True)),
    )
    if store.url is not None and not store.url.startswith(("redis://", "rediss://", "unix://")):
        c.problems.append(f"store.url: must be a redis://, rediss:// or unix:// URL, got {store.url!r}")
    if store.replica_id is not None and ("|" in store.replica_id or ":" in store.replica_id):
        c.problems.append("store.replica_id: must not contain '|' or ':'")
    tracing = _parse_tracing(c, c.section(raw, "tracing"))
    rl = c.section(raw, "ratelimit")
    ratelimit = RateLimitConfig(
        on_failure=c.choice("ratelimit.on_failure", rl["on_failure"], RateLimitOnFailure),
        timeout_seconds=float(c.number("ratelimit.timeout_seconds", rl["timeout_seconds"], minimum=0.01)),
        max_connections=int(c.number("ratelimit.max_connections", rl["max_connections"], minimum=1, integer=True)),
        failure_retry_after_seconds=int(c.number("ratelimit.failure_retry_after_seconds",
                                                 rl["failure_retry_after_seconds"], minimum=1, integer=True)),
        concurrency_retry_after_seconds=float(c.number("ratelimit.concurrency_retry_after_seconds",
                                                       rl["concurrency_retry_after_seconds"], minimum=0.001)),
    )
    tenants = _parse_tenants(c, raw.get("tenants"))
    engines = _parse_engines(c, raw.get("engines"))
    policy = _parse_policy(c, raw, {e.name for e in engines})
    policy = replace(policy, fairness=_parse_fairness(c, raw, tenants), adapters=_parse_adapters(c, raw))
    if envoy.stream_idle_timeout_seconds < policy.max_park_s + 2 * AUTHZ_TIMEOUT_GRACE_S:
        c.problems.append(
            f"admission.max_park_seconds: must stay {2 * AUTHZ_TIMEOUT_GRACE_S:g} s below "
            f"envoy.stream_idle_timeout_seconds ({envoy.stream_idle_timeout_seconds:g}): a parked request is a silent "
            "stream, and Envoy's Check timeout is the idle timeout less 10 s"
        )
    if c.problems:
        raise ConfigError(c.problems)
    return Config(controlplane, envoy, observe, tickets, engines, source, policy, admin, store, tracing, tenants,
                  ratelimit)


_TENANT_FIELDS = {"keys", "priority", "limits", "models", "models_allowed", "weight", "reserved_share"}
_TENANT_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
"""A tenant's name is a metrics label and a limiter key: short, and without ``/`` (which joins it to a model)."""
_DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")


def _parse_tenants(c: _Checker, raw: Any) -> Tenants:
    """``tenants: {name: {keys, priority: {default, max}, limits, models: {model: limits}, models_allowed}}``."""
    if raw is None:
        return Tenants()
    if not isinstance(raw, dict):
        c.problems.append("tenants: must be a mapping of tenant name -> settings")
        return Tenants()
    before = len(c.problems)
    tenants: list[Tenant] = []
    owner: dict[str, str] = {}
    for name, path, item in c.entries("tenants", raw, _TENANT_FIELDS):
        name = str(name)
        if not _TENANT_NAME_RE.match(name):
            c.problems.append(f"{path}: the name must match {_TENANT_NAME_RE.pattern} (it labels metrics and names a "
                              "budget)")
        keys = item.get("keys")
        if not isinstance(keys, list) or not keys:
            c.problems.append(f"{path}.keys: must be a non-empty list of SHA-256 hex digests of API keys "
                              "(printf %s KEY | sha256sum)")
            keys = []
        digests: list[str] = []
        for i, digest in enumerate(keys):
            if not isinstance(digest, str) or not _DIGEST_RE.match(digest.lower()):
                # Never echo the value: it may be a key pasted where its digest belongs.
                c.problems.append(f"{path}.keys[{i}]: must be a SHA-256 hex digest (64 hex characters), not a key")
                continue
            digest = digest.lower()
            if digest in owner:
                c.problems.append(f"{path}.keys[{i}]: the same key digest is listed by tenant {owner[digest]!r}")
            owner.setdefault(digest, name)
            digests.append(digest)
        default_class, max_class = Priority.STANDARD, None
        priority = item.get("priority")
        if priority is not None:
            if not isinstance(priority, dict):
                c.problems.append(f"{path}.priority: must be a mapping of default and max")
                priority = {}
            for key in sorted(set(priority) - {"default", "max"}):
                c.problems.append(f"{path}.priority.{key}: unknown field")
            if priority.get("default") is not None:
                default_class = c.choice(f"{path}.priority.default", priority["default"], Priority)
            if priority.get("max") is not None:
                max_class = c.choice(f"{path}.priority.max", priority["max"], Priority)
        if max_class is None:
            max_class = default_class
        if PRIORITY_RANK[default_class] > PRIORITY_RANK[max_class]:
            c.problems.append(f"{path}.priority.default: {default_class.value} is above max ({max_class.value})")
        limits, problems = parse_limits(item.get("limits") or {}, f"{path}.limits")
        c.problems.extend(problems)
        model_limits = {}
        models = item.get("models")
        if models is not None and not isinstance(models, dict):
            c.problems.append(f"{path}.models: must be a mapping of model id -> limits")
            models = {}
        for model, section in (models or {}).items():
            parsed, problems = parse_limits(section or {}, f"{path}.models.{model}")
            c.problems.extend(problems)
            model_limits[str(model)] = parsed
        allowed = item.get("models_allowed")
        if allowed is not None and (not isinstance(allowed, list) or not all(isinstance(m, str) and m
                                                                            for m in allowed)):
            c.problems.append(f"{path}.models_allowed: must be a list of model ids")
            allowed = None
        if allowed is not None:
            for model in model_limits:
                if model not in allowed:
                    c.problems.append(f"{path}.models.{model}: limits a model models_allowed does not allow")
        weight = item.get("weight")
        if weight is not None:
            weight = float(c.number(f"{path}.weight", weight, minimum=0.001))
        reserved = item.get("reserved_share")
        reserved = 0.0 if reserved is None else float(c.number(f"{path}.reserved_share", reserved, minimum=0,
                                                               maximum=1))
        tenants.append(Tenant(name, tuple(digests), default_class, max_class, limits, model_limits,
                              frozenset(allowed) if allowed is not None else None, weight, reserved))
    if (why := oversubscribed({t.name: t.reserved_share for t in tenants})) is not None:
        c.problems.append(f"tenants: {why}; lower them (core/reserve.py: shares are guarantees, never scaled)")
    if len(c.problems) > before:
        return Tenants()
    return Tenants.of(tenants)


def _parse_fairness(c: _Checker, raw: dict[str, Any], tenants: Tenants) -> FairShare:
    """``fairness: {enabled: auto | true | false, prompt_weight, output_weight, default_weight}`` and each tenant's
    ``weight`` (core/fairshare.py). ``auto`` (the default): on as soon as one tenant is configured."""
    fs = c.section(raw, "fairness")
    enabled = fs["enabled"]
    if isinstance(enabled, bool):
        mode = FairMode.ON if enabled else FairMode.OFF
    else:
        mode = c.choice("fairness.enabled", enabled, FairMode)
    return FairShare(
        enabled=mode is FairMode.ON or (mode is FairMode.AUTO and tenants.enabled),
        mode=mode,
        prompt_weight=float(c.number("fairness.prompt_weight", fs["prompt_weight"], minimum=0.001)),
        output_weight=float(c.number("fairness.output_weight", fs["output_weight"], minimum=0)),
        weights={name: t.weight for name, t in tenants.by_name.items() if t.weight is not None},
        default_weight=float(c.number("fairness.default_weight", fs["default_weight"], minimum=0.001)),
        reserved={name: t.reserved_share for name, t in tenants.by_name.items() if t.reserved_share > 0},
    )


def _parse_adapters(c: _Checker, raw: dict[str, Any]) -> AdapterPolicy:
    """``adapters: {swap_seconds, swap_min_samples, models: {adapter: base model}}`` (core/adapters.py). An adapter is not a base model
    of another adapter, and not its own base."""
    ad = c.section(raw, "adapters")
    swap = float(c.number("adapters.swap_seconds", ad["swap_seconds"], minimum=0, maximum=600))
    models = ad["models"] or {}
    bases: dict[str, str] = {}
    if not isinstance(models, dict):
        c.problems.append("adapters.models: must be a mapping of adapter -> base model")
        models = {}
    for adapter, base in models.items():
        if not isinstance(adapter, str) or not adapter or not isinstance(base, str) or not base:
            c.problems.append(f"adapters.models.{adapter}: must name its base model, got {base!r}")
            continue
        if base == adapter:
            c.problems.append(f"adapters.models.{adapter}: an adapter cannot be its own base model")
            continue
        bases[adapter] = base
    for adapter, base in bases.items():
        if base in bases:
            c.problems.append(f"adapters.models.{adapter}: its base {base!r} is itself an adapter")
    samples = int(c.number("adapters.swap_min_samples", ad["swap_min_samples"], minimum=1, integer=True))
    return AdapterPolicy(swap_s=swap, base_models=bases, swap_min_samples=samples)


def _parse_replicas(c: _Checker, raw: Any, default_host: Any) -> tuple[ReplicaAddress, ...]:
    if not isinstance(raw, list):
        c.problems.append("controlplane.replicas: must be a list of {host, grpc_port, metrics_port}")
        return ()
    out = []
    for _, path, item in c.entries("controlplane.replicas", raw, {"host", "grpc_port", "metrics_port"}):
        out.append(ReplicaAddress(c.text(f"{path}.host", item.get("host", default_host)),
                                  c.port(f"{path}.grpc_port", item.get("grpc_port")),
                                  c.port(f"{path}.metrics_port", item.get("metrics_port"))))
    return tuple(out)


def _parse_tracing(c: _Checker, tr: dict[str, Any]) -> TracingConfig:
    endpoint = c.text("tracing.otlp_endpoint", tr["otlp_endpoint"])
    if endpoint:
        parts = urlsplit(endpoint)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            c.problems.append(f"tracing.otlp_endpoint: must be an http:// or https:// URL with a host, got {endpoint!r}")
        elif parts.path in ("", "/"):
            # The exporter posts to the URL as given; a bare collector address would get every batch answered 404.
            c.problems.append(f"tracing.otlp_endpoint: must name the traces path, e.g. {endpoint.rstrip('/')}/v1/traces")
    return TracingConfig(
        enabled=c.flag("tracing.enabled", tr["enabled"]),
        otlp_endpoint=endpoint,
        service_name=c.text("tracing.service_name", tr["service_name"]),
        sample_ratio=float(c.number("tracing.sample_ratio", tr["sample_ratio"], minimum=0, maximum=1)),
        export_timeout_seconds=float(c.number("tracing.export_timeout_seconds", tr["export_timeout_seconds"],
                                              minimum=0.1)),
    )


def _check_tls_pair(c: _Checker, server: ServerTls | None, client: ClientTls | None, *, server_given: bool,
                    client_given: bool) -> None:
    """Both ends of the Envoy-facing port, from one config, must agree (a block refused already is not reported again)."""
    if server is not None and client is None and not client_given:
        c.problems.append("envoy.controlplane_tls: needed when controlplane.tls is set (Envoy must speak TLS to the "
                          "control plane: ca_file, and cert_file/key_file for mutual TLS)")
    if client is not None and server is None and not server_given:
        c.problems.append("envoy.controlplane_tls: set, but controlplane.tls is not (the control plane's gRPC port would "
                          "be plaintext)")
    if server is not None and server.mutual and client is not None and client.cert_file is None:
        c.problems.append("envoy.controlplane_tls.cert_file: needed, controlplane.tls.client_ca_file asks every client "
                          "for a certificate (mutual TLS)")


def _parse_policy(c: _Checker, raw: dict[str, Any], engine_names: set[str]) -> Policy:
    ad = c.section(raw, "admission")
    policy: dict[str, Any] = dict(
        kv_high_watermark=float(c.number("admission.kv_high_watermark", ad["kv_high_watermark"], minimum=0.05,
                                         maximum=1.0)),
        default_max_tokens=int(c.number("admission.default_max_tokens", ad["default_max_tokens"], minimum=1,
                                        integer=True)),
        default_expected_output_tokens=int(c.number("admission.default_expected_output_tokens",
                                                    ad["default_expected_output_tokens"], minimum=1, integer=True)),
        chars_per_token=float(c.number("admission.chars_per_token", ad["chars_per_token"], minimum=0.5)),
        prompt_tokens_min_samples=int(c.number("admission.prompt_tokens_min_samples",
                                               ad["prompt_tokens_min_samples"], minimum=0, integer=True)),
        max_park_s=float(c.number("admission.max_park_seconds", ad["max_park_seconds"], minimum=0)),
        max_queue_depth=int(c.number("admission.max_queue_depth", ad["max_queue_depth"], minimum=0, integer=True)),
        retry_after_min_s=int(c.number("admission.retry_after_min_seconds", ad["retry_after_min_seconds"], minimum=0,
                                       integer=True)),
        retry_after_max_s=int(c.number("admission.retry_after_max_seconds", ad["retry_after_max_seconds"], minimum=1,
                                       integer=True)),
        quality_overcommit=float(c.number("admission.quality_overcommit", ad["quality_overcommit"], minimum=0.1)),
        default_decode_tokens_per_s=float(c.number("admission.default_decode_tokens_per_s",
                                                   ad["default_decode_tokens_per_s"], minimum=0.01)),
        default_prefill_tokens_per_s=float(c.number("admission.default_prefill_tokens_per_s",
                                                    ad["default_prefill_tokens_per_s"], minimum=0.01)),
        wait_for_faster_margin=float(c.number("admission.wait_for_faster_margin", ad["wait_for_faster_margin"],
                                              minimum=0)),
        max_wait_for_faster_services=float(c.number("admission.max_wait_for_faster_services",
                                                    ad["max_wait_for_faster_services"], minimum=0)),
        near_tie_fraction=float(c.number("admission.near_tie_fraction", ad["near_tie_fraction"], minimum=0)),
        near_tie_max_engines=int(c.number("admission.near_tie_max_engines", ad["near_tie_max_engines"], minimum=0,
                                          integer=True)),
        near_tie_warm_seconds=float(c.number("admission.near_tie_warm_seconds", ad["near_tie_warm_seconds"],
                                             minimum=0)),
        band_ttft_grain_fraction=float(c.number("admission.band_ttft_grain_fraction", ad["band_ttft_grain_fraction"],
                                                minimum=0)),
        max_share_over_capacity=float(c.number("admission.max_share_over_capacity", ad["max_share_over_capacity"],
                                               minimum=0)),
        ttft_correction_gain=float(c.number("admission.ttft_correction_gain", ad["ttft_correction_gain"], minimum=0,
                                            maximum=1)),
        ttft_correction_max=float(c.number("admission.ttft_correction_max", ad["ttft_correction_max"], minimum=1)),
        ttft_correction_min=float(c.number("admission.ttft_correction_min", ad["ttft_correction_min"], minimum=0.05,
                                           maximum=1)),
        ttft_correction_half_life_s=float(c.number("admission.ttft_correction_half_life_seconds",
                                                   ad["ttft_correction_half_life_seconds"], minimum=0)),
        band_margin_ms=float(c.number("admission.band_margin_ms", ad["band_margin_ms"], minimum=0)),
        ttft_headroom_fraction=float(c.number("admission.ttft_headroom_fraction", ad["ttft_headroom_fraction"],
                                              minimum=0, maximum=0.9)),
        serve_half_life_s=float(c.number("admission.serve_half_life_seconds", ad["serve_half_life_seconds"],
                                         minimum=1)),
        backfill=c.flag("admission.backfill", ad["backfill"]),
        backfill_scan=int(c.number("admission.backfill_scan", ad["backfill_scan"], minimum=1, integer=True)),
        lifo_after_ms=float(c.number("admission.lifo_after_ms", ad["lifo_after_ms"], minimum=0)),
        lifo_deadline_fraction=float(c.number("admission.lifo_deadline_fraction", ad["lifo_deadline_fraction"],
                                              minimum=0)),
        overload_shed_after_ms=float(c.number("admission.overload_shed_after_ms", ad["overload_shed_after_ms"],
                                              minimum=0)),
        overload_shed_services=float(c.number("admission.overload_shed_services", ad["overload_shed_services"],
                                              minimum=0)),
        shed_decision_s=float(c.number("admission.shed_decision_seconds", ad["shed_decision_seconds"], minimum=0)),
        prefix_routing=c.flag("admission.prefix_routing", ad["prefix_routing"]),
        prefix_block_chars=int(c.number("admission.prefix_block_chars", ad["prefix_block_chars"], minimum=16,
                                        integer=True)),
        prefix_max_blocks=int(c.number("admission.prefix_max_blocks", ad["prefix_max_blocks"], minimum=1,
                                       maximum=4096, integer=True)),
        prefix_max_replicas=int(c.number("admission.prefix_max_replicas", ad["prefix_max_replicas"], minimum=0,
                                         integer=True)),
        prefix_load_headroom=float(c.number("admission.prefix_load_headroom", ad["prefix_load_headroom"],
                                            minimum=0.0)),
        prefix_index_blocks=int(c.number("admission.prefix_index_blocks", ad["prefix_index_blocks"], minimum=0,
                                         integer=True)),
        prefix_eviction_charge=float(c.number("admission.prefix_eviction_charge", ad["prefix_eviction_charge"],
                                              minimum=0)),
    )
    if policy["retry_after_min_s"] > policy["retry_after_max_s"]:
        c.problems.append("admission.retry_after_min_seconds: must not exceed admission.retry_after_max_seconds")
    models: dict[str, ModelPolicy] = {}
    raw_models = raw.get("models") or {}
    if not isinstance(raw_models, dict):
        c.problems.append("models: must be a mapping of model id -> settings")
        raw_models = {}
    for model_id, path, fields in c.entries("models", raw_models, _MODEL_FIELDS):
        values: dict[str, Any] = {}
        for key, integer in (("decode_floor_tokens_per_s", False), ("solo_decode_tokens_per_s", False),
                             ("kv_bytes_per_token", True), ("max_ttft_ms", True)):
            if fields.get(key) is not None:
                values[key] = c.number(f"{path}.{key}", fields[key], minimum=1 if integer else 0.001, integer=integer)
        models[str(model_id)] = ModelPolicy(**values)
    floors: list[tuple[str, str]] = []
    raw_floors = raw.get("version_floors") or {}
    if not isinstance(raw_floors, dict):
        c.problems.append("version_floors: must be a mapping of model pattern -> minimum engine version")
        raw_floors = {}
    for pattern, version in raw_floors.items():
        if not isinstance(version, (str, int, float)) or not version_key(str(version)):
            c.problems.append(f"version_floors.{pattern}: {version!r} is not a version")
            continue
        floors.append((str(pattern), str(version)))
    boxes: list[Box] = []
    raw_boxes = raw.get("boxes") or []
    if not isinstance(raw_boxes, list):
        c.problems.append("boxes: must be a list")
        raw_boxes = []
    placed: set[str] = set()
    for i, path, item in c.entries("boxes", raw_boxes, _BOX_FIELDS):
        members = item.get("engines")
        if not isinstance(members, list) or not members:
            c.problems.append(f"{path}.engines: must be a non-empty list of engine names")
            members = []
        for name in members:
            if name not in engine_names:
                c.problems.append(f"{path}.engines: unknown engine {name!r}")
            if name in placed:
                c.problems.append(f"{path}.engines: engine {name!r} is already in another box")
            placed.add(name)
        tokens, size = item.get("kv_budget_tokens"), item.get("kv_budget_bytes")
        if tokens is None and size is None:
            c.problems.append(f"{path}: needs kv_budget_tokens or kv_budget_bytes")
        if tokens is not None:
            tokens = int(c.number(f"{path}.kv_budget_tokens", tokens, minimum=1, integer=True))
        if size is not None:
            size = int(c.number(f"{path}.kv_budget_bytes", size, minimum=1, integer=True))
            if not any(m.kv_bytes_per_token for m in models.values()) and tokens is None:
                c.problems.append(f"{path}.kv_budget_bytes: needs models.<id>.kv_bytes_per_token for at least one model")
        boxes.append(Box(str(item.get("name") or f"box{i}"), tuple(members), tokens, size))
    return Policy(**policy, models=models, version_floors=tuple(floors), boxes=tuple(boxes))


_ENGINE_FIELDS = {"name", "url", "max_num_seqs", "models", "sim", "speed", "flavor", "chip_class", "sim_flavor",
                  "prefill_tokens_per_s", "decode_tokens_per_s", "sim_model", "max_loras"}


def _parse_engines(c: _Checker, raw: Any) -> tuple[EngineConfig, ...]:
    if not isinstance(raw, list) or not raw:
        c.problems.append("engines: must be a non-empty list")
        return ()
    engines: list[EngineConfig] = []
    names: set[str] = set()
    for _, path, item in c.entries("engines", raw, _ENGINE_FIELDS):
        name = c.text(f"{path}.name", item.get("name"))
        if name and (not _NAME_RE.match(name) or name.startswith(_RESERVED_PREFIX)):
            c.problems.append(
                f"{path}.name: {name!r} must match {_NAME_RE.pattern} and not start with {_RESERVED_PREFIX!r}"
            )
        if name in names:
            c.problems.append(f"{path}.name: duplicate engine name {name!r}")
        names.add(name)
        url = c.text(f"{path}.url", item.get("url"))
        host, port = _host_port(c, f"{path}.url", url) if url else ("", 0)
        seqs = item.get("max_num_seqs")
        if seqs is not None:
            seqs = int(c.number(f"{path}.max_num_seqs", seqs, minimum=1, integer=True))
        loras = item.get("max_loras")
        if loras is not None:
            loras = int(c.number(f"{path}.max_loras", loras, minimum=1, integer=True))
        models = item.get("models", [])
        if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
            c.problems.append(f"{path}.models: must be a list of model ids")
            models = []
        sim = item.get("sim")
        if sim is not None and (not isinstance(sim, str) or not sim):
            # Which profiles exist is the simulator launcher's business (sluice/simulated.py), not the control plane's.
            c.problems.append(f"{path}.sim: must be a simulator profile name, got {sim!r}")
            sim = None
        speed = float(c.number(f"{path}.speed", item.get("speed", 1.0), minimum=0.001))
        flavor = c.choice(f"{path}.flavor", item.get("flavor", "auto"), EngineFlavor)
        sim_flavor = c.choice(f"{path}.sim_flavor", item.get("sim_flavor", "vllm-v1"), SimFlavor)
        chip_class = item.get("chip_class", name)
        if not isinstance(chip_class, str) or not chip_class:
            c.problems.append(f"{path}.chip_class: must be a non-empty string")
            chip_class = name
        anchors = [float(c.number(f"{path}.{key}", item[key], minimum=0.001)) if item.get(key) is not None else None
                   for key in ("prefill_tokens_per_s", "decode_tokens_per_s")]
        sim_model = item.get("sim_model")
        if sim_model is not None and (not isinstance(sim_model, str) or not sim_model):
            c.problems.append(f"{path}.sim_model: must be a model id")
            sim_model = None
        engines.append(EngineConfig(
            name, url, host, port, seqs, tuple(models), sim, speed, flavor, chip_class, sim_flavor,
            prefill_tokens_per_s=anchors[0], decode_tokens_per_s=anchors[1], sim_model=sim_model, max_loras=loras,
        ))
    return tuple(engines)


def _host_port(c: _Checker, path: str, url: str) -> tuple[str, int]:
    """``url``'s host (a name stays a name: ``resolve_engines`` turns it into an address) and port."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        c.problems.append(f"{path}: must be an http:// URL with a host, got {url!r}")
        return "", 0
    try:
        port = parts.port if parts.port is not None else 80
    except ValueError:
        c.problems.append(f"{path}: bad port in {url!r}")
        return "", 0
    if port == 0:
        c.problems.append(f"{path}: an engine's URL needs its real port, got {url!r}")
        return "", 0
    return parts.hostname, port


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback address (127.0.0.0/8, ::1); a wildcard (``0.0.0.0``, ``::``) or any other host is not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


async def resolve_engines(config: Config) -> Config:
    """``config`` with every engine's hostname resolved to an address (``loop.getaddrinfo``, all engines at once); raise
    ``ConfigError`` naming each engine whose host does not resolve (``engines[i].url: cannot resolve ...``). An engine
    whose host already is an address is kept as is, so resolving twice costs nothing."""
    loop = asyncio.get_running_loop()

    async def address(engine: EngineConfig) -> str:
        infos = await loop.getaddrinfo(engine.host, engine.port, type=socket.SOCK_STREAM)
        return str(infos[0][4][0])

    named = [(i, e) for i, e in enumerate(config.engines) if e.host and not _is_address(e.host)]
    if not named:
        return config
    answers = await asyncio.gather(*(address(e) for _, e in named), return_exceptions=True)
    engines = list(config.engines)
    problems = []
    for (i, engine), answer in zip(named, answers):
        if isinstance(answer, BaseException):
            if not isinstance(answer, OSError):
                raise answer
            problems.append(f"engines[{i}].url: cannot resolve {engine.host!r}: {answer}")
        else:
            engines[i] = replace(engine, host=answer)
    if problems:
        raise ConfigError(problems)
    return replace(config, engines=tuple(engines))


def read_raw(path: str | None) -> tuple[Any, str]:
    """The YAML mapping at ``path`` (the bundled default when None) and the source name a config keeps."""
    if path is None:
        text = (Path(__file__).parent / BUNDLED_CONFIG).read_text()
        source = f"bundled:{BUNDLED_CONFIG}"
    else:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError([f"(file): cannot read {path}: {exc}"]) from None
        source = path
    try:
        return yaml.safe_load(text), source
    except yaml.YAMLError as exc:
        raise ConfigError([f"(yaml): {exc}"]) from None


def load_config(path: str | None) -> Config:
    """Load and validate ``path``, or the bundled embedded default when ``path`` is None. Engine hostnames are not
    resolved: run ``resolve_engines`` on the result (or use ``load_resolved_config``) before anything uses them."""
    raw, source = read_raw(path)
    config = parse_config(raw, source)
    return config


async def load_resolved_config(path: str | None) -> Config:
    """``load_config`` (the file read in a thread) then ``resolve_engines``: what a control plane runs at start-up and on a
    reload, without blocking its event loop. Raises ``ConfigError``."""
    return await resolve_engines(await asyncio.to_thread(load_config, path))


def resolve_engines_blocking(config: Config) -> Config:
    """``resolve_engines`` for synchronous callers (CLIs before they start anything). Runs the resolution on an event loop
    of its own in a worker thread, so it works whether or not the caller's thread runs a loop."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="resolve") as pool:
        return pool.submit(asyncio.run, resolve_engines(config)).result()
