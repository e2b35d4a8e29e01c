"""Limits from YAML, checked all-or-nothing: every problem is reported at once with its dotted path
(``descriptors[0].rate_limit.unit: ...``), and a file with any problem is refused whole (``LimitsConfigError``).

Two shapes: ``parse_limits``, one key's limits as a tenant's ``limits:`` section carries them; and
``load_descriptor_config``, what ``sluice ratelimit`` (Envoy's rate-limit service) enforces, in the format of
envoyproxy/ratelimit's files (its subset: no ``shadow_mode``, ``replaces``, ``detailed_metric``).

A request descriptor ``[(k1, v1), (k2, v2)]`` walks the descriptor tree: at each level the node with that key and value,
else the node with that key and no value; the limit is the ``rate_limit`` of the node its last entry reaches. A
descriptor that leaves the tree, or ends on a node without ``rate_limit``, is not limited.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import yaml

from ratelimit.core import Limits, Rate

UNITS: Mapping[str, float] = {"second": 1.0, "minute": 60.0, "hour": 3600.0, "day": 86400.0, "week": 7 * 86400.0,
                              "month": 30 * 86400.0, "year": 365 * 86400.0}
"""A ``rate_limit.unit``'s period in seconds (a GCRA has no calendar: a month is 30 days, a year 365)."""

LIMIT_FIELDS = ("requests_per_minute", "tokens_per_minute", "concurrent_requests")
MAX_DEPTH = 8
"""Descriptor nesting deeper than this is refused (Envoy's actions rarely chain more than three entries)."""


class LimitsConfigError(ValueError):
    """Every problem of a limits configuration, each ``path: what is wrong``."""

    def __init__(self, problems: Sequence[str], source: str = "") -> None:
        self.problems = list(problems)
        head = f"{source}: " if source else ""
        super().__init__(head + "invalid rate-limit configuration:\n  " + "\n  ".join(self.problems))


def _positive_int(raw: Any, path: str, problems: list[str]) -> int | None:
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < 1:
        problems.append(f"{path}: must be an integer >= 1, not {raw!r}")
        return None
    return raw


def _mapping(raw: Any, path: str, problems: list[str], allowed: Sequence[str]) -> Mapping[str, Any] | None:
    if not isinstance(raw, Mapping):
        problems.append(f"{path}: must be a mapping, not {type(raw).__name__}")
        return None
    for key in raw:
        if key not in allowed:
            problems.append(f"{path}.{key}: unknown field (expected one of {', '.join(allowed)})")
    return raw


def parse_limits(raw: Any, path: str = "limits") -> tuple[Limits, list[str]]:
    """One key's limits and the problems found (an empty ``Limits`` when there are any)::

        requests_per_minute: 600      # integers >= 1; each one optional (absent: no limit of that kind)
        tokens_per_minute: 200000     # prompt + output tokens
        concurrent_requests: 16
    """
    problems: list[str] = []
    section = _mapping(raw, path, problems, LIMIT_FIELDS)
    if section is None:
        return Limits(), problems
    values = {name: _positive_int(section[name], f"{path}.{name}", problems) for name in LIMIT_FIELDS
              if section.get(name) is not None}
    if problems:
        return Limits(), problems
    return Limits.per_minute(requests=values.get("requests_per_minute"), tokens=values.get("tokens_per_minute"),
                             concurrent=values.get("concurrent_requests")), problems


# ---- Envoy descriptors ----------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class DescriptorNode:
    key: str
    value: str | None
    """``None``: matches any value, each with a budget of its own."""
    rate: Rate | None
    unit: str | None
    """The configured unit name of ``rate`` (what ``current_limit`` reports back to Envoy)."""
    children: tuple[DescriptorNode, ...] = ()


@dataclass(frozen=True, slots=True)
class DescriptorMatch:
    key: str
    """The limiter key of this budget: the domain and every entry, values included (a wildcard node's values too:
    that is what makes one budget per value)."""
    rate: Rate
    unit: str


@dataclass(frozen=True, slots=True)
class DescriptorConfig:
    domain: str
    descriptors: tuple[DescriptorNode, ...]

    def match(self, entries: Sequence[tuple[str, str]]) -> DescriptorMatch | None:
        """The budget a request descriptor's entries reach (``None``: not limited)."""
        level = self.descriptors
        node: DescriptorNode | None = None
        for key, value in entries:
            exact = [n for n in level if n.key == key and n.value == value]
            any_value = [n for n in level if n.key == key and n.value is None]
            found = exact or any_value
            if not found:
                return None
            node = found[0]
            level = node.children
        if node is None or node.rate is None or node.unit is None:
            return None
        return DescriptorMatch(limiter_key(self.domain, entries), node.rate, node.unit)


def limiter_key(domain: str, entries: Sequence[tuple[str, str]]) -> str:
    """``rls:<domain>:<k1>=<v1>:<k2>=<v2>`` with ``%``, ``:`` and ``=`` escaped (so no two descriptors share a key);
    past 256 characters (a long header value), its SHA-256 instead."""
    parts = [quote(domain, safe="")] + [f"{quote(k, safe='')}={quote(v, safe='')}" for k, v in entries]
    text = "rls:" + ":".join(parts)
    if len(text) > 256:
        return "rls:" + quote(domain, safe="") + ":sha256:" + hashlib.sha256(text.encode()).hexdigest()
    return text


_NODE_FIELDS = ("key", "value", "rate_limit", "descriptors")


def _nodes(raw: Any, path: str, problems: list[str], depth: int) -> tuple[DescriptorNode, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        problems.append(f"{path}: must be a list, not {type(raw).__name__}")
        return ()
    if depth > MAX_DEPTH:
        problems.append(f"{path}: nested deeper than {MAX_DEPTH} levels")
        return ()
    nodes: list[DescriptorNode] = []
    seen: set[tuple[str, str | None]] = set()
    for i, item in enumerate(raw):
        here = f"{path}[{i}]"
        section = _mapping(item, here, problems, _NODE_FIELDS)
        if section is None:
            continue
        key = section.get("key")
        if not isinstance(key, str) or not key:
            problems.append(f"{here}.key: must be a non-empty string, not {key!r}")
            continue
        raw_value = section.get("value")
        if raw_value is not None and (isinstance(raw_value, bool) or not isinstance(raw_value, (str, int))):
            problems.append(f"{here}.value: must be a string, not {raw_value!r}")
            continue
        value = None if raw_value is None else str(raw_value)
        if (key, value) in seen:
            problems.append(f"{here}: a second descriptor with key {key!r} and "
                            + (f"value {value!r}" if value is not None else "no value"))
        seen.add((key, value))
        rate, unit = None, None
        if "rate_limit" in section:
            rate, unit = _rate(section["rate_limit"], f"{here}.rate_limit", problems)
        children = _nodes(section.get("descriptors"), f"{here}.descriptors", problems, depth + 1)
        if "rate_limit" not in section and not children and "descriptors" not in section:
            problems.append(f"{here}: neither rate_limit nor descriptors (it would limit nothing)")
        nodes.append(DescriptorNode(key, value, rate, unit, children))
    return tuple(nodes)


def _rate(raw: Any, path: str, problems: list[str]) -> tuple[Rate | None, str | None]:
    section = _mapping(raw, path, problems, ("unit", "requests_per_unit"))
    if section is None:
        return None, None
    unit = section.get("unit")
    if not isinstance(unit, str) or unit.lower() not in UNITS:
        problems.append(f"{path}.unit: must be one of {', '.join(UNITS)}, not {unit!r}")
        unit = None
    if "requests_per_unit" not in section:
        problems.append(f"{path}.requests_per_unit: missing")
        return None, None
    amount = _positive_int(section["requests_per_unit"], f"{path}.requests_per_unit", problems)
    if unit is None or amount is None:
        return None, None
    return Rate(amount, UNITS[unit.lower()]), unit.lower()


def parse_descriptor_config(raw: Any, source: str = "") -> DescriptorConfig:
    problems: list[str] = []
    section = _mapping(raw, "(top level)", problems, ("domain", "descriptors"))
    if section is None:
        raise LimitsConfigError(problems, source)
    domain = section.get("domain")
    if not isinstance(domain, str) or not domain:
        problems.append(f"domain: must be a non-empty string (the ratelimit filter's domain), not {domain!r}")
    if "descriptors" not in section:
        problems.append("descriptors: missing")
    nodes = _nodes(section.get("descriptors"), "descriptors", problems, 1)
    if problems:
        raise LimitsConfigError(problems, source)
    assert isinstance(domain, str)
    return DescriptorConfig(domain, nodes)


def load_descriptor_config(path: str | Path) -> DescriptorConfig:
    """Read and check a descriptor file (``LimitsConfigError`` naming the file and every problem)::

        domain: sluice                 # the ratelimit filter's domain; requests for another domain are not limited
        descriptors:
          - key: generic_key           # a descriptor entry's key ...
            value: models              # ... and value; without value: one budget per distinct value
            rate_limit:
              unit: minute             # second | minute | hour | day | week | month (30 d) | year (365 d)
              requests_per_unit: 60    # integer >= 1
            descriptors: [...]         # entries that follow this one in the same descriptor
    """
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise LimitsConfigError([f"cannot read: {exc.strerror or exc}"], str(path)) from exc
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise LimitsConfigError([f"not YAML: {exc}"], str(path)) from exc
    return parse_descriptor_config(raw, str(path))
