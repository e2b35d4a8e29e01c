"""Observability against real tools: the metrics catalogue (docs/metrics.md) against a live exposition, and a real
Prometheus server (Debian's ``prometheus`` package, installed by ``make test`` through deploy/tools/ensure-prometheus.sh)
scraping a sluice that has served real traffic through the real Envoy, answering every Grafana dashboard query and every
alert expression through its HTTP API.

The traffic makes every kind of event the dashboard and the alerts read: admits, parks, sheds (a small parking lot),
tickets reaped by lease (a 1 s lease shorter than the requests: their access-log entries arrive too late), a stale engine
(its /metrics fails for a moment) and an xDS NACK (an invalid cluster pushed once, then the good config again)."""

from __future__ import annotations

import concurrent.futures
import json
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from controlplane.core.tenants import key_digest
from rig.waits import free_port, wait_for
from tests.harness import Stack, http_json, push_broken_cluster, set_metrics_fault, start_stack, stop

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "sluice.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yaml"
CATALOGUE = ROOT / "docs" / "metrics.md"
JOB = "sluice-controlplane"
#: What the Grafana variables stand for when a query goes straight to Prometheus.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$engine": ".*"}
#: Metrics with labels that only events not staged here set (an engine failing before its first byte, a policy reload):
#: their names and types are still checked (from # HELP / # TYPE), their labels only once they have samples.
EVENT_ONLY = {"sluice_engine_retries_total", "sluice_engine_request_failures_total", "sluice_config_reloads_total",
              "sluice_admin_refused_total", "sluice_admin_watch_dropped_total",
              # the shared store failing, or another replica taking a slot first: never with one replica on memory
              "sluice_store_errors_total", "sluice_store_refusals_total",
              # the limiter's store failing: never on memory
              "sluice_ratelimit_errors_total",
              # an engine that held prompts restarting or being drained (test_prefix.py's world, not this one)
              "sluice_prefix_index_forgotten_total",
              # a sheddable stream ended for a critical request: off by default (test_preempt.py's world)
              "sluice_preempted_total",
              # dynamic LoRA loading, off here (test_lora.py's world)
              "sluice_adapter_loads_total",
              # long prompts counted by an engine's tokenizer: off by default (test_prompt_tokens.py's world)
              "sluice_tokenize_requests_total"}
TENANT_KEY = "sk-observer"
"""The one tenant's key: every request but one (a wrong key, for the refusal counters) sends it."""
THRESHOLD = re.compile(r"^(?P<base>.+?)\s*(?:==|!=|>=|<=|>|<)\s*-?[0-9.e+]+\s*$", re.S)


def prometheus_missing() -> str | None:
    missing = [tool for tool in ("prometheus", "promtool") if shutil.which(tool) is None]
    if missing:
        return (f"{' and '.join(missing)} not found: `make test` installs Debian's prometheus package "
                "(deploy/tools/ensure-prometheus.sh) and could not here (no apt-get, or not root)")
    return None


@dataclass
class Observed:
    stack: Stack
    prometheus_url: str | None
    statuses: dict[int, int]


def _post_chat(stack: Stack, max_tokens: int, key: str = TENANT_KEY, stream: bool = True) -> int:
    body = json.dumps({"model": "cortex", "max_tokens": max_tokens, "stream": stream, "ignore_eos": True,
                       "messages": [{"role": "user", "content": "tell me a story"}]}).encode()
    request = urllib.request.Request(stack.base_url + "/chat/completions", data=body,
                                     headers={"content-type": "application/json", "authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            response.read()
            return int(response.status)
    except urllib.error.HTTPError as exc:
        exc.read()
        return int(exc.code)


def _start_prometheus(stack: Stack, work: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(ALERTS)],
        "scrape_configs": [{"job_name": JOB, "static_configs": [
            {"targets": [f"127.0.0.1:{stack.config.controlplane.metrics_port}"]}]}],
    }
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = (work / "prometheus.log").open("wb")
    process = subprocess.Popen(
        ["prometheus", f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: urllib.request.urlopen(url + "/-/ready", timeout=1).status == 200, timeout=20,
                 what="Prometheus ready")
        # Prometheus 2.x applies its scrape targets on a 5 s tick: the first scrape comes up to 5 s after "ready".
        wait_for(lambda: _last_scrape(url) is not None, timeout=30, what="Prometheus's first scrape")
    except BaseException:
        stop(process)
        raise
    return process, url


def _last_scrape(url: str) -> float | None:
    """When Prometheus last scraped the control plane (Unix seconds), or None before its first scrape."""
    samples = query(url, "timestamp(up)")
    return float(samples[0]["value"][1]) if samples else None


def _drive_traffic(stack: Stack) -> dict[int, int]:
    statuses: dict[int, int] = {}
    # A burst well past 4 slots and a parking lot of 3: some admitted at once, some parked, the rest shed. Each request
    # streams 120 tokens (1.4-2.4 s at speed 2), longer than the 1 s lease: its ticket is reaped before its log entry.
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        for status in pool.map(lambda _: _post_chat(stack, 120), range(16)):
            statuses[status] = statuses.get(status, 0) + 1
    # Short requests, done within the lease: their access-log entries release their tickets and measure the TTFT error.
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for status in pool.map(lambda _: _post_chat(stack, 4), range(8)):
            statuses[status] = statuses.get(status, 0) + 1
    # Non-streaming answers carry the engine's usage: the prompt-token estimate's error.
    for _ in range(2):
        status = _post_chat(stack, 4, stream=False)
        statuses[status] = statuses.get(status, 0) + 1
    # A key no tenant holds: 401 (the tenants' refusal counter).
    status = _post_chat(stack, 4, key="sk-nobody")
    statuses[status] = statuses.get(status, 0) + 1
    # An engine whose /metrics fails goes stale (3 polls of 0.2 s), then fresh again.
    spark = stack.sim_url("spark")
    set_metrics_fault(spark, "error")
    wait_for(lambda: stack.engines()["spark"].stale, timeout=10, what="spark stale")
    set_metrics_fault(spark, "ok")
    wait_for(lambda: not stack.engines()["spark"].stale, timeout=10, what="spark fresh again")
    # One NACK: an invalid cluster pushed once, then the good config again.
    assert stack.controlplane is not None
    plane = stack.controlplane.plane
    push_broken_cluster(stack)
    wait_for(lambda: plane.xds.ads.nacks_total >= 1, what="Envoy's NACK")
    stack.controlplane.call(plane.xds.publish())
    return statuses


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Observed]:
    work = tmp_path_factory.mktemp("prometheus")
    stack = start_stack(
        [("thor", "thor"), ("spark", "spark")], work, speed=2.0,
        admission={"max_queue_depth": 3, "max_park_seconds": 3.0},
        tickets={"lease_seconds": 1.0, "reap_interval_seconds": 0.2},
        observe={"prefill_sample_min_tokens": 0},  # short prompts still measure a prefill rate
        # One tenant with a budget far above the traffic: its requests are charged and settled (the tenants' metrics).
        tenants={"observer": {"keys": [key_digest(TENANT_KEY)], "limits": {"tokens_per_minute": 10_000_000}}},
        api_key=TENANT_KEY,
    )
    prometheus = None
    url = None
    try:
        if prometheus_missing() is None:
            prometheus, url = _start_prometheus(stack, work)
        statuses = _drive_traffic(stack)
        if url is not None:
            # Two more scrapes after the last event, so every rate() window holds it.
            traffic_end = time.time()
            wait_for(lambda: (_last_scrape(url) or 0.0) > traffic_end + 1.0, timeout=30,
                     what="two scrapes after the traffic")
        yield Observed(stack, url, statuses)
    finally:
        if prometheus is not None:
            stop(prometheus)
        stack.close()


def query(url: str, expr: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"{url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}", timeout=10) as r:
        answer = json.load(r)
    assert answer["status"] == "success", (expr, answer)
    assert answer["data"]["resultType"] == "vector", (expr, answer["data"]["resultType"])
    result: list[dict[str, Any]] = answer["data"]["result"]
    return result


def grafana_to_promql(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"unknown Grafana variable in {expr!r}"
    return expr


def dashboard_queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel.get("targets", [])]


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def catalogue() -> dict[str, tuple[str, set[str]]]:
    """docs/metrics.md's table: exposed name -> (type, labels)."""
    rows: dict[str, tuple[str, set[str]]] = {}
    for line in CATALOGUE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and cells[0].startswith("`sluice_"):
            labels = set(re.findall(r"`([a-z_]+)`", cells[2]))
            rows[cells[0].strip("`")] = (cells[1], labels)
    return rows


def exposition(stack: Stack) -> dict[str, tuple[str, set[str] | None]]:
    """The live /metrics: exposed name -> (type, labels, or None when the metric has no sample yet)."""
    assert stack.controlplane is not None
    text = urllib.request.urlopen(f"http://127.0.0.1:{stack.controlplane.plane.http.port}/metrics",
                                  timeout=5).read().decode()
    found: dict[str, tuple[str, set[str] | None]] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("sluice_") or family.name.endswith("_created"):
            continue  # prometheus_client's creation timestamps of counters and histograms (the text parser splits them off)
        name = family.name + "_total" if family.type == "counter" else family.name
        samples = [s for s in family.samples if not s.name.endswith("_created")]
        labels = set().union(*(set(s.labels) - {"le"} for s in samples)) if samples else None
        found[name] = (family.type, labels)
    return found


def test_traffic_made_every_kind_of_event(observed: Observed) -> None:
    assert observed.statuses.get(200), observed.statuses
    assert observed.statuses.get(503), observed.statuses  # sheds
    assert observed.statuses.get(401) == 1, observed.statuses  # the wrong key
    text = exposition(observed.stack)
    assert text["sluice_tickets_expired_total"][1] == {"engine"}  # reaped by lease


def test_metrics_catalogue_matches_the_live_exposition_both_ways(observed: Observed) -> None:
    documented = catalogue()
    exposed = exposition(observed.stack)
    assert len(documented) >= 25
    assert sorted(set(documented) - set(exposed)) == [], "documented in docs/metrics.md but not exposed"
    assert sorted(set(exposed) - set(documented)) == [], "exposed but missing from docs/metrics.md"
    for name, (kind, labels) in exposed.items():
        assert documented[name][0] == kind, f"{name}: documented as {documented[name][0]}, exposed as {kind}"
        if labels is None:
            assert name in EVENT_ONLY, f"{name} has no sample after the staged traffic"
        else:
            assert documented[name][1] == labels, f"{name}: documented labels {documented[name][1]}, exposed {labels}"


def test_promtool_checks_the_alert_rules() -> None:
    if missing := prometheus_missing():
        pytest.skip(missing)
    result = subprocess.run(["promtool", "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in result.stdout


def test_prometheus_loaded_the_rules(observed: Observed) -> None:
    if observed.prometheus_url is None:
        pytest.skip(prometheus_missing() or "no Prometheus")
    groups = http_json(observed.prometheus_url + "/api/v1/rules")["data"]["groups"]
    loaded = {rule["name"]: rule["health"] for group in groups for rule in group["rules"]}
    assert loaded == {rule["alert"]: "ok" for rule in alert_rules()}
    targets = http_json(observed.prometheus_url + "/api/v1/targets")["data"]["activeTargets"]
    assert [(t["labels"]["job"], t["health"]) for t in targets] == [(JOB, "up")]


def test_every_dashboard_query_returns_data(observed: Observed) -> None:
    if observed.prometheus_url is None:
        pytest.skip(prometheus_missing() or "no Prometheus")
    queries = dashboard_queries()
    assert len(queries) >= 20
    empty = [(title, expr) for title, expr in queries if not query(observed.prometheus_url, grafana_to_promql(expr))]
    assert empty == [], "dashboard queries without data"
    # The engine variable's values come from Prometheus too (label_values(sluice_engine_up, engine)).
    values = http_json(observed.prometheus_url + "/api/v1/label/engine/values?match[]=sluice_engine_up")["data"]
    assert sorted(values) == ["spark", "thor"]


def test_every_alert_expression_evaluates_and_its_base_returns_data(observed: Observed) -> None:
    """Each alert is ``<base> <comparison> <threshold>``: the full expression must evaluate (it may be empty: nothing is
    wrong), and its base must return data for a sluice that has seen traffic."""
    if observed.prometheus_url is None:
        pytest.skip(prometheus_missing() or "no Prometheus")
    empty = []
    for rule in alert_rules():
        expr = " ".join(rule["expr"].split())
        query(observed.prometheus_url, expr)
        match = THRESHOLD.match(expr)
        assert match, f"{rule['alert']}: expression is not `<base> <op> <number>`: {expr}"
        if not query(observed.prometheus_url, match["base"]):
            empty.append((rule["alert"], match["base"]))
    assert empty == []
