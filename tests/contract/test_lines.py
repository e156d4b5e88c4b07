"""Lines (``latchkey.stores.io.lines``): on a store without push, the blocked acquires of one
backend wait in line per name. Each knows its place (``ahead``: the core polls less often the
further back it is), a release through the backend rings the first at once, and one that was
rung and leaves without the lease passes the ring on. Sync and asyncio, on the real servers of
the stores that poll.
"""

from __future__ import annotations

import asyncio
import uuid

from latchkey._types import Busy, Grant
from latchkey.stores import open_async_backend, open_backend

STORE_ROWS = {"mysql", "memcached", "mongodb"}
INFO = '{"host":"t","pid":1}'


def _owner() -> str:
    return uuid.uuid4().hex


def test_a_release_rings_the_first_in_line_and_a_leaver_passes_it_on(store_url: str) -> None:
    backend = open_backend(store_url)
    try:
        assert not backend.capabilities.push  # these stores poll: the line is latchkey's own
        holder = _owner()
        assert isinstance(backend.acquire("n", holder, INFO, 30), Grant)
        first = backend.wait_in_line("n", _owner(), INFO, 30, 1)
        second = backend.wait_in_line("n", _owner(), INFO, 30, 1)
        other = backend.wait_in_line("m", _owner(), INFO, 30, 1)
        assert (first.ahead, second.ahead, other.ahead) == (0, 1, 0)
        assert not first.wait(0) and not second.wait(0)
        assert backend.release("n", holder)
        assert first.wait(10)  # rung: True is a ring, never a timeout
        assert not second.wait(0) and not other.wait(0)  # one rung, not all
        first.finish(Busy(1))  # it lost the race to someone else: the ring goes on
        first.close()
        assert second.ahead == 0 and second.wait(10)
        second.finish(Grant(1, None))
        second.close()
        other.close()
    finally:
        backend.close()


def test_the_asyncio_line_rings_the_same_way(store_url: str) -> None:
    async def main() -> None:
        backend = open_async_backend(store_url)
        try:
            holder = _owner()
            assert isinstance(await backend.acquire("n", holder, INFO, 30), Grant)
            first = await backend.wait_in_line("n", _owner(), INFO, 30, 1)
            second = await backend.wait_in_line("n", _owner(), INFO, 30, 1)
            assert (first.ahead, second.ahead) == (0, 1)
            assert await backend.release("n", holder)
            assert await first.wait(10)
            assert not await second.wait(0)
            await first.finish(Busy(1))
            await first.close()
            assert second.ahead == 0 and await second.wait(10)
            await second.close()
        finally:
            await backend.aclose()

    asyncio.run(main())
