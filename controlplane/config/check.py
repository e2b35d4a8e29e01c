"""Checking raw YAML values: every problem is collected with its dotted path (``engines[1].url: ...``), none stops the
check, and a refused value is replaced by a harmless one so checking goes on. ``ConfigError`` carries them all."""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping
from typing import Any, TypeVar

from controlplane.config.setting import Key, keys_of

_E = TypeVar("_E", bound=enum.StrEnum)
_T = TypeVar("_T")


class ConfigError(ValueError):
    """Every problem found in a config, one per line, each with its dotted path."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("invalid config:\n  " + "\n  ".join(problems))
        self.problems = problems


class Checker:
    def __init__(self) -> None:
        self.problems: list[str] = []

    def section(self, raw: dict[str, Any], name: str, shape: type) -> dict[str, Any]:
        """The mapping under ``name`` (empty when absent), its keys unknown to ``shape`` reported."""
        value = raw.get(name, {})
        if value is None:
            value = {}
        if not isinstance(value, dict):
            self.problems.append(f"{name}: must be a mapping")
            value = {}
        known = {k.name for k in keys_of(shape)}
        for key in sorted(set(value) - known):
            self.problems.append(f"{name}.{key}: unknown field")
        return value

    def settings(self, path: str, values: Mapping[str, Any], shape: type[_T], **checked: Any) -> _T:
        """``shape`` built from ``values``: each key checked against its field (``value``), an absent one taking the
        field's default; the fields in ``checked`` are taken as the caller checked them."""
        kwargs = dict(checked)
        for key in keys_of(shape):
            if key.field not in checked and (key.name in values or key.required):
                kwargs[key.field] = self.value(f"{path}.{key.name}", values.get(key.name), key)
        return shape(**kwargs)

    def value(self, path: str, value: Any, key: Key) -> Any:
        """``value`` checked against ``key``'s type and bounds: a number (``int`` or ``float``, within the bounds), a flag,
        a member of an enum, or a non-empty string; ``None`` where the type allows it."""
        if value is None and key.optional:
            return None
        kind = key.inner
        if kind is bool:
            return self.flag(path, value)
        if kind in (int, float):
            if key.setting.minimum is None:
                raise TypeError(f"{path}: a number needs a minimum in its Setting")
            number = self.number(path, value, minimum=key.setting.minimum, maximum=key.setting.maximum,
                                 integer=kind is int)
            return kind(number)
        if isinstance(kind, type) and issubclass(kind, enum.StrEnum):
            return self.choice(path, value, kind)
        if kind is str:
            return self.text(path, value)
        raise TypeError(f"{path}: {kind!r} is checked by its section's parser")

    def number(self, path: str, value: Any, *, minimum: float, integer: bool = False, maximum: float | None = None) -> Any:
        kinds = (int,) if integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds):
            self.problems.append(f"{path}: must be {'an integer' if integer else 'a number'}, got {value!r}")
            return minimum
        if value < minimum or (maximum is not None and value > maximum):
            bound = f">= {minimum}" + (f" and <= {maximum}" if maximum is not None else "")
            self.problems.append(f"{path}: must be {bound}, got {value!r}")
        return value

    def bounded(self, path: str, value: Any, key: Key) -> Any:
        """``value`` checked as ``key``'s number, kept as given (an integer stays one where a float is allowed)."""
        return self.number(path, value, minimum=key.setting.minimum or 0, maximum=key.setting.maximum,
                           integer=key.integer)

    def entries(self, section: str, items: list[Any] | dict[str, Any],
                known: frozenset[str]) -> Iterator[tuple[int | str, str, dict[str, Any]]]:
        """(index or key, dotted path, mapping) for each mapping in a list section (``boxes[0]``) or a mapping section
        (``models.cortex``); non-mappings and unknown keys are reported."""
        pairs = items.items() if isinstance(items, dict) else enumerate(items)
        for i, item in pairs:
            path = f"{section}.{i}" if isinstance(items, dict) else f"{section}[{i}]"
            if not isinstance(item, dict):
                self.problems.append(f"{path}: must be a mapping")
                continue
            for key in sorted(set(item) - known):
                self.problems.append(f"{path}.{key}: unknown field")
            yield i, path, item

    def flag(self, path: str, value: Any) -> bool:
        if not isinstance(value, bool):
            self.problems.append(f"{path}: must be true or false, got {value!r}")
            return False
        return value

    def choice(self, path: str, value: Any, kind: type[_E]) -> _E:
        allowed = [member.value for member in kind]
        if not isinstance(value, str) or value not in allowed:
            self.problems.append(f"{path}: must be one of {', '.join(allowed)}, got {value!r}")
            return kind(allowed[0])
        return kind(value)

    def optional_text(self, path: str, value: Any) -> str | None:
        if value is None:
            return None
        return self.text(path, value)

    def text(self, path: str, value: Any) -> str:
        if not isinstance(value, str) or not value:
            self.problems.append(f"{path}: must be a non-empty string")
            return ""
        return value

    def files(self, path: str, value: Any, known: tuple[str, ...]) -> dict[str, str | None] | None:
        """A TLS block: None when absent (or refused: its problems reported), else each of ``known`` (a non-empty path
        string, or None when not given)."""
        if value is None:
            return None
        if not isinstance(value, dict):
            self.problems.append(f"{path}: must be a mapping of {', '.join(known)}")
            return None
        before = len(self.problems)
        for key in sorted(set(value) - set(known)):
            self.problems.append(f"{path}.{key}: unknown field")
        block = {key: self.optional_text(f"{path}.{key}", value.get(key)) for key in known}
        return block if len(self.problems) == before else None  # a block with a bad field is refused whole, once
