"""Simulated engines as the layer that starts them sees them (``sluice up``, the tests' harness, the benches).

The control plane's config (``controlplane/config/``) only records that an engine is a simulator (``sim: <profile>``); it never
reads the simulator's profiles, so production code does not depend on the test double. What a profile implies for the
config is decided here, before validation, and written into the config the control plane is handed:

- ``sim:`` must name a known profile (``sluice up`` refuses an unknown one, with its dotted path);
- a vLLM-flavoured simulator (``sim_flavor: vllm-v1`` or ``vllm-v0``) that names no ``max_num_seqs`` gets its profile's:
  vLLM exposes no concurrency cap, so the control plane could not learn it (the SGLang and llama.cpp simulators report
  theirs, as the real engines do, and are left alone).
"""

from __future__ import annotations

import copy
from typing import Any

from controlplane.config import ConfigError, parse_config
from enginesim.profiles import PROFILES


def unknown_profiles(raw: Any) -> list[str]:
    """A problem (``engines[i].sim: ...``) per engine naming a simulator profile that does not exist."""
    engines = raw.get("engines") if isinstance(raw, dict) else None
    if not isinstance(engines, list):
        return []
    known = ", ".join(sorted(PROFILES))
    return [f"engines[{i}].sim: unknown simulator profile {e['sim']!r} (known: {known})" for i, e in enumerate(engines)
            if isinstance(e, dict) and isinstance(e.get("sim"), str) and e["sim"] not in PROFILES]


def with_profile_defaults(raw: Any, source: str = "<memory>") -> Any:
    """``raw`` (a config mapping) with each simulated engine's profile defaults written in (a copy; ``raw`` is unchanged
    when there are none to add). Raises ``ConfigError`` with every problem of the config, unknown profiles included."""
    problems = unknown_profiles(raw)
    try:
        config = parse_config(raw, source)
    except ConfigError as exc:
        raise ConfigError(exc.problems + problems) from None
    if problems:
        raise ConfigError(problems)
    missing = [(i, PROFILES[e.sim].max_num_seqs) for i, e in enumerate(config.engines)
               if e.sim and e.max_num_seqs is None and e.sim_flavor.startswith("vllm")]
    if not missing:
        return raw
    out = copy.deepcopy(raw)
    for i, cap in missing:
        out["engines"][i]["max_num_seqs"] = cap
    return out
