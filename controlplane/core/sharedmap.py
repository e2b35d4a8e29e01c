"""A dictionary whose read-only snapshots share what did not change: ``SharedMap`` is written like a dict, and
``snapshot()`` hands out a ``FrozenMap`` that never changes afterwards. Pure; no I/O.

Issue 9: at 1000 engines every Check froze three per-engine dictionaries (the fleet index's ledger views, the decayed
serve counts, the rate book's per-engine decode rates), about 8 us each for a copy of 1000 entries, although between two
Checks only a few entries change. Here the keys are spread over ``CHUNKS`` small dictionaries: a snapshot is a tuple of
them (no entry copied), and the first write to a chunk after a snapshot copies that chunk alone (about 16 entries at 1000
keys). Reading a snapshot costs one tuple index more than a dict; the map itself reads a plain mirror of its entries.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import TypeVar, overload

_K = TypeVar("_K")
_V = TypeVar("_V")
_D = TypeVar("_D")

CHUNKS = 64
_MASK = CHUNKS - 1


class _Chunked(Mapping[_K, _V]):
    """Reading: the key's chunk, then the key (``get`` without Mapping's exception on a miss)."""

    __slots__ = ("_chunks", "_len")
    _chunks: Sequence[dict[_K, _V]]
    _len: int

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
        return f"{type(self).__name__}({dict(self.items())!r})"


class FrozenMap(_Chunked[_K, _V]):
    """A read-only snapshot of a ``SharedMap``."""

    __slots__ = ()

    def __init__(self, chunks: tuple[dict[_K, _V], ...], length: int) -> None:
        self._chunks = chunks  # never written again: the SharedMap copies a chunk before writing to it
        self._len = length


class SharedMap(_Chunked[_K, _V]):
    """A mutable mapping (``m[k] = v``, ``del m[k]``, ``pop``) whose ``snapshot()`` costs no copy of its entries.

    Reading the map itself goes through a plain dict that mirrors it (``live()`` hands out a read-only view of that
    dict, read at C speed by hot loops such as the fleet index's row fills)."""

    __slots__ = ("_owned", "_frozen", "_mirror")
    _chunks: list[dict[_K, _V]]

    def __init__(self, items: Iterable[tuple[_K, _V]] = ()) -> None:
        self._chunks = [{} for _ in range(CHUNKS)]
        self._owned = [True] * CHUNKS
        """Whether each chunk is this map's alone (no snapshot holds it), so it may be written in place."""
        self._len = 0
        self._frozen: FrozenMap[_K, _V] | None = None
        self._mirror: dict[_K, _V] = {}
        for key, value in items:
            self[key] = value

    def live(self) -> Mapping[_K, _V]:
        """A read-only view of the map as it is at each read (not a snapshot: later writes show through)."""
        return MappingProxyType(self._mirror)

    def __getitem__(self, key: _K) -> _V:
        return self._mirror[key]

    @overload
    def get(self, key: _K, /) -> _V | None: ...

    @overload
    def get(self, key: _K, default: _V | _D, /) -> _V | _D: ...

    def get(self, key: _K, default: object = None, /) -> object:
        return self._mirror.get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self._mirror

    def _writable(self, key: _K) -> dict[_K, _V]:
        at = hash(key) & _MASK
        if not self._owned[at]:
            self._chunks[at] = dict(self._chunks[at])
            self._owned[at] = True
        self._frozen = None
        return self._chunks[at]

    def __setitem__(self, key: _K, value: _V) -> None:
        chunk = self._writable(key)
        size = len(chunk)
        chunk[key] = value
        self._len += len(chunk) - size
        self._mirror[key] = value

    def __delitem__(self, key: _K) -> None:
        del self._writable(key)[key]
        self._len -= 1
        del self._mirror[key]

    def pop(self, key: _K, default: _V | None = None) -> _V | None:
        if key not in self:
            return default
        value = self[key]
        del self[key]
        return value

    def snapshot(self) -> FrozenMap[_K, _V]:
        """The map as it is now, never changed by later writes (the same object until the next write)."""
        if self._frozen is None:
            self._frozen = FrozenMap(tuple(self._chunks), self._len)
            self._owned = [False] * CHUNKS
        return self._frozen

