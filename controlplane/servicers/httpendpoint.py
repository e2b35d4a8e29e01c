"""The control plane's HTTP port: Prometheus ``/metrics``, ``/healthz``, and the retry redirector.

The redirector is where Envoy's one retry of a request whose engine failed before its first byte lands (the priority-1
endpoint of every engine cluster, see ``xds/resources/listener.py``). The failed attempt's ticket is released, the engine leaves the
candidates until a probe succeeds, and a 307 to the same URL with ``sluice_avoid=<engine>`` makes Envoy run the request
again through a new Check (an internal redirect) that will not choose that engine. A tenant's charge under the failed
ticket is given back first (nothing was generated); the retry's Check charges it again. Only a request carrying an open ticket
of that engine counts as a failure: the ticket id is never shown to clients, so nobody can mark an engine failing by
calling this port.
"""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from controlplane.edge import JSON_CONTENT_TYPE, Failure, error_json, reply
from controlplane.metrics import SluiceMetrics
from controlplane.names import AVOID_PARAM, ENGINE_HEADER, RETRY_AFTER_HEADER, TICKET_HEADER
from controlplane.ports import CompletionPort, QuotaPort


class HttpEndpoint:
    def __init__(self, host: str, port: int, metrics: SluiceMetrics, completions: CompletionPort,
                 quota: QuotaPort | None = None) -> None:
        self.host = host
        self.port = port
        """The bound port once started (the configured one may be 0)."""
        self.metrics = metrics
        self.completions = completions
        self.quota = quota
        self._runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_route("*", "/v1/{tail:.*}", self.retry_redirect)
        return app

    async def start(self) -> None:
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = int(self._runner.addresses[0][1])  # the bound port (``port`` 0: any free one)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(body=await self.metrics.exposition(), headers={"content-type": CONTENT_TYPE_LATEST})

    async def _healthz(self, _: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def retry_redirect(self, request: web.Request) -> web.Response:
        engine = request.headers.get(ENGINE_HEADER, "")
        ticket = self.completions.release_ticket(request.headers.get(TICKET_HEADER, ""))
        if ticket is None or ticket.engine != engine:
            # Not a retry this control plane admitted (a restart forgot the ticket, or a stray caller): the engine's
            # failure stands as the answer, with the shape Envoy gives it.
            failure = Failure.UPSTREAM_UNAVAILABLE
            return web.Response(status=reply(failure).status, content_type=JSON_CONTENT_TYPE,
                                headers={RETRY_AFTER_HEADER: "1"},
                                text=error_json(failure, "No engine could take the request (upstream unavailable)"))
        if self.quota is not None:
            # The engine generated nothing: a tenant's charge under this ticket id is given back before the 307, so the
            # retry's Check (same request id) charges afresh instead of finding the id still open.
            await self.quota.refund_now(ticket.ticket_id)
        self.completions.note_engine_failure(engine, "failed before its first byte; retried elsewhere")
        self.metrics.engine(engine).retries.inc()
        separator = "&" if request.query_string else "?"
        location = f"http://{request.host}{request.path_qs}{separator}{AVOID_PARAM}={engine}"
        return web.Response(status=307, headers={"location": location})
