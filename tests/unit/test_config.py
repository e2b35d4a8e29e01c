"""Config validation: all-or-nothing, every problem reported with its dotted path."""

from __future__ import annotations

import pytest

from controlplane.config import ConfigError, load_config, parse_config


def test_bundled_default_is_valid() -> None:
    config = load_config(None)
    assert [e.name for e in config.engines] == ["thor", "spark"]
    assert [e.sim for e in config.engines] == ["thor", "spark"]
    assert config.envoy.listen_port == 8080 and config.controlplane.grpc_port == 18000
    assert config.envoy.max_request_bytes == 1024 * 1024
    assert config.engines[0].max_num_seqs == 2  # from the simulator profile


def test_every_problem_is_reported_at_once() -> None:
    raw = {
        "envoy": {"listen_port": 70000, "max_request_bytes": "big", "bogus": 1},
        "observe": {"poll_interval_seconds": 0.5, "poll_timeout_seconds": 2},
        "engines": [
            {"name": "thor", "url": "ftp://x"},
            {"name": "thor", "url": "http://127.0.0.1:1", "sim": "nope", "max_num_seqs": 0},
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


def test_hostnames_resolve_to_addresses() -> None:
    config = parse_config({"engines": [{"name": "a", "url": "http://localhost:8000"}]})
    assert config.engines[0].host in {"127.0.0.1", "::1"} and config.engines[0].port == 8000


def test_unreadable_file_is_a_config_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("engines: [")
    with pytest.raises(ConfigError, match="yaml"):
        load_config(str(bad))
