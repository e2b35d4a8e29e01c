"""Checking the reloadable sections the decision core's types are built from (``policy.py``): ``admission``, ``models``,
``version_floors``, ``boxes``, ``fairness``, ``adapters`` and ``tenants``. Each key becomes the core field
``core_field`` names; the checks here are the ones that span keys or entries."""

from __future__ import annotations

import re
from dataclasses import fields
from typing import Any

from controlplane.config.check import Checker
from controlplane.config.policy import (
    AdaptersConfig, AdmissionConfig, BoxConfig, FairnessConfig, ModelConfig, TenantConfig, TenantPriority,
)
from controlplane.config.setting import core_field, key_names, key_of, keys_of
from controlplane.core.adapters import AdapterPolicy
from controlplane.core.fairshare import FairMode, FairShare
from controlplane.core.model import Priority
from controlplane.core.policy import Box, ModelPolicy, Policy, version_key
from controlplane.core.reserve import oversubscribed
from controlplane.core.tenants import PRIORITY_RANK, Tenant, Tenants
from ratelimit.config import parse_limits

_TENANT_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
"""A tenant's name is a metrics label and a limiter key: short, and without ``/`` (which joins it to a model)."""
_DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")


def parse_policy(c: Checker, raw: dict[str, Any], engine_names: set[str], tenants: Tenants) -> Policy:
    """The ``admission``, ``models``, ``version_floors``, ``boxes``, ``fairness`` and ``adapters`` sections as one
    ``Policy``."""
    admission = c.settings("admission", c.section(raw, "admission", AdmissionConfig), AdmissionConfig)
    if admission.retry_after_min_seconds > admission.retry_after_max_seconds:
        c.problems.append("admission.retry_after_min_seconds: must not exceed admission.retry_after_max_seconds")
    models = _models(c, raw.get("models") or {})
    floors = _version_floors(c, raw.get("version_floors") or {})
    boxes = _boxes(c, raw.get("boxes") or [], engine_names, models)
    return Policy(**{core_field(Policy, f.name): getattr(admission, f.name) for f in fields(admission)},
                  models=models, version_floors=floors, boxes=boxes, fairness=_fairness(c, raw, tenants),
                  adapters=_adapters(c, raw))


def _models(c: Checker, raw: Any) -> dict[str, ModelPolicy]:
    if not isinstance(raw, dict):
        c.problems.append("models: must be a mapping of model id -> settings")
        return {}
    models: dict[str, ModelPolicy] = {}
    for model_id, path, item in c.entries("models", raw, key_names(ModelConfig)):
        values = {core_field(ModelPolicy, k.name): c.bounded(f"{path}.{k.name}", item[k.name], k)
                  for k in keys_of(ModelConfig) if item.get(k.name) is not None}
        models[str(model_id)] = ModelPolicy(**values)
    return models


def _version_floors(c: Checker, raw: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(raw, dict):
        c.problems.append("version_floors: must be a mapping of model pattern -> minimum engine version")
        return ()
    floors: list[tuple[str, str]] = []
    for pattern, version in raw.items():
        if not isinstance(version, (str, int, float)) or not version_key(str(version)):
            c.problems.append(f"version_floors.{pattern}: {version!r} is not a version")
            continue
        floors.append((str(pattern), str(version)))
    return tuple(floors)


def _boxes(c: Checker, raw: Any, engine_names: set[str], models: dict[str, ModelPolicy]) -> tuple[Box, ...]:
    if not isinstance(raw, list):
        c.problems.append("boxes: must be a list")
        return ()
    boxes: list[Box] = []
    placed: set[str] = set()
    for i, path, item in c.entries("boxes", raw, key_names(BoxConfig)):
        members = item.get("engines")
        if not isinstance(members, list) or not members:
            c.problems.append(f"{path}.engines: must be a non-empty list of engine names")
            members = []
        for name in members:
            if name not in engine_names:
                c.problems.append(f"{path}.engines: unknown engine {name!r}")
            if name in placed:
                c.problems.append(f"{path}.engines: engine {name!r} is already in another box")
            placed.add(name)
        tokens, size = (c.value(f"{path}.{key}", item[key], key_of(BoxConfig, key)) if item.get(key) is not None
                        else None for key in ("kv_budget_tokens", "kv_budget_bytes"))
        if tokens is None and size is None:
            c.problems.append(f"{path}: needs kv_budget_tokens or kv_budget_bytes")
        if size is not None and tokens is None and not any(m.kv_bytes_per_token for m in models.values()):
            c.problems.append(f"{path}.kv_budget_bytes: needs models.<id>.kv_bytes_per_token for at least one model")
        boxes.append(Box(str(item.get("name") or f"box{i}"), tuple(members), tokens, size))
    return tuple(boxes)


def _fairness(c: Checker, raw: dict[str, Any], tenants: Tenants) -> FairShare:
    """``fairness`` and each tenant's ``weight`` and ``reserved_share`` (core/fairshare.py). ``enabled: auto``: on as soon
    as one tenant is configured."""
    fs = c.section(raw, "fairness", FairnessConfig)
    enabled = fs.get("enabled", key_of(FairnessConfig, "enabled").default)
    if isinstance(enabled, bool):
        mode = FairMode.ON if enabled else FairMode.OFF
    else:
        mode = c.choice("fairness.enabled", enabled, FairMode)
    fairness = c.settings("fairness", fs, FairnessConfig, enabled=mode)
    return FairShare(
        enabled=mode is FairMode.ON or (mode is FairMode.AUTO and tenants.enabled),
        mode=mode,
        prompt_weight=fairness.prompt_weight,
        output_weight=fairness.output_weight,
        weights={name: t.weight for name, t in tenants.by_name.items() if t.weight is not None},
        default_weight=fairness.default_weight,
        lift_credit_requests=fairness.lift_credit_requests,
        across_replicas=fairness.across_replicas,
        reserved={name: t.reserved_share for name, t in tenants.by_name.items() if t.reserved_share > 0},
        preempt_sheddable=fairness.preempt_sheddable,
        preempt_max_per_minute=fairness.preempt_max_per_minute,
        preempt_grace_ms=fairness.preempt_grace_ms,
    )


def _adapter_strings(c: Checker, ad: dict[str, Any], key: str, what: str) -> dict[str, str]:
    """``adapters.<key>``: a mapping of adapter name -> a non-empty string (``what`` it names); bad entries are
    problems and left out."""
    raw = ad.get(key) or {}
    if not isinstance(raw, dict):
        c.problems.append(f"adapters.{key}: must be a mapping of adapter -> {what}")
        return {}
    out: dict[str, str] = {}
    for adapter, value in raw.items():
        if not isinstance(adapter, str) or not adapter or not isinstance(value, str) or not value:
            c.problems.append(f"adapters.{key}.{adapter}: must name its {what}, got {value!r}")
        else:
            out[adapter] = value
    return out


def _adapters(c: Checker, raw: dict[str, Any]) -> AdapterPolicy:
    """``adapters`` (core/adapters.py). An adapter is not a base model of another adapter, and not its own base; an
    adapter with a path has a base."""
    ad = c.section(raw, "adapters", AdaptersConfig)
    bases: dict[str, str] = {}
    for adapter, base in _adapter_strings(c, ad, "models", "base model").items():
        if base == adapter:
            c.problems.append(f"adapters.models.{adapter}: an adapter cannot be its own base model")
        else:
            bases[adapter] = base
    for adapter, base in bases.items():
        if base in bases:
            c.problems.append(f"adapters.models.{adapter}: its base {base!r} is itself an adapter")
    paths: dict[str, str] = {}
    for adapter, path in _adapter_strings(c, ad, "paths", "path").items():
        if adapter in bases:
            paths[adapter] = path
        else:
            c.problems.append(f"adapters.paths.{adapter}: needs its base model in adapters.models")
    adapters = c.settings("adapters", ad, AdaptersConfig, models=bases, paths=paths)
    return AdapterPolicy(swap_s=adapters.swap_seconds, base_models=bases, swap_min_samples=adapters.swap_min_samples,
                         load_headroom=adapters.load_headroom, home_margin=adapters.home_margin,
                         dynamic_loading=adapters.dynamic_loading, loads_per_minute=adapters.loads_per_minute,
                         load_timeout_s=adapters.load_timeout_seconds, paths=paths)


def parse_tenants(c: Checker, raw: Any) -> Tenants:
    """``tenants: {name: {keys, priority: {default, max}, limits, models: {model: limits}, models_allowed, weight,
    reserved_share}}``; any problem leaves no tenant."""
    if raw is None:
        return Tenants()
    if not isinstance(raw, dict):
        c.problems.append("tenants: must be a mapping of tenant name -> settings")
        return Tenants()
    before = len(c.problems)
    tenants: list[Tenant] = []
    owner: dict[str, str] = {}
    for name, path, item in c.entries("tenants", raw, key_names(TenantConfig)):
        name = str(name)
        if not _TENANT_NAME_RE.match(name):
            c.problems.append(f"{path}: the name must match {_TENANT_NAME_RE.pattern} (it labels metrics and names a "
                              "budget)")
        digests = _digests(c, path, item.get("keys"), owner, name)
        default_class, max_class = _priorities(c, path, item.get("priority"))
        limits, problems = parse_limits(item.get("limits") or {}, f"{path}.limits")
        c.problems.extend(problems)
        model_limits = {}
        models = item.get("models")
        if models is not None and not isinstance(models, dict):
            c.problems.append(f"{path}.models: must be a mapping of model id -> limits")
            models = {}
        for model, section in (models or {}).items():
            parsed, problems = parse_limits(section or {}, f"{path}.models.{model}")
            c.problems.extend(problems)
            model_limits[str(model)] = parsed
        allowed = item.get("models_allowed")
        if allowed is not None and (not isinstance(allowed, list) or not all(isinstance(m, str) and m
                                                                            for m in allowed)):
            c.problems.append(f"{path}.models_allowed: must be a list of model ids")
            allowed = None
        if allowed is not None:
            for model in model_limits:
                if model not in allowed:
                    c.problems.append(f"{path}.models.{model}: limits a model models_allowed does not allow")
        weight = item.get("weight")
        if weight is not None:
            weight = c.value(f"{path}.weight", weight, key_of(TenantConfig, "weight"))
        reserved = item.get("reserved_share")
        share = key_of(TenantConfig, "reserved_share")
        reserved = share.default if reserved is None else c.value(f"{path}.reserved_share", reserved, share)
        tenants.append(Tenant(name, tuple(digests), default_class, max_class, limits, model_limits,
                              frozenset(allowed) if allowed is not None else None, weight, reserved))
    if (why := oversubscribed({t.name: t.reserved_share for t in tenants})) is not None:
        c.problems.append(f"tenants: {why}; lower them (core/reserve.py: shares are guarantees, never scaled)")
    if len(c.problems) > before:
        return Tenants()
    return Tenants.of(tenants)


def _digests(c: Checker, path: str, keys: Any, owner: dict[str, str], tenant: str) -> list[str]:
    """The tenant's API key digests, lower-case; ``owner`` (digest -> tenant) refuses one listed by two tenants."""
    if not isinstance(keys, list) or not keys:
        c.problems.append(f"{path}.keys: must be a non-empty list of SHA-256 hex digests of API keys "
                          "(printf %s KEY | sha256sum)")
        keys = []
    digests: list[str] = []
    for i, digest in enumerate(keys):
        if not isinstance(digest, str) or not _DIGEST_RE.match(digest.lower()):
            # Never echo the value: it may be a key pasted where its digest belongs.
            c.problems.append(f"{path}.keys[{i}]: must be a SHA-256 hex digest (64 hex characters), not a key")
            continue
        digest = digest.lower()
        if digest in owner:
            c.problems.append(f"{path}.keys[{i}]: the same key digest is listed by tenant {owner[digest]!r}")
        owner.setdefault(digest, tenant)
        digests.append(digest)
    return digests


def _priorities(c: Checker, path: str, priority: Any) -> tuple[Priority, Priority]:
    """A tenant's default class and the highest it may ask for (absent: its default)."""
    default_class: Priority = key_of(TenantPriority, "default").default
    max_class: Priority | None = None
    if priority is not None:
        if not isinstance(priority, dict):
            c.problems.append(f"{path}.priority: must be a mapping of default and max")
            priority = {}
        for key in sorted(set(priority) - key_names(TenantPriority)):
            c.problems.append(f"{path}.priority.{key}: unknown field")
        if priority.get("default") is not None:
            default_class = c.choice(f"{path}.priority.default", priority["default"], Priority)
        if priority.get("max") is not None:
            max_class = c.choice(f"{path}.priority.max", priority["max"], Priority)
    if max_class is None:
        max_class = default_class
    if PRIORITY_RANK[default_class] > PRIORITY_RANK[max_class]:
        c.problems.append(f"{path}.priority.default: {default_class.value} is above max ({max_class.value})")
    return default_class, max_class
