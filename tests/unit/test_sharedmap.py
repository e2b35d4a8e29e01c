"""SharedMap (sharedmap.py): written like a dict, its snapshots never change, whatever is written after them."""

from __future__ import annotations

import random

import pytest

from controlplane.core.fleet import BatchRates, EngineLedger, Fleet, RateTables
from controlplane.core.sharedmap import FrozenMap, SharedMap


@pytest.mark.parametrize("seed", range(20))
def test_random_writes_read_like_a_dict_and_snapshots_keep_their_moment(seed: int) -> None:
    rng = random.Random(seed)
    shared: SharedMap[str, int] = SharedMap()
    plain: dict[str, int] = {}
    kept: list[tuple[FrozenMap[str, int], dict[str, int]]] = []
    for step in range(600):
        key = f"e{rng.randrange(300)}"
        roll = rng.random()
        if roll < 0.6:
            shared[key] = plain[key] = step
        elif roll < 0.75:
            assert shared.pop(key, None) == plain.pop(key, None)
        elif roll < 0.85 and key in plain:
            del shared[key]
            del plain[key]
        else:
            kept.append((shared.snapshot(), dict(plain)))
        assert len(shared) == len(plain)
        assert (key in shared) == (key in plain) and shared.get(key, -1) == plain.get(key, -1)
    assert dict(shared) == plain and shared == plain
    live = shared.live()
    shared["late"] = -1
    assert live["late"] == -1 and dict(live) == {**plain, "late": -1}  # a live view, not a snapshot
    for snapshot, then in kept:
        assert dict(snapshot.items()) == then and len(snapshot) == len(then)
        assert all(snapshot[k] == v for k, v in then.items())
        assert snapshot.get("absent") is None and "absent" not in snapshot


def test_a_snapshot_is_the_same_object_until_a_write_and_unchanged_entries_are_not_copied() -> None:
    shared: SharedMap[str, object] = SharedMap((f"e{i}", object()) for i in range(1000))
    first = shared.snapshot()
    assert shared.snapshot() is first
    shared["e1"] = "new"
    second = shared.snapshot()
    assert second is not first and first["e1"] is not second["e1"] == "new"
    assert all(first[f"e{i}"] is second[f"e{i}"] for i in range(2, 1000))  # shared, not copied
    with pytest.raises(KeyError):
        del shared["absent"]
    assert second["e2"] is first["e2"]


def test_the_decision_core_takes_a_snapshot_as_read_only_without_copying_it() -> None:
    ledger = SharedMap[str, EngineLedger]().snapshot()
    fleet = Fleet((), ledger)
    assert fleet.ledger is ledger
    by_batch = SharedMap[str, BatchRates]().snapshot()
    assert RateTables(decode_by_batch=by_batch).decode_by_batch is by_batch
