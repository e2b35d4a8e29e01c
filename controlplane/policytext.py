"""The running policy as config-shaped YAML (``GetPolicy``, ``sluice admin policy``, the audit log's before/after): the
``admission``, ``models``, ``version_floors`` and ``boxes`` sections, in the spelling a config file uses, so the text can be
pasted back into one."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import yaml

from controlplane.config.policy import admission_values
from controlplane.config.setting import plain
from controlplane.core.policy import Policy


def _plain(value: Any) -> Any:
    return plain(value, drop_none=True)


def policy_raw(policy: Policy) -> dict[str, Any]:
    return {
        "admission": {key: _plain(value) for key, value in admission_values(policy).items()},
        "models": {m: _plain(asdict(mp)) for m, mp in sorted(policy.models.items())},
        "version_floors": {pattern: version for pattern, version in policy.version_floors},
        "boxes": [_plain(asdict(b)) for b in policy.boxes],
    }


def policy_yaml(policy: Policy) -> str:
    return yaml.safe_dump(policy_raw(policy), sort_keys=False)
