"""The sections a process reads once, when it starts: the control plane's listeners, the admin API, Envoy, observation,
tickets, the shared store, the tenants' limiter and tracing. Each field is a key (its docstring's first paragraph is the
reference's meaning); ``observe.on_stale`` alone is reloadable (``RELOADABLE``)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from controlplane.config.enums import (
    OnFailure, OnStale, ProbeProcess, RateLimitOnFailure, StoreBackend, StoreOnFailure, WorkerPriority,
)
from controlplane.config.setting import setting
from controlplane.names import CLIENT_HEADERS

ANY_PORT = setting(minimum=0, maximum=65535)
"""A TCP port, or 0: any free port, which the process reports (the tests bind every server that way)."""
PORT = setting(minimum=1, maximum=65535)


@dataclass(frozen=True, slots=True)
class ServerTls:
    """A gRPC listener's TLS (``controlplane.tls``, ``admin.tls``): its certificate chain and key (PEM files), and for
    mutual TLS the CA whose signature a client's certificate must carry (then a client without one cannot connect). Files
    are read when the server starts, not when the config is validated."""

    cert_file: str
    """The listener's certificate chain (PEM); with ``key_file``: TLS is all or nothing."""
    key_file: str
    """Its private key (PEM)."""
    client_ca_file: str | None = None
    """Mutual TLS: the CA that must have signed a client's certificate (a client without one cannot connect)."""

    @property
    def mutual(self) -> bool:
        return self.client_ca_file is not None


@dataclass(frozen=True, slots=True)
class ClientTls:
    """``envoy.controlplane_tls``: how Envoy's ``sluice_controlplane`` cluster (ADS, ext_authz, access log) speaks TLS."""

    ca_file: str
    """The CA that signed the control plane's certificate."""
    cert_file: str | None = None
    """Envoy's client certificate, for mutual TLS (with ``key_file``)."""
    key_file: str | None = None
    """Its private key."""
    server_name: str | None = None
    """The name the control plane's certificate must carry (SNI and the subject alternative name checked); none: the
    control plane's host."""


@dataclass(frozen=True, slots=True)
class ReplicaAddress:
    """One control-plane replica as Envoy reaches it: gRPC (ADS, ext_authz, access log) and HTTP (the retry redirector)."""

    host: str = field(metadata=setting(default="`controlplane.host`"))
    """The replica's address."""
    grpc_port: int = field(metadata=PORT)
    """Its ``controlplane.grpc_port``."""
    metrics_port: int = field(metadata=PORT)
    """Its ``controlplane.metrics_port`` (the retry redirector)."""


@dataclass(frozen=True, slots=True)
class ControlPlaneConfig:
    """The control plane's listeners, its overload answers and its replicas."""

    host: str = "127.0.0.1"
    """Address the control plane binds."""
    grpc_port: int = field(default=18000, metadata=ANY_PORT)
    """ADS, ext_authz and the access log (the port Envoy calls); 0: any free port (the process reports it)."""
    metrics_port: int = field(default=9090, metadata=ANY_PORT)
    """Prometheus ``/metrics``, ``/healthz``, and the retry redirector Envoy's retries reach; 0: any free port."""
    max_check_queue_ms: float = field(default=1000.0, metadata=setting(minimum=1))
    """A Check whose handler starts more than this long after Envoy sent it (read from the gRPC deadline Envoy sets) is
    shed at once with 503 ``controlplane_overloaded``: an overloaded control plane answers, it never times out."""
    overload_retry_after_seconds: int = field(default=1, metadata=setting(minimum=1))
    """Retry-After on ``controlplane_overloaded``."""
    max_pending_rpcs: int = field(default=100000, metadata=setting(minimum=1000))
    """grpc-core's pending-call limits (soft and hard): calls beyond them are cancelled by gRPC itself, which Envoy would
    treat as an ext_authz error. Sized well above every parking lot together."""
    stop_step_seconds: float = field(default=5.0, metadata=setting(minimum=0.1, maximum=600))
    """Shutdown: each step (background tasks, the store, observation, the servers, the limiter, tracing) gets at most
    this long; one that overruns is abandoned with a warning, so a stop never hangs on a dead store."""
    admin_host: str = "127.0.0.1"
    """The admin API's own listener (never the Envoy-facing port); a non-loopback address needs an admin token source
    (``admin.token_file`` or ``admin.token_env``)."""
    admin_port: int = field(default=18001, metadata=ANY_PORT)
    """The admin API's port; 0: any free port (the control plane reports the one it bound, like ``grpc_port``)."""
    tls: ServerTls | None = None
    """TLS on the Envoy-facing gRPC port (ADS, ext_authz, access log); with ``client_ca_file``, mutual TLS: only a client
    (Envoy) whose certificate that CA signed gets a connection. None: plaintext."""
    replicas: tuple[ReplicaAddress, ...] = ()
    """Every control-plane replica sharing one store, this one included (empty: this one alone).

    Envoy's bootstrap lists each replica's gRPC address in the control plane's cluster, and every replica publishes every
    replica's redirector, so all replicas serve identical xDS resources (same content hashes, same versions)."""

    def addresses(self, bound_metrics_port: int | None = None) -> tuple[ReplicaAddress, ...]:
        """The replicas Envoy uses: the configured list, or this control plane alone."""
        return self.replicas or (ReplicaAddress(self.host, self.grpc_port, bound_metrics_port or self.metrics_port),)


@dataclass(frozen=True, slots=True)
class AdminConfig:
    """Who may use the admin API. A token is a line ``name:secret`` (or just ``secret``, named ``default``); a token file
    holds one per line (``#`` comments allowed), the environment variable one. Mutating calls (reload, drain, undrain,
    floors) always need a token; with no token source configured they are all refused."""

    token_file: str | None = None
    """A file of admin tokens, one per line."""
    token_env: str | None = None
    """An environment variable holding one admin token."""
    require_token_for_reads: bool = False
    """Reads (status, engines, explain, policy, watch) need a token too."""
    reload_dir: str | None = None
    """A reload may name the running config file, or a file under this directory; no other path (none: only the running
    file)."""
    tls: ServerTls | None = field(default=None, metadata=setting(keys=("cert_file", "key_file")))
    """TLS on the admin listener (server certificate only: callers authenticate with the bearer token; ``sluice admin
    --ca-file``)."""

    @property
    def has_token_source(self) -> bool:
        return bool(self.token_file or self.token_env)


@dataclass(frozen=True, slots=True)
class EnvoyConfig:
    """Envoy's listener, its limits and timeouts, and what it does when the control plane does not answer."""

    listen_host: str = "127.0.0.1"
    """Address of the OpenAI-compatible listener clients call."""
    listen_port: int = field(default=8080, metadata=ANY_PORT)
    """Its port; 0: any free port (shown in Envoy's admin ``/listeners``)."""
    admin_port: int = field(default=9901, metadata=ANY_PORT)
    """Envoy's admin (``/config_dump``, ``/stats``), loopback only; 0: any free port (``--admin-address-path``)."""
    max_request_bytes: int = field(default=1048576, metadata=setting(minimum=1024))
    """Bodies larger than this get 413 from Envoy before any Check (bytes)."""
    access_log_flush_seconds: float = field(default=0.005, metadata=setting(minimum=0.001))
    """How often Envoy sends the access-log entries it has buffered; with ``access_log_buffer_bytes`` 1 every entry has
    already gone out when its stream ended, so this matters only for larger buffers."""
    access_log_buffer_bytes: int = field(default=1, metadata=setting(minimum=1, maximum=16 * 1024 * 1024))
    """Envoy sends its buffered access-log entries once they reach this many bytes (the ALS ``buffer_size_bytes``), besides
    every ``access_log_flush_seconds``; 1: each entry the moment its stream ends, so a ticket's release (and the wake of a
    request parked for its slot) waits for no timer (decision 0022). Larger: fewer gRPC messages at high request rates,
    each release up to ``access_log_flush_seconds`` later.

    Failure mode either way: when the control plane reads the log stream too slowly and it backs up, Envoy drops entries
    (its ``logs_dropped`` counter; with 1 no batch buffer absorbs a moment's backlog), and their tickets are reaped by an
    idle probe (``tickets.idle_reap_grace_seconds``) or their lease."""
    stream_idle_timeout_seconds: float = field(default=300.0, metadata=setting(minimum=1))
    """Longest silence on a stream (between tokens, or while a Check is pending) before Envoy resets it; Envoy's Check
    timeout is this less 10 s."""
    connect_timeout_seconds: float = field(default=1.0, metadata=setting(minimum=0.01))
    """Connect timeout to an engine."""
    preempt_message_timeout_ms: int = field(default=500, metadata=setting(minimum=1, maximum=10_000))
    """How long Envoy's ext_proc filter waits for the control plane's answer to each message of a preemptible stream
    (``fairness.preempt_sheddable``: its headers and every response chunk, decision 0028); past it the stream runs on
    unprocessed, and can no longer be preempted."""
    client_headers_kept: tuple[str, ...] = CLIENT_HEADERS
    """``x-sluice-*`` request headers a client may send (inputs, never routing); every other one is stripped."""
    on_controlplane_failure: OnFailure = OnFailure.OPEN
    """``open``: Envoy routes unpinned requests by each model's last capacity weights; ``closed``: 503 + Retry-After."""
    failure_retry_after_seconds: int = field(default=5, metadata=setting(minimum=1))
    """Retry-After on the fail-closed 503."""
    weight_change_threshold: float = field(default=0.10, metadata=setting(minimum=0))
    """Fallback weights are re-pushed over RDS only when one moves by more than this fraction."""
    max_downstream_connections: int = field(default=50000, metadata=setting(minimum=1))
    """Client connections Envoy accepts at once (overload manager); more are refused."""
    engine_overflow_headroom: int = field(default=2, metadata=setting(minimum=0))
    """Envoy's per-engine circuit breaker allows the engine's cap plus this many requests at once; beyond it Envoy answers
    503 ``engine_overloaded`` + Retry-After itself. Admitted traffic never reaches it: it bounds the fail-open path."""
    engine_max_requests_unknown_cap: int = field(default=256, metadata=setting(minimum=1))
    """The per-engine circuit breaker of an engine whose cap is neither configured nor reported."""
    request_headers_timeout_seconds: float = field(default=10.0, metadata=setting(minimum=0.1))
    """A client must finish sending its request headers within this long (else 408 ``request_timeout``)."""
    concurrency: int = field(default=2, metadata=setting(minimum=1))
    """Envoy's worker threads (its ``--concurrency``, in ``sluice up``, the test harness and the rendered Kubernetes
    Deployment). Each keeps its own connection pool per engine; set it to the cores Envoy may use (the benchmark hosts
    have 2)."""
    delayed_close_timeout_seconds: float = field(default=0.0, metadata=setting(minimum=0))
    """How long Envoy waits for a client to close a connection Envoy is closing (0: close once the response is flushed;
    a timer runs while the response waits to be flushed, so a short one can lose answers; decision 0003)."""
    retry_on_engine_failure: bool = True
    """An engine that fails before its first byte (connect failure, reset, 503) is retried once on another engine through
    a new Check (an internal redirect), never on the same engine."""
    controlplane_tls: ClientTls | None = None
    """Envoy's TLS to the control plane's gRPC port (the bootstrap cluster's ``transport_socket``); needed exactly when
    ``controlplane.tls`` is set, with a client certificate when that asks for one."""


PROBE_PROCESS_MIN_ENGINES = 64
"""``observe.probe_process: auto`` probes in a worker process from this many engines on: below it one event loop does
both comfortably, and a process costs memory of its own (bench/results/scale.md)."""


@dataclass(frozen=True, slots=True)
class ObserveConfig:
    """How each engine's ``/metrics``, ``/v1/models`` and ``/version`` are probed, and what its measured rates need."""

    poll_interval_seconds: float = field(default=1.0, metadata=setting(minimum=0.05))
    """``/metrics`` cadence per engine."""
    poll_timeout_seconds: float = field(default=0.8, metadata=setting(minimum=0.01))
    """Bound on one probe (at most ``poll_interval_seconds``)."""
    stale_after_polls: int = field(default=3, metadata=setting(minimum=1))
    """Missed intervals before an engine is stale."""
    models_refresh_seconds: float = field(default=10.0, metadata=setting(minimum=0.1))
    """``/v1/models`` + ``/version`` cadence; stretched with the poll interval past the probe budget (``for_fleet``)."""
    max_backoff_seconds: float = field(default=10.0, metadata=setting(minimum=0.05))
    """Cap on the retry delay after failures."""
    on_stale: OnStale = OnStale.OPEN
    """``open``: a stale engine is still admitted to (after fresh ones); ``closed``: never."""
    rate_ring_size: int = field(default=64, metadata=setting(minimum=1))
    """Samples kept per (model, chip class) for the prefill and solo-decode medians."""
    rate_min_samples: int = field(default=5, metadata=setting(minimum=1))
    """A median is trusted only from this many samples on (at most ``rate_ring_size``)."""
    prefill_sample_min_tokens: int = field(default=256, metadata=setting(minimum=0))
    """A prefill-rate sample needs at least this many prompt tokens in its interval (tiny prompts mislead)."""
    probe_process: ProbeProcess = ProbeProcess.AUTO
    """Where probes run (``controlplane/observe/worker.py``): ``auto`` (a worker process from
    ``PROBE_PROCESS_MIN_ENGINES`` engines on), ``on``, ``off`` (on the control plane's event loop)."""
    max_probes_per_second: float = field(default=300.0, metadata=setting(minimum=0))
    """The fleet's probe budget (0: none). With more engines than ``poll_interval_seconds`` x this, each engine is polled
    every ``engines / max_probes_per_second`` seconds instead (``for_fleet``), and goes stale after ``stale_after_polls``
    of those."""
    probe_wave_seconds: float = field(default=0.1, metadata=setting(minimum=0))
    """In the probe worker, probes fall due on each engine's own schedule and start together on the next multiple of
    this (on the monotonic clock; 0: each on its own timer); at most a quarter of the poll interval (``wave_s``). Probes on
    the control plane's own loop never wave (decision 0012)."""
    worker_priority: WorkerPriority = WorkerPriority.IDLE
    """The probe worker's CPU scheduling (``observe/worker.py``, ``WORKER_NICE``): ``idle`` (Linux ``SCHED_IDLE``, at nice
    10 elsewhere or when it is refused) runs probes only on CPU nothing else wants; ``nice`` keeps it a normal process at
    nice 10 (decision 0011).

    The failure mode: on a host whose cores are all busy an idle worker gets almost no CPU, so it watches its own
    lateness and, once ``worker_starved_after_seconds`` late, stops; the control plane restarts it at nice 10 for
    ``WORKER_IDLE_RETRY_S`` (``sluice_probe_worker_starved_total`` counts it)."""
    worker_starved_after_seconds: float = field(default=2.0, metadata=setting(minimum=0.05))
    """How late the idle probe worker's own timer may fire before it counts as starved and is restarted at nice 10."""
    filter_metrics: bool = True
    """Ask vLLM engines for only the samples sluice reads (``/metrics?name[]=...``, prometheus_client's own filter): about
    6 KB a probe instead of 54 KB for vLLM 0.11; an engine that refuses the query or whose filtered answer lacks a required gauge
    is probed whole from then on (``EnginePoller.poll_once``). Off: every probe fetches the whole exposition."""

    @property
    def wave_s(self) -> float:
        """The probe wave in effect: ``probe_wave_seconds``, at most a quarter of the poll interval.

        Probes that start together share the event loop's turns and the worker's writes to the control plane; each engine
        is still probed once per interval on average (only the start waits, up to one wave). Only the probe worker runs
        waves: on the control plane's own loop a wave's parses would hold the loop that answers Checks."""
        return min(self.probe_wave_seconds, self.poll_interval_seconds / 4)

    def for_fleet(self, engines: int) -> ObserveConfig:
        """This config as a fleet of ``engines`` runs it: the poll interval stretched to keep the fleet's probes within
        ``max_probes_per_second``, and discovery (``models_refresh_seconds``) stretched by the same factor.

        The failure mode: a model or version change is seen up to ``models_refresh_seconds`` x the factor later
        (bench/results/scale.md has the probe costs behind the budget)."""
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


@dataclass(frozen=True, slots=True)
class TicketConfig:
    """Tickets: an admission's hold on its engine's slot, released by the request's access-log entry."""

    lease_seconds: float = field(default=900.0, metadata=setting(minimum=1))
    """A ticket whose access-log entry never arrives is reaped after this long."""
    reap_interval_seconds: float = field(default=5.0, metadata=setting(minimum=0.01))
    """How often leases are checked."""
    idle_reap_grace_seconds: float = field(default=5.0, metadata=setting(minimum=0.1))
    """An engine probed idle (nothing running, nothing waiting) closes its tickets older than this."""


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Where the ledger lives (see "Replicas and the shared store" in docs/architecture.md)."""

    backend: StoreBackend = StoreBackend.MEMORY
    """``memory`` (one process) or ``valkey`` (Valkey or Redis, shared by every replica)."""
    url: str | None = None
    """``redis://host:port/db`` (``rediss://`` for TLS, or ``unix://``); with ``valkey`` and none, ``sluice up`` starts a
    server."""
    prefix: str = "sluice"
    """Every key and the event channel start with this (several sluice deployments may share one server)."""
    replica_id: str | None = field(default=None, metadata=setting(default="host-pid-random"))
    """This replica's name in the store (heartbeat, parked members) and in ``sluice_replica_info``; without ``|`` or
    ``:``."""
    on_failure: StoreOnFailure = StoreOnFailure.OPEN
    """Store unreachable: ``open`` admits on this replica's ledger (counted, written back when it returns); ``closed``:
    503 ``store_unavailable``."""
    timeout_seconds: float = field(default=0.5, metadata=setting(minimum=0.01))
    """One store call's bound; past it the call counts as a failure (``on_failure``)."""
    heartbeat_seconds: float = field(default=0.05, metadata=setting(minimum=0.05))
    """How often a replica says it is alive (from a thread of its own); each time it also looks for dead replicas."""
    dead_after_beats: int = field(default=5, metadata=setting(minimum=2))
    """A replica silent for this many heartbeats is dead: its parked requests leave every line at once (its tickets
    stay)."""
    session_ttl_seconds: float = field(default=3600.0, metadata=setting(minimum=1))
    """How long a session's engine is remembered in the store."""
    reserve_attempts: int = field(default=3, metadata=setting(minimum=1))
    """Admissions tried per Check when other replicas keep taking the chosen slot first; then the request parks."""
    claim_seconds: float = field(default=0.25, metadata=setting(minimum=0))
    """How long an admission the store refused only for the line stays with the parked request as its claim: the store
    admits it when the request heads the line within that time and it still fits (controlplane/store/base.py). 0: no
    claims (each parked request waits for its own replica's wake)."""
    max_connections: int = field(default=64, metadata=setting(minimum=1))
    """Connections a replica opens to the store at most; calls beyond wait for one (up to ``timeout_seconds``)."""


@dataclass(frozen=True, slots=True)
class RateLimitConfig:
    """How the tenants' limiter (``ratelimit/``) runs. Its store is the ledger's: the Valkey at ``store.url`` when
    ``store.backend`` is ``valkey`` (so every replica draws on one budget), else this process's memory. The tenants and
    their limits are reloadable; this section is not."""

    on_failure: RateLimitOnFailure = RateLimitOnFailure.OPEN
    """The limiter's store unreachable: ``open`` admits uncharged (counted); ``closed``: 503 ``ratelimit_unavailable``."""
    timeout_seconds: float = field(default=0.5, metadata=setting(minimum=0.01))
    """One limiter call's bound (pool wait, connect, reply); past it the call fails and ``on_failure`` applies."""
    max_connections: int = field(default=64, metadata=setting(minimum=1))
    """Connections to the limiter's Valkey per replica; a call beyond them waits for one, and redis-py's pool does not hand
    them out in order, so this should cover the Checks a replica charges at once."""
    failure_retry_after_seconds: int = field(default=1, metadata=setting(minimum=1))
    """Retry-After on ``ratelimit_unavailable`` (``on_failure: closed``)."""
    concurrency_retry_after_seconds: float = field(default=1.0, metadata=setting(minimum=0.001))
    """Retry-After of a refusal by ``concurrent_requests`` (when a slot frees is not predictable)."""


@dataclass(frozen=True, slots=True)
class TracingConfig:
    """OpenTelemetry traces of the Checks, opt-in (``controlplane/tracing.py``). Off, a Check costs nothing more. On,
    every Check is one span (a child of the client's W3C ``traceparent`` when it sends one) exported over OTLP/HTTP (JSON)
    in batches, and an admitted request reaches its engine with a ``traceparent`` naming that span."""

    enabled: bool = False
    """A span per Check, exported over OTLP/HTTP (JSON); the engine gets a ``traceparent`` under it."""
    otlp_endpoint: str = "http://127.0.0.1:4318/v1/traces"
    """The collector's OTLP/HTTP traces URL, path included. Headers a collector wants (credentials) come from the
    standard ``OTEL_EXPORTER_OTLP_TRACES_HEADERS`` variable, so they stay out of the file."""
    service_name: str = "sluice-controlplane"
    """The spans' ``service.name``."""
    sample_ratio: float = field(default=1.0, metadata=setting(minimum=0, maximum=1))
    """Share of Checks traced among those that arrive without a ``traceparent``; a client's own sampled flag is followed
    (parent-based sampling), so a trace the client records is never cut at the gateway."""
    export_timeout_seconds: float = field(default=10.0, metadata=setting(minimum=0.1))
    """Longest one batch export may take (retries included); also bounds how long a stopping control plane flushes."""
