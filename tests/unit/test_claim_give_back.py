"""A batch claim that fails gives back what it may have taken: the claim rules driven by hand.

``ClaimCore._take`` is a generator of operations (``latchkey._core.ops``); here the test
answers them itself, as the sync and asyncio runners would with a real store.
"""

from __future__ import annotations

from typing import Any

import pytest

from latchkey._core.claim import ClaimCore
from latchkey._core.ops import BACKGROUND, CALL, SLEEP
from latchkey.errors import StoreUnavailable

NAMES = ["a", "b", "a", "c"]


def _claim() -> tuple[ClaimCore, Any, Any]:
    """A claim of NAMES, started: the core and its steps, and the claim call it asked for."""
    claim = ClaimCore(object(), NAMES, ttl=30.0, metadata={})
    steps = claim._take()
    return claim, steps, steps.send(None)


def test_a_claim_that_fails_gives_its_names_back_in_the_background() -> None:
    claim, steps, asked = _claim()
    assert asked[:3] == (CALL, None, "claim")
    names, owner = asked[3][0], asked[3][1]
    assert names == ["a", "b", "c"]
    background = steps.throw(StoreUnavailable("cut"))
    assert background[0] == BACKGROUND  # nothing more in the foreground: the error comes next
    with pytest.raises(StoreUnavailable):
        steps.send(None)
    assert claim.acquired == [] and claim.held == []  # nothing reported held
    # The give-back: one owner-checked release_many of every name, retried while the store
    # cannot be reached, ended by the first answer.
    give_back = background[1]
    assert give_back.send(None) == (CALL, None, "release_many", (names, owner))
    assert give_back.throw(StoreUnavailable("still cut"))[0] == SLEEP
    assert give_back.send(None) == (CALL, None, "release_many", (names, owner))
    with pytest.raises(StopIteration):
        give_back.send(2)


def test_a_claim_interrupted_gives_its_names_back_at_once() -> None:
    _, steps, asked = _claim()
    names, owner = asked[3][0], asked[3][1]
    assert steps.throw(KeyboardInterrupt()) == (CALL, None, "release_many", (names, owner))
    with pytest.raises(KeyboardInterrupt):
        steps.throw(StoreUnavailable("and the release failed too"))
