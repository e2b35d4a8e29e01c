"""The configuration reference (docs/configuration.md), rendered from the config types.

``python -m controlplane.config.reference > docs/configuration.md`` writes it; a unit test keeps the file equal to
``render()``. One section per key of ``ConfigFile``, introduced by that field's docstring; one row per key below it
(nested mappings and list items included): its path, its type and bounds, its default, and the first paragraph of its
field's docstring. A key without a docstring is an error, so every key has a meaning.
"""

from __future__ import annotations

import ast
import enum
import inspect
import re
import typing
from collections.abc import Iterator, Mapping
from dataclasses import is_dataclass

from controlplane.config.defaults import ConfigFile
from controlplane.config.setting import Key, keys_of
from controlplane.config.types import RELOADABLE

COMMAND = "python -m controlplane.config.reference > docs/configuration.md"

_HEADER = f"""# Configuration reference

Generated from the config types (`controlplane/config/`); a unit test keeps this file equal to them, so edit a key's
field and its docstring there, never this file, and regenerate:

    {COMMAND}

A config is one YAML file (`controlplane/default.yaml` is the embedded default); every key is optional but `engines`.
A reloadable section is taken by a running control plane on a reload (`sluice admin reload`); any other change needs a
restart. Types, units and validation: "Configuration" in [architecture.md](architecture.md#configuration).
"""


def field_docs(shape: type) -> dict[str, str]:
    """Field name -> its docstring (the string literal right after the field), read from ``shape``'s source."""
    tree = ast.parse(inspect.cleandoc("\n" + inspect.getsource(shape)))
    body = next(node for node in tree.body if isinstance(node, ast.ClassDef)).body
    docs = {}
    for node, following in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(following, ast.Expr) \
                and isinstance(following.value, ast.Constant) and isinstance(following.value.value, str):
            docs[node.target.id] = inspect.cleandoc(following.value.value)
    return docs


def meaning(shape: type, key: Key) -> str:
    """The first paragraph of the key's field docstring, on one line, in Markdown."""
    doc = field_docs(shape).get(key.field)
    if not doc:
        raise ValueError(f"{shape.__name__}.{key.field} has no docstring: the reference needs the key's meaning")
    return _markdown(" ".join(doc.split("\n\n")[0].split()))


def _markdown(text: str) -> str:
    return re.sub(r"``(.+?)``", r"`\1`", text).replace("|", "\\|")


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)


def _type(key: Key) -> str:
    kind = key.inner
    if kind is bool:
        return "boolean"
    if kind in (int, float):
        name, low, high = "integer" if kind is int else "number", key.setting.minimum, key.setting.maximum
        if low is None:
            return name
        return f"{name} >= {_number(low)}" if high is None else f"{name} {_number(low)} to {_number(high)}"
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return " \\| ".join(f"`{member.value}`" for member in kind)
    if kind is str:
        return "string"
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is tuple:
        return "list of mappings" if is_dataclass(args[0]) else "list of strings"
    return "mapping"


def _default(key: Key) -> str:
    value = key.default
    if key.setting.default:
        return key.setting.default
    if key.required:
        return "required"
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, enum.Enum):
        return f"`{value.value}`"
    if isinstance(value, (int, float)):
        return _number(value)
    if isinstance(value, str):
        return f"`{value}`"
    if isinstance(value, tuple):
        return ", ".join(f"`{v}`" for v in value) or "[]"
    if isinstance(value, Mapping) or is_dataclass(value):
        return "{}"
    raise TypeError(f"{key.name}: no way to write the default {value!r}")


def _nested(key: Key) -> tuple[str, type] | None:
    """(path suffix, type) of the keys nested under ``key``: a mapping, a list of mappings, or a mapping keyed by the
    user's names; None for a value."""
    kind = key.inner
    args = typing.get_args(kind)
    if isinstance(kind, type) and is_dataclass(kind):
        return ".", kind
    if typing.get_origin(kind) is tuple and isinstance(args[0], type) and is_dataclass(args[0]):
        return "[].", args[0]
    if typing.get_origin(kind) is Mapping and isinstance(args[1], type) and is_dataclass(args[1]):
        return f".{key.setting.placeholder}.", args[1]
    return None


def _rows(prefix: str, shape: type, only: tuple[str, ...] | None = None) -> Iterator[str]:
    for key in keys_of(shape):
        if only is not None and key.name not in only:
            continue
        path = prefix + key.name
        reloadable = " Reloadable." if path in RELOADABLE else ""
        yield f"| `{path}` | {_type(key)} | {_default(key)} | {meaning(shape, key)}{reloadable} |"
        nested = _nested(key)
        if nested is not None:
            yield from _rows(path + nested[0], nested[1], key.setting.keys)


def render() -> str:
    """docs/configuration.md."""
    out = [_HEADER]
    for section in keys_of(ConfigFile):
        name = section.name
        out.append(f"## `{name}`" + (" (reloadable)" if name in RELOADABLE else "") + "\n")
        nested = _nested(section)
        table = ["| key | type | default | meaning |", "|---|---|---|---|"]
        if nested is None:  # a mapping of the user's names to values: one row stands for every entry
            entry = Key(f"{name}.{section.setting.placeholder}", section.field, typing.get_args(section.inner)[1], None,
                        section.setting)
            table.append(f"| `{entry.name}` | {_type(entry)} | {_default(entry)} | {meaning(ConfigFile, entry)} |")
        else:
            out.append(meaning(ConfigFile, section) + "\n")
            table.extend(_rows(name + nested[0], nested[1]))
        out.append("\n".join(table) + "\n")
    return "\n".join(out)


if __name__ == "__main__":
    print(render(), end="")
