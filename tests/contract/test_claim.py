"""Batch claims (seed 000): take what is free, skip the rest, one deadline for the batch."""

from __future__ import annotations

import pytest

import latchkey
from latchkey import ConfigError, InvalidName
from tests.helpers import eventually

pytestmark = pytest.mark.requires("claims")


def test_claim_takes_free_and_skips_busy(store: latchkey.Store, name: str) -> None:
    names = [f"{name}:{i}" for i in range(10)]
    other = store.lock(names[3], ttl="30s")
    other.acquire()
    claim = store.claim(names, ttl="30s")
    assert claim.acquired == [n for n in names if n != names[3]]
    assert claim.busy == [names[3]]
    assert list(claim) == claim.acquired and len(claim) == 9
    assert claim.remaining() > 20 and not claim.expired
    if store.capabilities.ttl:
        assert claim.deadline is not None and claim.deadline > store.now()
    if store.capabilities.fencing:
        tokens = list(claim.tokens.values())
        assert len(tokens) == 9 and all(isinstance(t, int) and t > 0 for t in tokens)
    for n in claim.acquired:
        assert not store.is_free(n)
    assert store.lock(names[0], ttl="30s", wait=0).acquire() is False
    assert claim.release(names[0]) is True
    assert claim.release(names[0]) is False
    assert store.is_free(names[0])
    assert claim.release_all() == 8
    assert all(store.is_free(n) for n in claim.acquired)
    assert other.release()


def test_context_manager_releases_the_rest(store: latchkey.Store, name: str) -> None:
    names = [f"{name}:{i}" for i in range(5)]
    with store.claim(names, ttl="30s") as claim:
        claim.release(names[0])
        assert claim.held == names[1:]
    assert all(store.is_free(n) for n in names)


def test_overlapping_claims_split_the_names(store: latchkey.Store, name: str) -> None:
    names = [f"{name}:{i}" for i in range(20)]
    first = store.claim(names[:12], ttl="30s")
    second = store.claim(names, ttl="30s")
    assert first.acquired == names[:12]
    assert second.acquired == names[12:]
    assert second.busy == names[:12]
    first.release_all()
    second.release_all()


def test_claim_of_many_names(store: latchkey.Store, name: str) -> None:
    names = [f"{name}:{i}" for i in range(1000)]
    with store.claim(names, ttl="60s") as claim:
        assert claim.acquired == names
        assert store.claim(names, ttl="60s").acquired == []
    assert store.claim(names, ttl="60s").release_all() == 1000


def test_empty_claim(store: latchkey.Store) -> None:
    claim = store.claim([], ttl="10s")
    assert claim.acquired == [] and claim.busy == [] and claim.deadline is None
    assert claim.release_all() == 0


def test_duplicates_are_reported_not_double_counted(store: latchkey.Store, name: str) -> None:
    a, b = f"{name}:a", f"{name}:b"
    with store.claim([a, b, a, a], ttl="10s") as claim:
        assert claim.acquired == [a, b]
        assert claim.duplicates == [a, a]
        assert claim.busy == []


def test_bad_claim_input(store: latchkey.Store, name: str) -> None:
    with pytest.raises(ConfigError):
        store.claim(name, ttl="10s")  # a str is one name, not a list of names
    with pytest.raises(InvalidName):
        store.claim([f"{name}:ok", ""], ttl="10s")
    with pytest.raises(ConfigError):
        store.claim([name], ttl="soon")
    assert store.is_free(f"{name}:ok")  # a rejected batch takes nothing


@pytest.mark.requires("ttl")
def test_claimed_names_expire_together(store: latchkey.Store, name: str) -> None:
    names = [f"{name}:{i}" for i in range(3)]
    claim = store.claim(names, ttl="300ms")
    assert claim.acquired == names
    eventually(lambda: claim.expired, what="claim deadline (local)")
    eventually(lambda: all(store.is_free(n) for n in names), what="claimed leases expiring")
    assert store.claim(names, ttl="30s").acquired == names


@pytest.mark.requires("fencing")
def test_claim_tokens_continue_each_names_sequence(store: latchkey.Store, name: str) -> None:
    with store.lock(name, ttl="30s") as lock:
        before = lock.token
    with store.claim([name], ttl="30s") as claim:
        assert before is not None and claim.tokens[name] is not None
        assert claim.tokens[name] > before  # type: ignore[operator]
