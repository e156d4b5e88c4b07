"""A lease of rows that fails gives back what it may have leased: the lease rules driven by
hand.

``LeaseCore._begin`` is a generator of operations (``latchkey._core.ops``); here the test
answers them itself, as the sync and asyncio runners would with a real store.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from latchkey._core.ops import BACKGROUND, CALL, SLEEP
from latchkey._core.rows import LeaseCore
from latchkey._types import RowSpec
from latchkey.errors import StoreUnavailable

SPEC = RowSpec(table="events", key="id")
HELD = ["events:1", "events:3"]


def _lease() -> tuple[LeaseCore, Any, Any]:
    """A lease of three rows, started: the core, its steps and the call it asked for."""
    store = SimpleNamespace(capabilities=SimpleNamespace(push=False))
    rows: Any = SimpleNamespace(spec=SPEC, store=store)
    batch = LeaseCore(rows, limit=3, ttl=30.0, wait=0, metadata=None)
    steps = batch._begin()
    return batch, steps, steps.send(None)


def test_a_lease_that_fails_gives_its_rows_back_in_the_background() -> None:
    batch, steps, asked = _lease()
    assert asked[:3] == (CALL, None, "rows_lease")
    owner = asked[3][1]
    background = steps.throw(StoreUnavailable("cut"))
    assert background[0] == BACKGROUND  # nothing more in the foreground: the error comes next
    with pytest.raises(StoreUnavailable):
        steps.send(None)
    assert batch.rows == []  # nothing reported leased
    # The give-back: the owner's leases on the table's rows found, then one owner-checked
    # release_many of them; retried while the store cannot be reached.
    give_back = background[1]
    assert give_back.send(None) == (CALL, None, "rows_held", (SPEC, owner))
    assert give_back.throw(StoreUnavailable("still cut"))[0] == SLEEP
    assert give_back.send(None) == (CALL, None, "rows_held", (SPEC, owner))
    assert give_back.send(HELD) == (CALL, None, "release_many", (HELD, owner))
    with pytest.raises(StopIteration):
        give_back.send(2)


def test_a_lease_that_took_nothing_releases_nothing() -> None:
    _, steps, asked = _lease()
    give_back = steps.throw(StoreUnavailable("cut"))[1]
    assert give_back.send(None) == (CALL, None, "rows_held", (SPEC, asked[3][1]))
    with pytest.raises(StopIteration):
        give_back.send([])


def test_a_lease_interrupted_gives_its_rows_back_at_once() -> None:
    _, steps, asked = _lease()
    owner = asked[3][1]
    assert steps.throw(KeyboardInterrupt()) == (CALL, None, "rows_held", (SPEC, owner))
    assert steps.send(HELD) == (CALL, None, "release_many", (HELD, owner))
    with pytest.raises(KeyboardInterrupt):
        steps.send(2)


def test_an_interrupted_lease_whose_give_back_fails_raises_the_interruption() -> None:
    _, steps, _ = _lease()
    steps.throw(KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        steps.throw(StoreUnavailable("and the give-back failed too"))
