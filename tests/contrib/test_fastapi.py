"""latchkey.contrib.fastapi on a real FastAPI app, driven through httpx's ASGI transport, on
the SQLite store and on the suite's Redis server."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any

import pytest

pytest.importorskip("fastapi", reason="latchkey[fastapi] is not installed")

import httpx
from fastapi import Depends, FastAPI
from starlette.requests import Request

import latchkey
from latchkey import ConfigError
from latchkey.contrib.fastapi import get_store, lifespan, locked, open_store
from tests.conftest import ServerPool
from tests.servers import ServerUnavailable, free_port


@pytest.fixture(params=["sqlite", "redis"])
def url(request: pytest.FixtureRequest, tmp_path: Path, server_pool: ServerPool) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/locks.db"
    try:
        base = server_pool.base_url("redis")
    except ServerUnavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(f"redis: server required in CI but unavailable: {exc}")
        pytest.skip(f"redis: not run: {exc}")
    return f"{base}?prefix=t{uuid.uuid4().hex[:12]}:"


def make_app(url: str) -> tuple[FastAPI, dict[str, asyncio.Event], list[str]]:
    """An app whose /reports/{user_id} holds report:{user_id} until the test lets it go."""
    app = FastAPI(lifespan=lifespan(url))
    gates: dict[str, asyncio.Event] = {}
    events: list[str] = []

    @app.post("/reports/{user_id}")
    async def report(
        user_id: str, lock: Annotated[latchkey.AsyncLock, Depends(locked("report:{user_id}"))]
    ) -> dict[str, Any]:
        events.append(f"start {user_id}")
        gate = gates.get(user_id)
        if gate is not None:
            await gate.wait()
        events.append(f"end {user_id}")
        return {"user": user_id, "token": lock.token}

    @app.post("/waiting/{user_id}", dependencies=[Depends(locked("report:{user_id}", wait=30))])
    async def waiting(user_id: str) -> dict[str, str]:
        events.append(f"waited {user_id}")
        return {"user": user_id}

    @app.get("/free/{user_id}")
    async def free(user_id: str, store: Annotated[latchkey.AsyncStore, Depends(get_store)]) -> bool:
        return await store.is_free(f"report:{user_id}")

    return app, gates, events


def serve(app: FastAPI, body: Callable[[httpx.AsyncClient], Awaitable[None]]) -> None:
    """Run the app's lifespan and ``body`` with a client talking to it, in a fresh loop."""

    async def main() -> None:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
                await body(client)

    asyncio.run(main())


async def until(probe: Callable[[], bool], what: str) -> None:
    """Await ``probe()`` becoming true (the loop runs the requests meanwhile)."""
    for _ in range(3000):
        if probe():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{what} not reached within 30s")


def test_a_second_request_for_the_same_name_gets_409_and_the_lock_ends_with_the_first(
    url: str,
) -> None:
    app, gates, events = make_app(url)

    async def body(client: httpx.AsyncClient) -> None:
        gates["1"] = asyncio.Event()
        first = asyncio.ensure_future(client.post("/reports/1"))
        await until(lambda: "start 1" in events, "the first request holding the lock")
        busy = await client.post("/reports/1")
        assert busy.status_code == 409
        assert busy.json() == {"detail": "busy: report:1"}
        assert 1 <= int(busy.headers["retry-after"]) <= 30  # the holder's 30 s lease
        other = await client.post("/reports/2")  # another user: another lock
        assert other.status_code == 200
        assert (await client.get("/free/1")).json() is False
        gates["1"].set()
        done = await first
        assert done.status_code == 200
        assert done.json()["token"] > 0
        assert (await client.get("/free/1")).json() is True
        again = await client.post("/reports/1")
        assert again.status_code == 200
        assert again.json()["token"] > done.json()["token"]  # fencing: a later lease

    serve(app, body)
    assert events.count("start 1") == 2  # the busy request never ran the handler


def test_a_busy_answer_says_when_the_holders_lease_ends(url: str) -> None:
    app, _, events = make_app(url)

    async def body(client: httpx.AsyncClient) -> None:
        with latchkey.connect(url) as other, other.lock("report:9", ttl="2m") as held:
            info = other.inspect("report:9")
            assert info is not None and info.expires_at is not None
            busy = await client.post("/reports/9")
            assert busy.status_code == 409
            left = (info.expires_at - other.now()).total_seconds()
            # whole seconds, rounded up: at most the lease's 120 s, at least what is left now
            assert left <= int(busy.headers["retry-after"]) <= 120
            assert held.token is not None

    serve(app, body)
    assert events == []


def test_wait_queues_the_request_behind_the_holder(url: str) -> None:
    app, gates, events = make_app(url)

    async def body(client: httpx.AsyncClient) -> None:
        gates["1"] = asyncio.Event()
        first = asyncio.ensure_future(client.post("/reports/1"))
        await until(lambda: "start 1" in events, "the first request holding the lock")
        second = asyncio.ensure_future(client.post("/waiting/1"))
        await asyncio.sleep(0.05)  # give the waiter a chance to (wrongly) get in
        assert "waited 1" not in events
        gates["1"].set()
        assert (await first).status_code == 200
        assert (await second).status_code == 200

    serve(app, body)
    assert events == ["start 1", "end 1", "waited 1"]


def test_an_unreachable_store_answers_503() -> None:
    app, _, events = make_app(f"postgresql://nobody@127.0.0.1:{free_port()}/x?timeout=5s")

    async def body(client: httpx.AsyncClient) -> None:
        answer = await client.post("/reports/1")
        assert answer.status_code == 503
        assert answer.json() == {"detail": "lock store unavailable"}

    serve(app, body)
    assert events == []


def open_files(path: Path) -> int:
    """How many of this process's file descriptors are open on ``path``."""
    fds = Path("/proc/self/fd")
    return sum(1 for fd in fds.iterdir() if os.path.realpath(fd) == str(path.resolve()))


def test_the_lifespan_opens_and_closes_the_store(tmp_path: Path) -> None:
    db = tmp_path / "locks.db"
    app = FastAPI(lifespan=lifespan(f"sqlite:///{db}"))

    async def main() -> None:
        async with app.router.lifespan_context(app):
            assert isinstance(app.state.latchkey, latchkey.AsyncStore)
            assert await app.state.latchkey.is_free("x")
            assert open_files(db) > 0
        assert not hasattr(app.state, "latchkey")
        assert open_files(db) == 0  # the shutdown closed the store's connections

    asyncio.run(main())


def test_open_store_fits_in_an_apps_own_lifespan(tmp_path: Path) -> None:
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def own(app: FastAPI):  # type: ignore[no-untyped-def]
        async with open_store(app, f"sqlite:///{tmp_path}/locks.db"):
            yield

    app = FastAPI(lifespan=own)

    @app.get("/x/{n}", dependencies=[Depends(locked(lambda r: f"x:{r.path_params['n']}"))])
    async def x(n: str, request: Request) -> str:
        return str(await get_store(request).is_free(f"x:{n}"))

    async def body(client: httpx.AsyncClient) -> None:
        assert (await client.get("/x/7")).json() == "False"  # held during the request

    serve(app, body)


def test_misuse_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="name template"):
        locked("")
    with pytest.raises(ConfigError, match="no scheme"):
        asyncio.run(lifespan("nonsense")(FastAPI()).__aenter__())

    bare = FastAPI()  # no lifespan: no store

    @bare.get("/a", dependencies=[Depends(locked("a"))])
    async def a() -> None: ...

    @bare.get("/b/{x}", dependencies=[Depends(get_store)])
    async def b(x: str) -> None: ...

    app, _, _ = make_app(f"sqlite:///{tmp_path}/locks.db")

    @app.get("/c/{x}", dependencies=[Depends(locked("c:{y}"))])
    async def c(x: str) -> None: ...

    async def run(target: FastAPI, path: str) -> None:
        transport = httpx.ASGITransport(app=target)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            await client.get(path)

    with pytest.raises(ConfigError, match=r"app\.state\.latchkey"):
        asyncio.run(run(bare, "/a"))

    async def body(client: httpx.AsyncClient) -> None:
        with pytest.raises(ConfigError, match=r"cannot fill the name .*\['x'\]"):
            await client.get("/c/1")

    serve(app, body)
