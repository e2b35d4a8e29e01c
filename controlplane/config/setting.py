"""How a config type states the keys a YAML section may hold.

A section type is a frozen dataclass; each field is a key of the same name (``Setting.key`` spells it otherwise, or marks
a field the file does not hold). The field's default is the key's default, its annotation the key's type, and a
``Setting`` in its metadata (``field(default=..., metadata=setting(minimum=...))``) the key's bounds. ``keys_of`` reads
all of it once per type: the parser checks values with it, ``DEFAULTS`` and the reference are derived from it.
"""

from __future__ import annotations

import enum
import types
import typing
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields, is_dataclass
from typing import Any

_METADATA = "sluice.setting"


@dataclass(frozen=True, slots=True)
class Setting:
    minimum: float | None = None
    maximum: float | None = None
    key: str | None = None
    """The key's spelling when it is not the field's name; ``""``: the file does not hold this field (it is derived)."""
    keys: tuple[str, ...] | None = None
    """A nested mapping's keys accepted here, when not all of its type's (``admin.tls`` takes no ``client_ca_file``)."""
    placeholder: str = "<name>"
    """How the reference names the user's keys of a mapping keyed by names (``models.<id>``)."""
    default: str = ""
    """A default that is no constant (derived from another key, or computed): what an absent key means, in words."""


def setting(*, minimum: float | None = None, maximum: float | None = None, key: str | None = None,
            keys: tuple[str, ...] | None = None, placeholder: str = "<name>", default: str = "") -> dict[str, Setting]:
    """A field's metadata: ``field(default=1.0, metadata=setting(minimum=0.01))``."""
    return {_METADATA: Setting(minimum, maximum, key, keys, placeholder, default)}


@dataclass(frozen=True, slots=True)
class Key:
    """One key of a section type, as the parser and the reference read it."""

    name: str
    """The key as the file spells it."""
    field: str
    """The dataclass field holding it."""
    hint: Any
    """The field's annotation, resolved (``X | None`` included)."""
    default: Any
    """The field's default (``MISSING``: the key is required)."""
    setting: Setting

    @property
    def inner(self) -> Any:
        """The annotation without ``| None``."""
        return without_none(self.hint)

    @property
    def optional(self) -> bool:
        return self.inner is not self.hint

    @property
    def integer(self) -> bool:
        return self.inner is int

    @property
    def required(self) -> bool:
        return self.default is MISSING


def without_none(hint: Any) -> Any:
    """``X`` for ``X | None`` (one other member only); any other annotation as it is."""
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        rest = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return hint


_KEYS: dict[type, tuple[Key, ...]] = {}


def keys_of(shape: type[Any]) -> tuple[Key, ...]:
    """The keys of a section type, in field order (fields the file does not hold left out)."""
    if shape not in _KEYS:
        _KEYS[shape] = _keys(shape)
    return _KEYS[shape]


def _keys(shape: type) -> tuple[Key, ...]:
    hints = typing.get_type_hints(shape)
    out = []
    for f in fields(shape):
        spec = f.metadata.get(_METADATA, Setting())
        if spec.key == "":
            continue
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        out.append(Key(spec.key or f.name, f.name, hints[f.name], default, spec))
    return tuple(out)


def key_names(shape: type) -> frozenset[str]:
    return frozenset(k.name for k in keys_of(shape))


def key_of(shape: type, name: str) -> Key:
    return next(k for k in keys_of(shape) if k.name == name)


def plain(value: Any, *, drop_none: bool = False) -> Any:
    """A value as YAML writes it: an enum as its string, a tuple as a list, a mapping as a dict with string keys.
    ``drop_none``: a mapping's unset (None) entries are left out, at every depth (the policy as text does; the
    defaults keep them)."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [plain(v, drop_none=drop_none) for v in value]
    if isinstance(value, Mapping):
        return {str(k): plain(v, drop_none=drop_none) for k, v in value.items() if not (drop_none and v is None)}
    return value


def defaults(shape: type) -> dict[str, Any]:
    """Key -> default of every key of ``shape`` that has one (what a section holds when the file says nothing)."""
    return {k.name: plain(k.default) for k in keys_of(shape) if not k.required}


def core_field(target: type, key: str) -> str:
    """The field of the core type ``target`` that a key becomes: the one of the same name, else the key with
    ``_seconds`` spelled ``_s`` (the one translation between the file's units and the code's)."""
    names = {f.name for f in fields(target)} if is_dataclass(target) else set()
    if key in names:
        return key
    short = key.removesuffix("_seconds") + "_s"
    if key.endswith("_seconds") and short in names:
        return short
    raise KeyError(f"{target.__name__} has no field for the key {key!r}")
