"""Each servicer alone, against a fake of the one port it receives (no control plane, no gRPC server)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp.test_utils import make_mocked_request
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2
from google.protobuf import duration_pb2, struct_pb2

from controlplane.accesslog import AccessLogServicer
from controlplane.admin import AdminServicer
from controlplane.core.model import (
    Decision, EngineSample, EngineView, Fleet, InferenceRequest, Reason, ServedModel, Ticket, Verdict,
)
from controlplane.core.policy import Policy
from controlplane.httpendpoint import HttpEndpoint
from controlplane.metrics import SluiceMetrics
from controlplane.ports import ReloadResult, StatusFacts
from sluice.admin.v1 import admin_pb2


@dataclass
class FakeCompletions:
    """A CompletionPort: knows one open ticket on ``thor``."""

    metrics: SluiceMetrics = field(default_factory=SluiceMetrics)
    open: dict[str, Ticket] = field(default_factory=lambda: {"t1": Ticket("t1", "thor", "cortex", 0.0, 0.0)})
    released: list[str] = field(default_factory=list)
    failures: list[tuple[str, str]] = field(default_factory=list)

    def release_ticket(self, ticket_id: str) -> Ticket | None:
        self.released.append(ticket_id)
        return self.open.pop(ticket_id, None)

    def note_engine_failure(self, engine: str, why: str) -> None:
        self.failures.append((engine, why))

    def knows_engine(self, engine: str) -> bool:
        return engine == "thor"


def entry(*, ticket: str | None, code: int, first_byte: bool, connect_failure: bool = False) -> Any:
    e = accesslog_pb2.HTTPAccessLogEntry()
    e.common_properties.upstream_cluster = "thor"
    if ticket is not None:
        e.common_properties.metadata.filter_metadata["envoy.filters.http.ext_authz"].CopyFrom(
            struct_pb2.Struct(fields={"ticket": struct_pb2.Value(string_value=ticket)}))
    if first_byte:
        e.common_properties.time_to_first_upstream_rx_byte.CopyFrom(duration_pb2.Duration(nanos=1000))
    e.common_properties.response_flags.upstream_connection_failure = connect_failure
    e.response.response_code.value = code
    return e


async def stream(*entries: Any) -> AsyncIterator[als_pb2.StreamAccessLogsMessage]:
    message = als_pb2.StreamAccessLogsMessage()
    message.http_logs.log_entry.extend(entries)
    yield message


async def test_access_log_releases_the_ticket_it_names_and_marks_failed_engines() -> None:
    port = FakeCompletions()
    await AccessLogServicer(port).StreamAccessLogs(stream(
        entry(ticket="t1", code=200, first_byte=True),
        entry(ticket=None, code=503, first_byte=False, connect_failure=True),
        entry(ticket="unknown", code=200, first_byte=True),
    ), None)  # type: ignore[arg-type]
    assert port.released == ["t1", "unknown"]
    assert port.failures and port.failures[0][0] == "thor" and "UF" in port.failures[0][1]
    assert port.metrics.registry.get_sample_value("sluice_access_log_entries_total", {"outcome": "no_ticket"}) == 1
    assert port.metrics.registry.get_sample_value("sluice_access_log_entries_total",
                                                  {"outcome": "unknown_ticket"}) == 1


async def test_redirector_retries_only_a_genuine_attempt() -> None:
    port = FakeCompletions()
    endpoint = HttpEndpoint("127.0.0.1", 0, port.metrics, port)
    forged = await endpoint.retry_redirect(make_mocked_request(
        "POST", "/v1/chat/completions", headers={"x-sluice-engine": "thor", "x-sluice-ticket": "guess", "host": "gw"}))
    assert forged.status == 503 and port.failures == []
    retried = await endpoint.retry_redirect(make_mocked_request(
        "POST", "/v1/chat/completions?x=1", headers={"x-sluice-engine": "thor", "x-sluice-ticket": "t1", "host": "gw"}))
    assert retried.status == 307
    assert retried.headers["location"] == "http://gw/v1/chat/completions?x=1&sluice_avoid=thor"
    assert port.failures and port.failures[0][0] == "thor" and "t1" not in port.open


@dataclass
class FakeAdmin:
    """An AdminPort over one engine."""

    drained: dict[str, bool] = field(default_factory=dict)
    reloads: list[str | None] = field(default_factory=list)

    @property
    def policy(self) -> Policy:
        return Policy()

    def now(self) -> float:
        return 100.0

    def fleet(self, now: float) -> Fleet:
        view = EngineView("thor", "http://thor", 2, (ServedModel("cortex", 4096),), "0.11.0",
                          EngineSample(now, running=1, waiting=0), last_ok_at=now - 0.5, stale=False,
                          drained=self.drained.get("thor", False), chip_class="thor")
        return Fleet((view,))

    def status(self, now: float) -> StatusFacts:
        return StatusFacts("1.2.3", 42.0, 3, 10, 7, 0, 1, (), 1)

    def open_tickets(self, engine: str) -> int:
        return 3

    def medians(self, model: str, chip_class: str) -> tuple[float | None, float | None]:
        return 900.0, None

    async def set_drained(self, name: str, drained: bool) -> bool:
        if name != "thor":
            return False
        self.drained[name] = drained
        return True

    def decide_for(self, request: InferenceRequest, now: float) -> tuple[Decision, int]:
        return Decision(Verdict.ADMIT, Reason.FINISH_SOONEST, engine="thor"), 2

    async def reload(self, path: str | None) -> ReloadResult:
        self.reloads.append(path)
        return ReloadResult(False, ("admission.x: unknown field",), (), path or "f.yaml")


class AbortedError(Exception):
    pass


class FakeContext:
    async def abort(self, code: Any, details: str) -> None:
        raise AbortedError(details)


async def test_admin_reports_what_its_port_says() -> None:
    port = FakeAdmin()
    admin = AdminServicer(port)
    status = await admin.GetStatus(admin_pb2.GetStatusRequest(), FakeContext())  # type: ignore[arg-type]
    assert (status.version, status.open_tickets, status.engines_total, status.engines_ready) == ("1.2.3", 3, 1, 1)
    engines = (await admin.ListEngines(admin_pb2.ListEnginesRequest(), FakeContext())).engines  # type: ignore[arg-type]
    assert engines[0].open_tickets == 3 and engines[0].prefill_median_tokens_per_s == 900.0
    assert engines[0].solo_decode_median_tokens_per_s == -1.0  # unknown, never 0
    drained = await admin.DrainEngine(admin_pb2.DrainEngineRequest(name="thor", drained=True), FakeContext())  # type: ignore[arg-type]
    assert drained.drained
    with pytest.raises(AbortedError, match="no engine named 'nope'"):
        await admin.DrainEngine(admin_pb2.DrainEngineRequest(name="nope", drained=True), FakeContext())  # type: ignore[arg-type]
    why = await admin.ExplainDecision(admin_pb2.ExplainDecisionRequest(model="cortex"), FakeContext())  # type: ignore[arg-type]
    assert (why.verdict, why.engine, why.queued_ahead) == ("admit", "thor", 2)
    reload = await admin.ReloadConfig(admin_pb2.ReloadConfigRequest(path="x.yaml"), FakeContext())  # type: ignore[arg-type]
    assert not reload.applied and list(reload.problems) == ["admission.x: unknown field"] and port.reloads == ["x.yaml"]


def test_no_servicer_imports_the_wiring() -> None:
    import ast
    from pathlib import Path

    for name in ("authz", "accesslog", "admin", "httpendpoint", "admission_service", "observation"):
        tree = ast.parse((Path(__file__).resolve().parents[2] / "controlplane" / f"{name}.py").read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert "controlplane.app" not in imported, name

