"""Config validation: all-or-nothing, every problem reported with its dotted path."""

from __future__ import annotations

import asyncio
import socket
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from controlplane.config import (
    DEFAULTS, RELOADABLE, ConfigError, changed_sections, load_config, parse_config, resolve_engines,
)
from controlplane.core.policy import Policy
from sluice.simulated import with_profile_defaults

ONE = {"engines": [{"name": "a", "url": "http://127.0.0.1:1"}]}


def test_bundled_default_is_valid() -> None:
    config = load_config(None)
    assert [e.name for e in config.engines] == ["thor", "spark"]
    assert [e.sim for e in config.engines] == ["thor", "spark"]
    assert config.envoy.listen_port == 8080 and config.controlplane.grpc_port == 18000
    assert config.envoy.max_request_bytes == 1024 * 1024
    # The file states the simulators' caps itself (vLLM cannot report one), so `sluice controlplane` alone knows them.
    assert [e.max_num_seqs for e in config.engines] == [2, 2]


def test_the_launcher_writes_a_vllm_simulators_cap_from_its_profile() -> None:
    raw = {"engines": [{"name": "thor", "url": "http://127.0.0.1:8101", "sim": "thor"},
                       {"name": "big", "url": "http://127.0.0.1:8102", "sim": "v100pp2"}]}
    assert parse_config(raw).engines[0].max_num_seqs is None  # the config itself knows no simulator profile
    completed = parse_config(with_profile_defaults(raw))
    assert [e.max_num_seqs for e in completed.engines] == [2, 4]  # thor's and v100pp2's profiles
    assert "max_num_seqs" not in raw["engines"][0]  # the caller's mapping is left alone
    sglang = {"engines": [{"name": "s", "url": "http://127.0.0.1:1", "sim": "thor", "sim_flavor": "sglang"},
                          {"name": "t", "url": "http://127.0.0.1:2", "sim": "thor", "max_num_seqs": 7}]}
    assert with_profile_defaults(sglang) is sglang  # SGLang reports its cap itself; a configured cap stays


def test_the_launcher_refuses_an_unknown_profile_with_every_other_problem() -> None:
    raw = {"engines": [{"name": "a", "url": "http://127.0.0.1:1", "sim": "nope"}, {"name": "b", "url": "ftp://x"}]}
    with pytest.raises(ConfigError) as caught:
        with_profile_defaults(raw)
    assert [p.split(":")[0] for p in caught.value.problems] == ["engines[1].url", "engines[0].sim"]
    assert "unknown simulator profile 'nope'" in caught.value.problems[1]
    parse_config(raw | {"engines": raw["engines"][:1]})  # the config itself only checks it is a name


def test_every_problem_is_reported_at_once() -> None:
    raw = {
        "envoy": {"listen_port": 70000, "max_request_bytes": "big", "bogus": 1},
        "observe": {"poll_interval_seconds": 0.5, "poll_timeout_seconds": 2},
        "engines": [
            {"name": "thor", "url": "ftp://x"},
            {"name": "thor", "url": "http://127.0.0.1:1", "sim": 3, "max_num_seqs": 0},
            {"name": "sluice_cp", "url": "http://127.0.0.1:2", "colour": "red"},
        ],
        "extra": True,
    }
    with pytest.raises(ConfigError) as caught:
        parse_config(raw)
    paths = {p.split(":")[0] for p in caught.value.problems}
    assert paths == {
        "extra", "envoy.bogus", "envoy.listen_port", "envoy.max_request_bytes", "observe.poll_timeout_seconds",
        "engines[0].url", "engines[1].name", "engines[1].sim", "engines[1].max_num_seqs", "engines[2].name",
        "engines[2].colour",
    }


def test_client_may_never_send_the_engine_header() -> None:
    with pytest.raises(ConfigError, match="x-sluice-engine can never come from a client"):
        parse_config({"envoy": {"client_headers_kept": ["x-sluice-engine"]},
                      "engines": [{"name": "a", "url": "http://127.0.0.1:1"}]})


def test_validation_does_no_io_and_hostnames_resolve_afterwards(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_dns(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("parse_config must not resolve names")

    raw = {"engines": [{"name": "a", "url": "http://localhost:8000"}, {"name": "b", "url": "http://10.0.0.1:1"}]}
    with monkeypatch.context() as patched:
        patched.setattr(socket, "getaddrinfo", no_dns)
        config = parse_config(raw)
    assert [e.host for e in config.engines] == ["localhost", "10.0.0.1"]
    resolved = asyncio.run(resolve_engines(config))
    assert resolved.engines[0].host in {"127.0.0.1", "::1"} and resolved.engines[0].port == 8000
    assert resolved.engines[1] == config.engines[1]


def test_a_name_that_does_not_resolve_is_a_problem_with_its_path() -> None:
    config = parse_config({"engines": [{"name": "a", "url": "http://127.0.0.1:1"},
                                       {"name": "b", "url": "http://no-such-host.invalid:1"}]})
    with pytest.raises(ConfigError) as caught:
        asyncio.run(resolve_engines(config))
    assert [p.split(":")[0] for p in caught.value.problems] == ["engines[1].url"]


def test_port_zero_means_any_free_port_for_the_processes_ports_only() -> None:
    config = parse_config({**ONE, "controlplane": {"grpc_port": 0, "metrics_port": 0},
                           "envoy": {"listen_port": 0, "admin_port": 0}})
    assert (config.controlplane.grpc_port, config.controlplane.metrics_port) == (0, 0)
    assert (config.envoy.listen_port, config.envoy.admin_port) == (0, 0)
    with pytest.raises(ConfigError, match=r"engines\[0\].url: an engine's URL needs its real port"):
        parse_config({"engines": [{"name": "a", "url": "http://127.0.0.1:0"}]})


def test_admission_defaults_are_the_policys_own() -> None:
    assert parse_config(ONE).policy == Policy()
    assert DEFAULTS["admission"]["retry_after_max_seconds"] == Policy().retry_after_max_s


def test_deadline_planning_settings_are_read_and_bounded() -> None:
    """``admission.ttft_headroom_fraction`` (0 to 0.9) and ``admission.band_ttft_grain_fraction`` (0 or more) reach the
    policy; out of range is a problem with its path, like any other setting."""
    engines = [{"name": "thor", "url": "http://127.0.0.1:9000"}]
    policy = parse_config({"engines": engines, "admission": {"ttft_headroom_fraction": 0.2,
                                                             "band_ttft_grain_fraction": 0.03}}).policy
    assert (policy.ttft_headroom_fraction, policy.band_ttft_grain_fraction) == (0.2, 0.03)
    assert (Policy().ttft_headroom_fraction, Policy().band_ttft_grain_fraction) == (0.1, 0.01)
    with pytest.raises(ConfigError) as caught:
        parse_config({"engines": engines, "admission": {"ttft_headroom_fraction": 0.95, "band_ttft_grain_fraction": -1}})
    assert {p.split(":")[0] for p in caught.value.problems} == {"admission.ttft_headroom_fraction",
                                                                  "admission.band_ttft_grain_fraction"}


def test_changed_sections_and_restarts_follow_reloadable() -> None:
    base = parse_config(ONE)
    variants = {
        "admission": {**ONE, "admission": {"max_queue_depth": 3}},
        "models": {**ONE, "models": {"m": {"max_ttft_ms": 5}}},
        "version_floors": {**ONE, "version_floors": {"m": "1.0"}},
        "boxes": {**ONE, "boxes": [{"engines": ["a"], "kv_budget_tokens": 10}]},
        "observe.on_stale": {**ONE, "observe": {"on_stale": "closed"}},
        "engines": {"engines": [{"name": "a", "url": "http://127.0.0.1:2"}]},
        "tenants": {**ONE, "tenants": {"acme": {"keys": ["a" * 64]}}},
        "fairness": {**ONE, "fairness": {"enabled": True}},
        "adapters": {**ONE, "adapters": {"models": {"acme-sql": "m"}}},
    }
    assert set(variants) == set(RELOADABLE)
    for name, raw in variants.items():
        fresh = parse_config(raw)
        assert changed_sections(base, fresh) == [name]
        assert base.restart_needed(fresh) == []
    assert changed_sections(base, base) == []
    moved = parse_config({**ONE, "envoy": {"listen_port": 1}, "observe": {"poll_interval_seconds": 2.0}})
    assert base.restart_needed(moved) == ["envoy", "observe"]
    assert changed_sections(base, replace(base, source="elsewhere")) == []


def test_unreadable_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("engines: [")
    with pytest.raises(ConfigError, match="yaml"):
        load_config(str(bad))


def test_the_probe_workers_priority_is_idle_unless_configured_and_checked() -> None:
    """``observe.worker_priority`` (idle by default, or nice) and ``observe.worker_starved_after_seconds`` reach the
    observe settings; anything else is a problem with its path."""
    from controlplane.config import WorkerPriority

    engines = [{"name": "thor", "url": "http://127.0.0.1:9000"}]
    assert parse_config({"engines": engines}).observe.worker_priority is WorkerPriority.IDLE
    observe = parse_config({"engines": engines, "observe": {"worker_priority": "nice",
                                                            "worker_starved_after_seconds": 5}}).observe
    assert (observe.worker_priority, observe.worker_starved_after_seconds) == (WorkerPriority.NICE, 5.0)
    with pytest.raises(ConfigError) as caught:
        parse_config({"engines": engines, "observe": {"worker_priority": "realtime", "worker_starved_after_seconds": 0}})
    assert {p.split(":")[0] for p in caught.value.problems} == {"observe.worker_priority",
                                                                  "observe.worker_starved_after_seconds"}


def test_envoys_worker_threads_are_configurable_and_reach_its_command_line_and_the_deployment() -> None:
    """``envoy.concurrency`` (2 by default) is Envoy's ``--concurrency`` wherever sluice starts or deploys it; anything but
    a whole number from 1 is a problem with its path."""
    from pathlib import Path

    from sluice import deploy
    from sluice.envoyrun import envoy_command

    def threads(command: list[str]) -> str:
        return command[command.index("--concurrency") + 1]

    assert parse_config(ONE).envoy.concurrency == 2
    config = parse_config({**ONE, "envoy": {"concurrency": 8}})
    assert threads(envoy_command(config, Path("bootstrap.yaml"))) == "8"
    envoy = next(o for o in deploy.base_manifests({**ONE, "envoy": {"concurrency": 8}}, config)["envoy.yaml"]
                 if o["kind"] == "Deployment")
    assert threads(envoy["spec"]["template"]["spec"]["containers"][0]["args"]) == "8"
    for bad in (0, 1.5, "two"):
        with pytest.raises(ConfigError) as caught:
            parse_config({**ONE, "envoy": {"concurrency": bad}})
        assert [p.split(":")[0] for p in caught.value.problems] == ["envoy.concurrency"]


def test_adapters_and_adapter_slots_are_configured_and_checked() -> None:
    config = parse_config({"engines": [{"name": "a", "url": "http://127.0.0.1:1", "max_loras": 4}],
                           "adapters": {"swap_seconds": 0.8, "models": {"acme-sql": "llama-8b"}}})
    assert config.engines[0].max_loras == 4
    assert config.policy.adapters.swap_s == 0.8
    assert dict(config.policy.adapters.base_models) == {"acme-sql": "llama-8b"}
    default = parse_config(ONE)
    assert default.engines[0].max_loras is None and default.policy.adapters.swap_s == 0.5
    with pytest.raises(ConfigError) as caught:
        parse_config({"engines": [{"name": "a", "url": "http://127.0.0.1:1", "max_loras": 0}],
                      "adapters": {"swap_seconds": -1, "speed": 2,
                                   "models": {"x": "x", "y": "z", "z": "base", "w": 3}}})
    assert sorted(caught.value.problems) == [
        "adapters.models.w: must name its base model, got 3",
        "adapters.models.x: an adapter cannot be its own base model",
        "adapters.models.y: its base 'z' is itself an adapter",
        "adapters.speed: unknown field",
        "adapters.swap_seconds: must be >= 0 and <= 600, got -1",
        "engines[0].max_loras: must be >= 1, got 0",
    ]
