"""The benches count what Envoy sent or opened to the engines from its admin ``/stats``, leaving out the control plane's
own cluster (the Checks, ADS and the access log go there too)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bench.common import envoy_cluster_total

STATS = """cluster.e0.upstream_cx_total: 3
cluster.e1.upstream_cx_total: 4
cluster.e1.upstream_cx_total_extra: 100
cluster.sluice_controlplane.upstream_cx_total: 50
cluster.e0.upstream_rq_total: 9
cluster.engine.with.dots.upstream_cx_total: 5
"""


@pytest.fixture()
def admin_port() -> Iterator[int]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            body = STATS.encode()
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_a_per_cluster_counter_is_summed_over_the_named_engines_only(admin_port: int) -> None:
    assert envoy_cluster_total(admin_port, "upstream_cx_total", ["e0", "e1"]) == 7
    assert envoy_cluster_total(admin_port, "upstream_cx_total", ["e0", "e1", "engine.with.dots"]) == 12
    assert envoy_cluster_total(admin_port, "upstream_rq_total", ["e0", "e1"]) == 9
    assert envoy_cluster_total(admin_port, "upstream_cx_total", []) == 0
