"""The store protocol itself (``stores/base.py``), below the core: every store's primitives
answer the same way, in the sync and the asyncio backend."""

from __future__ import annotations

import pytest

import latchkey
from latchkey._owner import new_owner_token
from latchkey._types import Busy, Grant

INFO = '{"host":"protocol-test","pid":1}'


@pytest.mark.parametrize("limit", [1, 3])
def test_an_owner_that_already_holds_the_name_gets_its_own_lease_back(
    store: latchkey.Store, name: str, limit: int
) -> None:
    """Acquiring again with the same owner (a retry after a hand-over, say) answers the
    owner's live lease — same token, not renewed — and never takes a second slot."""
    if limit > 1 and not store.capabilities.semaphores:
        pytest.skip(f"{store.scheme} store declares no semaphores (capabilities)")
    backend = store.backend
    owner = new_owner_token()
    first = backend.acquire(name, owner, INFO, 30.0, limit)
    assert isinstance(first, Grant)
    again = backend.acquire(name, owner, INFO, 60.0, limit)
    assert isinstance(again, Grant), again
    assert again.token == first.token
    if store.capabilities.ttl:
        # Not renewed: the same expiry (Redis reports a key's time left in whole ms: ±1 ms).
        assert again.expires_at is not None and first.expires_at is not None
        assert abs((again.expires_at - first.expires_at).total_seconds()) <= 0.001
        assert again.remaining is not None and 0 < again.remaining <= 30.0
    if store.capabilities.listing:
        info = store.inspect(name)
        assert info is not None and len(info.holders) == 1
    assert backend.release(name, owner) is True
    assert store.is_free(name)


def test_release_and_extend_by_a_stranger_touch_nothing(store: latchkey.Store, name: str) -> None:
    backend = store.backend
    owner, stranger = new_owner_token(), new_owner_token()
    grant = backend.acquire(name, owner, INFO, 30.0, 1)
    assert isinstance(grant, Grant)
    assert backend.release(name, stranger) is False
    assert backend.extend(name, stranger, 60.0) is None
    busy = backend.acquire(name, stranger, INFO, 30.0, 1)
    assert isinstance(busy, Busy) and busy.holders == 1
    assert backend.release(name, owner) is True
