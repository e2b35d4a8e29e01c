"""``sluice admin <verb>``: the control plane's admin API; a table for people, ``--json`` for scripts.

The admin API has a listener of its own (``controlplane.admin_port``, 18001 by default). The token a change needs (and a
read, with ``admin.require_token_for_reads``) comes from ``--token-file`` or the ``SLUICE_ADMIN_TOKEN`` environment variable
(the secret alone, or the ``name:secret`` line of the server's token file) and is sent as ``authorization: Bearer``. A
listener with ``admin.tls`` is reached with ``--ca-file`` (the CA that signed its certificate)."""

from __future__ import annotations

import datetime
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict

from sluice.admin.v1 import admin_pb2, admin_pb2_grpc


class _Bearer(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds ``authorization: Bearer <secret>`` to every call."""

    def __init__(self, secret: str) -> None:
        self.metadata = (("authorization", f"Bearer {secret}"),)

    def _with(self, details: Any) -> Any:
        return details._replace(metadata=(*(details.metadata or ()), *self.metadata))

    def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return continuation(self._with(details), request)

    def intercept_unary_stream(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return continuation(self._with(details), request)


def read_token(token_file: str | None) -> str | None:
    """The secret to send: ``--token-file`` (its first token line) or ``SLUICE_ADMIN_TOKEN``; a ``name:secret`` line gives
    its secret."""
    text = Path(token_file).read_text() if token_file else os.environ.get("SLUICE_ADMIN_TOKEN", "")
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            return line.partition(":")[2].strip() if ":" in line else line
    return None


def admin_channel(target: str, token: str | None, ca_file: str | None = None) -> grpc.Channel:
    """A channel to the admin listener: plaintext, or TLS verified against ``ca_file`` (the listener's ``admin.tls``; the
    certificate must name the target's host)."""
    channel = (grpc.insecure_channel(target) if ca_file is None
               else grpc.secure_channel(target, grpc.ssl_channel_credentials(Path(ca_file).read_bytes())))
    return grpc.intercept_channel(channel, _Bearer(token)) if token else channel


def _num(value: float, fmt: str = "{:g}") -> str:
    return "?" if value < 0 else fmt.format(value)


def _tokens(n: int) -> str:
    if n <= 0:
        return "?"
    return f"{n / 1000:.0f}k" if n >= 10000 else str(n)


def _adapters(e: admin_pb2.Engine) -> str:
    """Loaded adapters over slots (``sql,chat/4``); ``-`` for an engine without adapters."""
    if not e.adapter_slots and not e.adapters_loaded:
        return "-"
    return f"{','.join(e.adapters_loaded) or 'none'}/{e.adapter_slots or '?'}"


def engines_table(response: admin_pb2.ListEnginesResponse) -> str:
    header = ("ENGINE", "FLAVOR", "VERSION", "STATE", "MODELS", "RUN", "WAIT", "KV", "KV CAP", "CAP", "TICKETS", "LOAD",
              "GEN TOK/S", "DECODE/REQ", "PREFILL MED", "TTFT P50", "TTFT P90", "TTFT ERR", "TTFT CORR", "E2E ERR",
              "CHARS/TOK",
              "TPL/MSG", "PROMPT ERR", "ADAPTERS", "PROBE AGE", "DEGRADED")
    rows = [header]
    for e in response.engines:
        state = "stale" if e.stale else ("ready" if e.ready else "no models")
        cap = e.max_num_seqs or e.discovered_concurrency
        if e.drained:
            state += ",drained"
        rows.append((
            e.name, e.flavor or "?", e.version or "?", state, ",".join(e.models) or "-",
            _num(e.running), _num(e.waiting), _num(e.kv_usage, "{:.0%}"), _tokens(e.kv_capacity_tokens),
            str(cap or "?"), str(e.open_tickets), str(e.effective_load),
            _num(e.rates.generation_tokens_per_s, "{:.1f}") if e.HasField("rates") else "-",
            _num(e.rates.decode_tokens_per_s_each, "{:.1f}") if e.HasField("rates") else "-",
            _num(e.prefill_median_tokens_per_s, "{:.0f}"),
            _num(e.ttft_p50_seconds, "{:.2f}s"), _num(e.ttft_p90_seconds, "{:.2f}s"),
            _num(e.ttft_estimate_error_median, "{:.2f}x"), f"{e.ttft_correction:.2f}x",
            _num(e.end_to_end_estimate_error_median, "{:.2f}x"),
            _num(e.prompt_chars_per_token, "{:.2f}"), _num(e.prompt_template_tokens_per_message, "{:.1f}"),
            _num(e.prompt_tokens_error_median, "{:.2f}x"),
            _adapters(e),
            _num(e.last_probe_age_seconds, "{:.1f}s"),
            ",".join(e.missing_gauges) or "no",
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def status_text(s: admin_pb2.GetStatusResponse) -> str:
    lines = [
        f"sluice {s.version}, up {s.uptime_seconds:.0f}s",
        f"engines: {s.engines_ready}/{s.engines_total} ready",
        f"tickets: {s.open_tickets} open, {s.tickets_admitted_total} admitted, {s.tickets_released_total} released, "
        f"{s.tickets_expired_total} expired",
        f"xDS: {s.envoy_streams} Envoy stream(s), {s.xds_nacks_total} NACK(s)",
    ]
    for t in s.xds:
        acked = ", ".join(f"{node}={v}" for node, v in sorted(t.acked_versions.items())) or "none"
        lines.append(f"  {t.type_url.rsplit('.', 1)[-1]:<22} version {t.current_version}  acked: {acked}")
    return "\n".join(lines)


def explanation_text(r: admin_pb2.ExplainDecisionResponse) -> str:
    head = f"{r.verdict} ({r.reason})" + (f" -> {r.engine}" if r.engine else "") + \
        (f", retry-after {r.retry_after_s}s" if r.retry_after_s else "") + f", {r.queued_ahead} parked ahead"
    rows = [("ENGINE", "SERVES", "FLOOR", "STALE", "DRAINED", "LOAD", "CACHED", "TTFT", "FINISH", "BLOCKED BY")]
    for e in r.engines:
        rows.append((e.name, _yes(e.serves_model), _yes(e.meets_version_floor), _yes(e.stale), _yes(e.drained),
                     f"{e.effective_load:g}", str(e.expected_cached_tokens), _num(e.ttft_estimate_s, "{:.2f}s"),
                     _num(e.finish_estimate_s, "{:.2f}s"), ",".join(e.misfits) or "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    table = "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)
    return f"{head}\n{r.detail}\n\n{table}\n\n{fair_standing_text(r.fairness)}"


def fair_standing_text(f: admin_pb2.FairStanding) -> str:
    """Why the request would wait in its class if it parked now: its tenant's counter and who goes first."""
    tenant = f.tenant or "(no tenant)"
    held = ", ".join(f"{t or '-'} {n}" for t, n in sorted(f.held_slots.items()))
    held_line = [f"held for reserved shares: {held} slot(s)"] if held else []
    if not f.enabled:
        return "\n".join([f"fair share off: its class is FIFO; {f.ahead_in_class} of its class and "
                          f"{f.ahead_in_higher_classes} of higher classes parked ahead ({tenant}'s counter "
                          f"{f.counter:.0f})", *held_line])
    lines = [f"fair share: {tenant}'s counter {f.counter:.0f}" + (" (lifted to the backlogged minimum)" if f.lifted
                                                                      else "")
             + f"; {f.ahead_in_class} of its class ahead, {f.ahead_in_higher_classes} of higher classes", *held_line]
    if f.tenants_ahead:
        rows = [("AHEAD", "COUNTER", "REQUESTS")]
        rows += [(a.tenant or "-", f"{a.counter:.0f}", str(a.requests)) for a in f.tenants_ahead]
        widths = [max(len(row[i]) for row in rows) for i in range(3)]
        lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)


def tenants_table(response: admin_pb2.ListTenantsResponse) -> str:
    """One row per limit (the tenant's own, then each model's share), usage against it: what ``sluice admin tenants``
    prints."""
    rows = [("TENANT", "KEYS", "PRIORITY", "MODELS", "SCOPE", "KIND", "USED", "LIMIT", "REMAINING", "RESET")]
    for t in response.tenants:
        head = (t.name, str(t.keys), f"{t.default_priority}..{t.max_priority}", ",".join(t.models_allowed) or "all")
        if t.error:
            rows.append((*head, "-", "-", "-", "-", "-", f"unavailable: {t.error}"))
        elif not t.limits:
            rows.append((*head, "-", "-", "-", "unlimited", "-", "-"))
        for limit in t.limits:
            per = "" if limit.kind == "concurrent" else "/min"
            rows.append((*head, limit.scope, limit.kind, str(limit.used), f"{limit.limit}{per}", str(limit.remaining),
                         f"{limit.reset_seconds:.1f}s"))
            head = ("", "", "", "")
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


def fair_share_table(fairness: admin_pb2.FairShare) -> str:
    """Fair share's settings, then one row per model and tenant: its weight, virtual token counter (the lowest is
    served next within a class), tokens served and requests parked on this replica."""
    state = "on" if fairness.enabled else "off (FIFO)"
    head = (f"fair share: {state} (fairness.enabled: {fairness.mode}); a counter adds prompt x "
            f"{fairness.prompt_weight:g} + output x {fairness.output_weight:g} tokens / weight")
    if not fairness.shares:
        return head
    rows = [("MODEL", "TENANT", "WEIGHT", "RESERVED", "COUNTER", "SERVED TOKENS", "WAITING")]
    for t in fairness.shares:
        rows.append((t.model, t.tenant or "-", f"{t.weight:g}", f"{t.reserved_share:g}" if t.reserved_share else "-",
                     f"{t.counter:.0f}", f"{t.served_tokens:.0f}", str(t.waiting)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return head + "\n" + "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


WATCH_COLUMNS = ("TIME", "VERDICT", "REASON", "ENGINE", "MODEL", "PRIORITY", "PARKED", "TTFT EST", "REQUEST")


def watch_row(e: admin_pb2.DecisionEvent) -> str:
    cells = (datetime.datetime.fromtimestamp(e.at_unix).strftime("%H:%M:%S.%f")[:-3], e.verdict, e.reason,
             e.engine or "-", e.model or "-", e.priority or "-", f"{e.parked_ms:.0f}ms",
             f"{e.expected_ttft_s:.2f}s" if e.expected_ttft_s else "-", e.request_id)
    widths = (12, 7, 22, 14, 24, 9, 8, 8, 0)
    return "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()


def watch(stub: admin_pb2_grpc.AdminStub, model: str | None, as_json: bool, limit: int | None = None) -> int:
    """Tail ``WatchDecisions`` until interrupted (or ``limit`` events)."""
    if not as_json:
        print("  ".join(c.ljust(w) for c, w in zip(WATCH_COLUMNS, (12, 7, 22, 14, 24, 9, 8, 8, 0))).rstrip(), flush=True)
    seen = 0
    try:
        for event in stub.WatchDecisions(admin_pb2.WatchDecisionsRequest(model=model or "")):
            if event.dropped_since_last:
                note = f"... {event.dropped_since_last} decision(s) dropped: this watcher read too slowly"
                print(json.dumps({"dropped": event.dropped_since_last}) if as_json else note, flush=True)
            print(json.dumps(MessageToDict(event, always_print_fields_with_no_presence=True)) if as_json
                  else watch_row(event), flush=True)
            seen += 1
            if limit is not None and seen >= limit:
                break
    except KeyboardInterrupt:
        pass
    return 0


def run_admin(target: str, verb: str, *, as_json: bool, name: str | None = None,
              explain: admin_pb2.ExplainDecisionRequest | None = None, token: str | None = None,
              version: str | None = None, limit: int | None = None, ca_file: str | None = None) -> int:
    with admin_channel(target, token, ca_file) as channel:
        stub = admin_pb2_grpc.AdminStub(channel)
        try:
            if verb == "watch":
                return watch(stub, name, as_json, limit)
            if verb == "policy":
                policy = stub.GetPolicy(admin_pb2.GetPolicyRequest(), timeout=5)
                text = (json.dumps(MessageToDict(policy, always_print_fields_with_no_presence=True), indent=2)
                        if as_json else f"# running policy, from {policy.source}\n{policy.yaml.rstrip()}")
            elif verb == "floor":
                if not name or version is None:
                    print("sluice admin floor: name a model pattern and a version (\"\" removes the floor)",
                          file=sys.stderr)
                    return 2
                floor = stub.SetVersionFloor(admin_pb2.SetVersionFloorRequest(model_pattern=name, version=version),
                                             timeout=10)
                if not floor.applied:
                    print("sluice admin floor: refused:\n  " + "\n  ".join(floor.problems), file=sys.stderr)
                    return 1
                text = (json.dumps(MessageToDict(floor, always_print_fields_with_no_presence=True), indent=2)
                        if as_json else f"version floor {name}: {floor.before or 'none'} -> {floor.after or 'none'}")
            elif verb == "reload":
                # The control plane resolves the path it is sent from its own directory: send the one meant here.
                path = str(Path(name).absolute()) if name else ""
                result = stub.ReloadConfig(admin_pb2.ReloadConfigRequest(path=path), timeout=10)
                if as_json:
                    text = json.dumps(MessageToDict(result, always_print_fields_with_no_presence=True), indent=2)
                elif result.applied:
                    text = f"reloaded {result.source}; changed: {', '.join(result.changed) or 'nothing'}"
                else:
                    print("sluice admin reload: refused, the running policy stays:\n  " + "\n  ".join(result.problems),
                          file=sys.stderr)
                    return 1
            elif verb == "explain":
                assert explain is not None
                result = stub.ExplainDecision(explain, timeout=5)
                text = (json.dumps(MessageToDict(result, always_print_fields_with_no_presence=True), indent=2)
                        if as_json else explanation_text(result))
            elif verb in ("drain", "undrain"):
                if not name:
                    print(f"sluice admin {verb}: name the engine", file=sys.stderr)
                    return 2
                engine = stub.DrainEngine(admin_pb2.DrainEngineRequest(name=name, drained=verb == "drain"), timeout=5)
                text = (json.dumps(MessageToDict(engine, always_print_fields_with_no_presence=True), indent=2)
                        if as_json else f"{engine.name}: {'drained' if engine.drained else 'serving'}")
            elif verb == "tenants":
                tenants = stub.ListTenants(admin_pb2.ListTenantsRequest(), timeout=5)
                text = (json.dumps(MessageToDict(tenants, always_print_fields_with_no_presence=True), indent=2)
                        if as_json else (tenants_table(tenants) if tenants.tenants
                                         else "no tenants configured: authentication is off")
                        + "\n\n" + fair_share_table(tenants.fairness))
            elif verb == "engines":
                engines = stub.ListEngines(admin_pb2.ListEnginesRequest(), timeout=5)
                text = (json.dumps(MessageToDict(engines, always_print_fields_with_no_presence=True), indent=2)
                        if as_json else engines_table(engines))
            else:
                status = stub.GetStatus(admin_pb2.GetStatusRequest(), timeout=5)
                text = (json.dumps(MessageToDict(status, always_print_fields_with_no_presence=True), indent=2)
                        if as_json else status_text(status))
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT,
                              grpc.StatusCode.UNAUTHENTICATED):
                print(f"sluice admin: {exc.details()}", file=sys.stderr)
            else:
                print(f"sluice admin: cannot reach the control plane at {target}: {exc.code().name}", file=sys.stderr)
            return 1
    print(text)
    return 0
