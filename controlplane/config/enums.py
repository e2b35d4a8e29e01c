"""The closed sets of strings a config may name, each an ``enum.StrEnum``: a member is its string wherever it leaves (YAML,
metric labels, logs), and the reference lists its values."""

from __future__ import annotations

import enum

from controlplane.core.engines import Flavor


class OnFailure(enum.StrEnum):
    """``envoy.on_controlplane_failure``: what Envoy does when the control plane does not answer a Check."""

    OPEN = "open"
    """Unpinned requests follow each model's last capacity weights."""
    CLOSED = "closed"
    """503 + Retry-After."""


class OnStale(enum.StrEnum):
    """``observe.on_stale``: whether an engine whose probes stopped answering is still admitted to."""

    OPEN = "open"
    """Still admitted, after fresh engines."""
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


class ProbeProcess(enum.StrEnum):
    """``observe.probe_process``: where probes run."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"


class WorkerPriority(enum.StrEnum):
    """``observe.worker_priority``: the probe worker's CPU scheduling."""

    IDLE = "idle"
    NICE = "nice"


class StoreBackend(enum.StrEnum):
    """``store.backend``: where the ledger lives."""

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


class RateLimitOnFailure(enum.StrEnum):
    """``ratelimit.on_failure``: what a tenant's request gets while the limiter's store cannot be reached."""

    OPEN = "open"
    """Admitted uncharged (counted in ``sluice_ratelimit_errors_total`` and as ``store_error`` decisions)."""
    CLOSED = "closed"
    """503 ``ratelimit_unavailable`` + retry-after."""
