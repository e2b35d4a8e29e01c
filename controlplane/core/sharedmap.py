"""A dictionary whose read-only snapshots share what did not change: ``SharedMap`` is written like a dict, and
``snapshot()`` hands out a ``FrozenMap`` that never changes afterwards. Pure; no I/O.

The keys are spread over ``CHUNKS`` small dictionaries: a snapshot is a tuple of them (no entry copied), and the first
write to a chunk after a snapshot copies that chunk alone. Reading a snapshot costs one tuple index more than a dict;
the map itself is read as a plain dict. Per-engine maps that a Check freezes while only a few entries change between
Checks (ledger views, serve counts, decode rates) cost a few chunk copies instead of a copy of every engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import TypeVar, overload

_K = TypeVar("_K")
_V = TypeVar("_V")
_D = TypeVar("_D")

CHUNKS = 64
_MASK = CHUNKS - 1


class FrozenMap(Mapping[_K, _V]):
    """A read-only snapshot of a ``SharedMap``: the key's chunk, then the key (``get`` without Mapping's exception on a
    miss)."""

    __slots__ = ("_chunks", "_len")

    def __init__(self, chunks: tuple[dict[_K, _V], ...], length: int) -> None:
        self._chunks = chunks  # never written again: the SharedMap copies a chunk before writing to it
        self._len = length

    def __getitem__(self, key: _K) -> _V:
        return self._chunks[hash(key) & _MASK][key]

    @overload
    def get(self, key: _K, /) -> _V | None: ...

    @overload
    def get(self, key: _K, default: _V | _D, /) -> _V | _D: ...

    def get(self, key: _K, default: object = None, /) -> object:
        return self._chunks[hash(key) & _MASK].get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self._chunks[hash(key) & _MASK]

    def __iter__(self) -> Iterator[_K]:
        for chunk in self._chunks:
            yield from chunk

    def __len__(self) -> int:
        return self._len

    def __repr__(self) -> str:
        return f"FrozenMap({dict(self.items())!r})"


class SharedMap(Mapping[_K, _V]):
    """A mutable mapping (``m[k] = v``, ``del m[k]``, ``pop``) whose ``snapshot()`` costs no copy of its entries.

    The map is a plain dict (read at C speed; ``live()`` hands out a read-only view of it, for hot loops such as the
    fleet index's row fills); beside it, the same entries spread over ``CHUNKS`` dicts, which is what a snapshot holds."""

    __slots__ = ("_entries", "_chunks", "_owned", "_frozen")

    def __init__(self, items: Iterable[tuple[_K, _V]] = ()) -> None:
        self._entries: dict[_K, _V] = {}
        self._chunks: list[dict[_K, _V]] = [{} for _ in range(CHUNKS)]
        self._owned = [True] * CHUNKS
        """Whether each chunk is this map's alone (no snapshot holds it), so it may be written in place."""
        self._frozen: FrozenMap[_K, _V] | None = None
        for key, value in items:
            self[key] = value

    def live(self) -> Mapping[_K, _V]:
        """A read-only view of the map as it is at each read (not a snapshot: later writes show through)."""
        return MappingProxyType(self._entries)

    def __getitem__(self, key: _K) -> _V:
        return self._entries[key]

    @overload
    def get(self, key: _K, /) -> _V | None: ...

    @overload
    def get(self, key: _K, default: _V | _D, /) -> _V | _D: ...

    def get(self, key: _K, default: object = None, /) -> object:
        return self._entries.get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[_K]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def _chunk(self, key: _K) -> dict[_K, _V]:
        """The key's chunk, copied first if a snapshot holds it."""
        at = hash(key) & _MASK
        if not self._owned[at]:
            self._chunks[at] = dict(self._chunks[at])
            self._owned[at] = True
        self._frozen = None
        return self._chunks[at]

    def __setitem__(self, key: _K, value: _V) -> None:
        self._chunk(key)[key] = value
        self._entries[key] = value

    def __delitem__(self, key: _K) -> None:
        del self._entries[key]  # (first: a missing key raises before any chunk is copied)
        del self._chunk(key)[key]

    def pop(self, key: _K, default: _V | None = None) -> _V | None:
        if key not in self._entries:
            return default
        value = self._entries[key]
        del self[key]
        return value

    def snapshot(self) -> FrozenMap[_K, _V]:
        """The map as it is now, never changed by later writes (the same object until the next write)."""
        if self._frozen is None:
            self._frozen = FrozenMap(tuple(self._chunks), len(self._entries))
            self._owned = [False] * CHUNKS
        return self._frozen
