"""What only the etcd store has to show: its round trips, its etcd leases, its URLs.

The shared semantics are tested by the rest of tests/contract on every store.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import latchkey
from latchkey import ConfigError, StoreUnavailable, Unsupported
from latchkey._owner import new_owner_token
from latchkey._types import Busy, Grant
from latchkey.stores import open_async_backend, open_backend
from latchkey.stores.etcd import EtcdBackend
from latchkey.stores.etcd_txn import lease_id
from latchkey.stores.io.etcd import Post
from tests.conftest import ServerPool
from tests.servers import ServerUnavailable, free_port, with_query

_selected = {s.strip() for s in os.environ.get("LATCHKEY_TEST_STORES", "").split(",") if s}
if _selected and "etcd" not in _selected:
    pytest.skip("the etcd row is not selected (LATCHKEY_TEST_STORES)", allow_module_level=True)

INFO = '{"host":"h","pid":1}'


@pytest.fixture
def etcd_url(server_pool: ServerPool) -> str:
    try:
        base = server_pool.base_url("etcd")
    except ServerUnavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(f"etcd: server required in CI but unavailable: {exc}")
        pytest.skip(f"etcd: not run: {exc}")
    return f"{base}?prefix=t{uuid.uuid4().hex[:12]}:"


class Counted:
    """Counts the gateway requests a backend sends, by path."""

    def __init__(self, backend: EtcdBackend) -> None:
        self.paths: list[str] = []
        answer = backend.io.answer

        def counting(request: Any, deadline: float | None = None) -> Any:
            if isinstance(request, Post):
                self.paths.append(request.path)
            return answer(request, deadline)

        backend.io.answer = counting  # type: ignore[method-assign]

    def take(self) -> list[str]:
        paths, self.paths = self.paths, []
        return paths


@pytest.fixture
def backend(etcd_url: str) -> Iterator[EtcdBackend]:
    b = open_backend(etcd_url)
    assert isinstance(b, EtcdBackend)
    try:
        yield b
    finally:
        b.close()


def _post(backend: EtcdBackend, path: str, body: dict[str, Any]) -> dict[str, Any]:
    host, port = backend.url.hosts[0]
    request = urllib.request.Request(
        f"http://{host}:{port}{path}", data=json.dumps(body).encode(), method="POST"
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        data: dict[str, Any] = json.loads(response.read())
    return data


def test_round_trips(backend: EtcdBackend) -> None:
    """Acquire: grant and one transaction; an owner that waits: one transaction while busy,
    nothing granted; release: one revoke; a claim of 1,000 names: one grant, one
    transaction."""
    counted = Counted(backend)
    owner, other, waiting = new_owner_token(), new_owner_token(), new_owner_token()
    assert isinstance(backend.acquire("n", owner, INFO, 10.0), Grant)
    assert counted.take() == ["/v3/lease/grant", "/v3/kv/txn"]
    assert isinstance(backend.acquire("n", other, INFO, 10.0), Busy)
    assert counted.take() == ["/v3/lease/grant", "/v3/kv/txn"]
    with backend.wait_in_line("n", waiting, INFO, 10.0, 1) as waiter:
        counted.take()
        assert isinstance(backend.acquire("n", waiting, INFO, 10.0), Busy)
        assert counted.take() == ["/v3/kv/txn"]
        assert backend.release("n", owner) is True
        assert counted.take() == ["/v3/lease/revoke"]
        assert waiter.wait(5.0) is True  # woken by the deletion
        assert isinstance(backend.acquire("n", waiting, INFO, 10.0), Grant)
        assert counted.take() == ["/v3/kv/txn", "/v3/lease/grant", "/v3/kv/txn"]
    assert backend.release("n", waiting) is True
    counted.take()
    names = [f"c:{i}" for i in range(1000)]
    assert len(backend.claim(names, owner, INFO, 10.0)) == 1000
    assert counted.take() == ["/v3/lease/grant", "/v3/kv/txn"]


def test_the_etcd_lease_is_the_ttl_rounded_up(backend: EtcdBackend) -> None:
    owner = new_owner_token()
    grant = backend.acquire("n", owner, INFO, 1.2)
    assert isinstance(grant, Grant)
    reply = _post(backend, "/v3/lease/timetolive", {"ID": str(lease_id(owner, "n"))})
    assert int(reply["grantedTTL"]) == 2
    # The token is the holder key's create_revision: an etcd revision.
    key = backend.store.holder("n", owner)
    found = _post(backend, "/v3/kv/range", {"key": base64.b64encode(key).decode()})
    assert int(found["kvs"][0]["create_revision"]) == grant.token
    assert backend.release("n", owner) is True
    assert backend.release("n", owner) is False


def test_extend_with_another_ttl_swaps_the_lease(backend: EtcdBackend) -> None:
    owner = new_owner_token()
    grant = backend.acquire("n", owner, INFO, 5.0)
    assert isinstance(grant, Grant)
    extended = backend.extend("n", owner, 30.0)
    assert extended is not None and extended.token == grant.token
    info = backend.inspect("n")
    assert info is not None and info.token == grant.token
    assert backend.release("n", owner) is True  # found on its new lease
    assert backend.inspect("n") is None


def test_purge_sends_nothing_and_large_semaphores_are_refused(backend: EtcdBackend) -> None:
    counted = Counted(backend)
    assert backend.purge_expired() == 0
    assert counted.take() == []
    with pytest.raises(Unsupported, match="60"):
        backend.acquire("n", new_owner_token(), INFO, 5.0, 61)


def test_the_next_endpoint_is_tried_when_one_refuses(etcd_url: str) -> None:
    dead = free_port()
    url = etcd_url.replace("etcd://", f"etcd://127.0.0.1:{dead},", 1)
    b = open_backend(url)
    try:
        owner = new_owner_token()
        assert isinstance(b.acquire("n", owner, INFO, 5.0), Grant)
        assert b.release("n", owner) is True
    finally:
        b.close()


def test_a_member_that_never_answers_costs_one_call_not_every_call(
    etcd_url: str, connect: Callable[[str], latchkey.Store]
) -> None:
    """The first endpoint accepts connections and never answers (a hung member): the call
    sent there fails within its timeout (it is not sent again: it may have been applied),
    and the next call starts at the next endpoint and is granted."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        port = silent.getsockname()[1]
        url = with_query(etcd_url.replace("etcd://", f"etcd://127.0.0.1:{port},", 1), timeout="1s")

        def calls(store: Any) -> list[str]:
            outcomes = []
            for i in range(3):
                started = time.monotonic()
                try:
                    outcome = "granted" if store.lock(f"n{i}", ttl="5s").acquire(wait=0) else "busy"
                except StoreUnavailable:
                    outcome = "unavailable"
                assert time.monotonic() - started < 2.5
                outcomes.append(outcome)
            return outcomes

        store = connect(url)
        try:
            outcomes = calls(store)
        finally:
            store.close()
    assert outcomes == ["unavailable", "granted", "granted"]


@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
def test_a_watch_that_never_opened_moves_the_next_request_on(etcd_url: str, flavour: str) -> None:
    """A waiter's watch sent to a member that never answers (it stalled between an acquire's
    attempt and its wait in line) fails; the next request starts at the next member instead
    of waiting out its timeout there too (the chaos run: an acquire with wait 1 s took 4.3 s,
    a watch's timeout and then its last attempt's)."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        port = silent.getsockname()[1]
        url = with_query(etcd_url.replace("etcd://", f"etcd://127.0.0.1:{port},", 1), timeout="1s")
        owner = new_owner_token()

        def sync() -> object:
            b = open_backend(url)
            try:
                with pytest.raises(StoreUnavailable):
                    b.wait_in_line("n", owner, INFO, 5.0, 1)
                return b.acquire("n", owner, INFO, 5.0)
            finally:
                b.close()

        async def in_asyncio() -> object:
            b = open_async_backend(url)
            try:
                with pytest.raises(StoreUnavailable):
                    await b.wait_in_line("n", owner, INFO, 5.0, 1)
                return await b.acquire("n", owner, INFO, 5.0)
            finally:
                await b.aclose()

        started = time.monotonic()
        granted = sync() if flavour == "sync" else asyncio.run(in_asyncio())
        assert isinstance(granted, Grant)
        assert time.monotonic() - started < 1.8  # the watch's timeout, and a quick grant


def test_credentials_are_refused_without_showing_them() -> None:
    with pytest.raises(ConfigError) as caught:
        open_backend("etcd://root:s3cret@127.0.0.1:2379")
    assert "s3cret" not in str(caught.value)
