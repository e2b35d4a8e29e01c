"""One fake per port the unit tests stand in for: the grpc.aio servicer context a servicer's method receives
(``FakeContext``), and what the admission service reads from observation (``FakeObservation``). Each fake does what
the code under test calls and nothing more (what no servicer calls on its context raises ``NotImplementedError``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NoReturn

import grpc

from controlplane.core.admission import AdmissionCore
from controlplane.core.engines import EngineSample, EngineView, ServedModel
from controlplane.core.fleet import Fleet


class AbortedError(Exception):
    """What ``FakeContext.abort`` raises (a real context raises grpc's own, ending the call)."""


class FakeContext(grpc.aio.ServicerContext[Any, Any]):
    """A servicer context: the time its deadline leaves (``remaining``, None: no deadline), the bearer token its call
    carries (``token``, None: none) and ``abort``, which keeps the status code in ``aborted_code`` and raises
    AbortedError."""

    def __init__(self, remaining: float | None = None, *, token: str | None = "operator-secret") -> None:
        self.remaining = remaining
        self.metadata = grpc.aio.Metadata(("authorization", f"Bearer {token}")) if token else grpc.aio.Metadata()
        self.aborted_code: grpc.StatusCode | None = None

    # grpc.aio answers None without a deadline (the servicer checks for it); types-grpcio says float.
    def time_remaining(self) -> float | None:  # type: ignore[override]
        return self.remaining

    def invocation_metadata(self) -> grpc.aio.Metadata:
        return self.metadata

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: object = ()) -> NoReturn:
        self.aborted_code = code
        raise AbortedError(details)

    async def abort_with_status(self, status: grpc.Status) -> NoReturn:
        raise NotImplementedError

    async def read(self) -> Any:
        raise NotImplementedError

    async def write(self, message: object) -> None:
        raise NotImplementedError

    async def send_initial_metadata(self, initial_metadata: object) -> None:
        raise NotImplementedError

    def set_trailing_metadata(self, trailing_metadata: object) -> None:
        raise NotImplementedError

    def set_code(self, code: grpc.StatusCode) -> None:
        raise NotImplementedError

    def set_details(self, details: str) -> None:
        raise NotImplementedError

    def set_compression(self, compression: grpc.Compression) -> None:
        raise NotImplementedError

    def disable_next_message_compression(self) -> None:
        raise NotImplementedError

    def peer_identities(self) -> Iterable[bytes] | None:
        raise NotImplementedError

    def peer_identity_key(self) -> str | None:
        raise NotImplementedError

    def auth_context(self) -> Mapping[str, Iterable[bytes]]:
        raise NotImplementedError


class FakeObservation:
    """What the admission service reads from observation: fixed views of engines serving ``m`` (the probe saw nothing
    running at time 0), ``caps``: engine -> its cap, each with ``kv_capacity_tokens`` of KV cache. The service's
    parameter is the concrete ``Observation`` (no port), so callers pass this one through ``cast``."""

    def __init__(self, core: AdmissionCore, caps: Mapping[str, int], kv_capacity_tokens: int) -> None:
        self.core = core
        self.views = {
            name: EngineView(name=name, url="", max_num_seqs=cap, models=(ServedModel("m", 32_768),), version="1.0",
                             sample=EngineSample(0.0, running=0, waiting=0, kv_usage=0.0,
                                                 kv_capacity_tokens=kv_capacity_tokens),
                             last_ok_at=0.0, stale=False, chip_class=name)
            for name, cap in caps.items()}

    def fleet(self, now: float) -> Fleet:
        return self.core.fleet(self.views.values(), now)

    def view_of(self, name: str, now: float) -> EngineView | None:
        return self.views.get(name)

    def model_label(self, model: str | None) -> str:
        return model or "-"
