"""The fleet as one decision reads it: engine views, each engine's tickets as the ledger sees them, and learned rates.

Everything here is a frozen dataclass, and a mapping one holds is a read-only ``MappingProxyType`` or ``FrozenMap``
(``frozen_map``). Times are seconds on the control plane's monotonic clock, always passed in.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, TypeVar

from controlplane.core.engines import EngineView
from controlplane.core.output_length import OutputTail
from controlplane.core.sharedmap import FrozenMap

_K = TypeVar("_K")
_V = TypeVar("_V")


_READ_ONLY = (MappingProxyType, FrozenMap)
"""Mapping types taken as they are (never changed by anyone after they are handed over)."""


def frozen_map(mapping: Mapping[_K, _V]) -> Mapping[_K, _V]:
    """A read-only mapping for a frozen dataclass: a ``MappingProxyType`` (whoever built it handed over a fresh dict and
    keeps no reference) or a ``FrozenMap`` (a snapshot, never changed) as it is; anything else copied first."""
    return mapping if type(mapping) in _READ_ONLY else MappingProxyType(dict(mapping))


def _empty() -> Mapping[Any, Any]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class EngineLedger:
    """What the ticket ledger knows about one engine, as the decision core reads it."""

    open_tickets: int = 0
    unseen_load: int = 0
    """Tickets admitted since the probe, minus tickets admitted before it and released since."""
    committed_tokens: int = 0
    """KV every open ticket may grow to (sum of reserved tokens)."""
    unseen_reserved_tokens: int = 0
    """Reserved tokens of tickets the last probe cannot have seen."""
    released_since_probe_tokens: int = 0
    """Reserved tokens of tickets the probe saw that have finished since: KV the probe still counts as held."""
    open_by_model: tuple[tuple[str, int], ...] = ()
    expected_done: tuple[float, ...] = ()
    """Expected finish times of open tickets, soonest first."""
    running: tuple[tuple[float, float, str], ...] = ()
    """(expected first token, expected finish, model) of each open ticket, by expected finish: how far along each is
    (route.expected_frees)."""
    finishing: tuple[tuple[float, int], ...] = ()
    """(expected finish time, reserved tokens) of open tickets, soonest first (for backfill's what-if)."""
    guessed_tickets: int = 0
    """Open tickets admitted here while the engine's decode rate was the policy's default (not measured, no anchor):
    their expected finishes may be off by any factor until they close."""

    def open_for(self, model: str) -> int:
        return dict(self.open_by_model).get(model, 0)


_NO_TICKETS = EngineLedger()


class BatchRates(Mapping[int, float]):
    """One engine's per-request decode rate by batch size (running requests), read-only, its batch sizes kept sorted
    so that the rate at the nearest measured batch is a bisection."""

    __slots__ = ("_rates", "_batches")

    def __init__(self, rates: Mapping[int, float]) -> None:
        self._batches = tuple(sorted(rates))
        self._rates = {batch: rates[batch] for batch in self._batches}

    def __getitem__(self, batch: int) -> float:
        return self._rates[batch]

    def __iter__(self) -> Iterator[int]:
        return iter(self._batches)

    def __len__(self) -> int:
        return len(self._batches)

    def __repr__(self) -> str:
        return f"BatchRates({self._rates!r})"

    def nearest(self, batch: int) -> float:
        """The rate at the measured batch size nearest ``batch`` (the smaller of two as near)."""
        batches = self._batches
        i = bisect.bisect_left(batches, batch)
        if i == len(batches):
            return self._rates[batches[-1]]
        if i == 0 or batches[i] - batch < batch - batches[i - 1]:
            return self._rates[batches[i]]
        return self._rates[batches[i - 1]]


class ClassChangeLog:
    """Which (model, chip class) medians changed in each of the last ``keep`` class tables a ``RateBook`` built, by the
    tables' ``class_serial``: a holder of per-class arrays derived from one table (``FleetIndex._per_chip``) redoes only
    those classes for a newer one. Append-only; asked about a serial older than it keeps, it answers None (redo all)."""

    __slots__ = ("_log",)

    def __init__(self, keep: int = 256) -> None:
        self._log: deque[tuple[int, frozenset[tuple[str, str]]]] = deque(maxlen=keep)

    def append(self, serial: int, changed: frozenset[tuple[str, str]]) -> None:
        self._log.append((serial, changed))

    def since(self, serial: int, newest: int) -> set[tuple[str, str]] | None:
        """The classes that changed after table ``serial`` up to table ``newest``, or None when some are forgotten."""
        changed: set[tuple[str, str]] = set()
        if newest <= serial:
            return changed
        for at, keys in reversed(self._log):
            if at <= serial:
                return changed
            if at <= newest:
                changed |= keys
        return changed if self._log and self._log[0][0] == serial + 1 else None


@dataclass(frozen=True, slots=True)
class RateTables:
    """Trusted medians the observation layer has learned (empty until enough samples)."""

    solo_decode: Mapping[tuple[str, str], float] = field(default_factory=_empty)
    """(model, chip class) -> solo decode tokens/s."""
    prefill_median: Mapping[tuple[str, str], float] = field(default_factory=_empty)
    """(model, chip class) -> prefill tokens/s."""
    decode_by_batch: Mapping[str, BatchRates] = field(default_factory=_empty)
    """engine -> running requests -> per-request decode tokens/s."""
    class_serial: int = field(default=0, compare=False)
    """Counts the class tables (``solo_decode``, ``prefill_median``) its book built; 0 outside a book."""
    class_changes: ClassChangeLog | None = field(default=None, compare=False)
    """The book's log of which classes each of its class tables changed (``ClassChangeLog``)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "solo_decode", frozen_map(self.solo_decode))
        object.__setattr__(self, "prefill_median", frozen_map(self.prefill_median))
        if type(self.decode_by_batch) not in _READ_ONLY:
            object.__setattr__(self, "decode_by_batch", MappingProxyType(
                {k: v if type(v) is BatchRates else BatchRates(v) for k, v in self.decode_by_batch.items()}))


@dataclass(frozen=True, slots=True)
class Fleet:
    engines: tuple[EngineView, ...]
    ledger: Mapping[str, EngineLedger] = field(default_factory=_empty)
    admit_stale: bool = True
    """Policy ``observe.on_stale``: open (True) still admits to a stale engine when no fresh one serves the model."""
    rates: RateTables = field(default_factory=RateTables)
    recent_serves: Mapping[str, float] = field(default_factory=_empty)
    """Admissions per engine, decayed (satisficing band weights)."""
    expected_output: Mapping[str, float] = field(default_factory=_empty)
    """model -> tokens its requests are expected to generate, learned from completed requests (output_length.py); a
    model missing here uses ``Policy.default_expected_output_tokens``."""
    output_tails: Mapping[str, OutputTail] = field(default_factory=_empty)
    """model -> its recorded lengths' shape (output_length.py): how much longer a running request is expected to run."""
    index: Any = None
    """A ``fleetindex.IndexSnapshot`` describing exactly these engines and ledger views per model (indexed.py decides
    on it). None: the full scan."""
    last_served: Mapping[str, float] = field(default_factory=_empty)
    """engine -> when it was last admitted to (warm near ties, ``Policy.near_tie_max_engines``); missing: never."""
    adapters: Mapping[str, str] = field(default_factory=_empty)
    """LoRA adapter -> its base model, as the engines' model lists name them (core/adapters.py)."""
    adapter_recent: Mapping[str, tuple[str, ...]] = field(default_factory=_empty)
    """engine -> the adapters sluice admitted there, most recent first (what its slots probably hold)."""
    adapter_swap_s: Mapping[str, float] = field(default_factory=_empty)
    """engine -> its learned adapter swap in seconds (core/adapters.py, ``SwapBook``); missing: the policy's prior."""
    adapter_shares: Mapping[str, float] = field(default_factory=_empty)
    """adapter -> its share of its base model's recent adapter admissions (core/adapterhomes.py, ``AdapterShares``), for
    base models with enough of them; empty: unknown."""

    def __post_init__(self) -> None:
        if type(self.ledger) not in _READ_ONLY:
            object.__setattr__(self, "ledger", MappingProxyType(dict(self.ledger)))
        if type(self.expected_output) is not MappingProxyType:
            object.__setattr__(self, "expected_output", MappingProxyType(dict(self.expected_output)))

    def of(self, engine: str) -> EngineLedger:
        return self.ledger.get(engine, _NO_TICKETS)
