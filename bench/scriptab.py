#!/usr/bin/env python3
"""Two trees' Redis scripts head to head in one process: uncontended acquire + release.

    .venv/bin/python bench/scriptab.py OLD_SRC [--limit 3] [--rounds 40] [--block 300]

For the Redis store's own scripts only (a change that touches the Lua, not the Python): the
backend is this tree's; before each block of ``--block`` pairs the store module's scripts are
set to the old tree's or this tree's (its ``redis_lua`` loaded from OLD_SRC under another
name), alternating ABBA, on one connection, one server (tests/servers, stopped by pid). Prints
the median over rounds of new/old of the block's wall time, and of the server's own time per
EVALSHA (``INFO commandstats``: the scripts' cost without the client and the network).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "src"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from tests.servers import SERVERS, load_all  # noqa: E402

from latchkey.stores import open_backend  # noqa: E402
from latchkey.stores import redis as store_module  # noqa: E402
from latchkey.stores import redis_lua as new_lua  # noqa: E402

NAMES = ("ACQUIRE", "RELEASE", "EXTEND", "CLAIM", "RELEASE_MANY", "FORCE_RELEASE", "PURGE")


HELPERS = "latchkey.stores.redis_lua_helpers"


def load_file(name: str, path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_old(src: str) -> Any:
    """OLD_SRC's ``redis_lua``, built from OLD_SRC's Lua helpers where it keeps them in a
    module of their own (``redis_lua_helpers``), not from this tree's."""
    stores = Path(src) / "latchkey/stores"
    helpers = stores / "redis_lua_helpers.py"
    ours = sys.modules.get(HELPERS)
    try:
        if helpers.exists():
            sys.modules[HELPERS] = load_file("old_redis_lua_helpers", helpers)
        return load_file("old_redis_lua", stores / "redis_lua.py")
    finally:
        if ours is not None:
            sys.modules[HELPERS] = ours
        else:
            sys.modules.pop(HELPERS, None)


def use(backend: Any, lua: Any) -> None:
    for name in NAMES:
        setattr(store_module, name, getattr(lua, name))
    backend.store.acquire_lua = lua.ACQUIRE
    backend.store.extend_lua = lua.EXTEND


def evalsha_usec(client: Any) -> tuple[float, int]:
    stats = client.info("commandstats").get("cmdstat_evalsha", {})
    return float(stats.get("usec", 0)), int(stats.get("calls", 0))


def block(backend: Any, limit: int, n: int) -> tuple[float, float]:
    """Wall seconds of n pairs, and the server's µs per EVALSHA over them."""
    client = backend.io.client
    usec0, calls0 = evalsha_usec(client)
    started = time.perf_counter()
    for _ in range(n):
        backend.acquire("scriptab", "o" * 32, "{}", 30, limit)
        backend.release("scriptab", "o" * 32)
    took = time.perf_counter() - started
    usec1, calls1 = evalsha_usec(client)
    return took, (usec1 - usec0) / max(1, calls1 - calls0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old")
    parser.add_argument("--limit", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--block", type=int, default=300)
    args = parser.parse_args()
    old = load_old(args.old)
    load_all()
    with tempfile.TemporaryDirectory(prefix="latchkey-scriptab-") as tmp:
        server = SERVERS["redis"].start(Path(tmp) / "redis")
        try:
            backend = open_backend(server.url)
            trees = {"old": old, "new": new_lua}
            for lua in trees.values():  # load both, warm up
                use(backend, lua)
                block(backend, args.limit, 200)
            wall, server_us = [], []
            for i in range(args.rounds):
                order = ("old", "new") if i % 2 == 0 else ("new", "old")
                got = {}
                for tree in order:
                    use(backend, trees[tree])
                    got[tree] = block(backend, args.limit, args.block)
                wall.append(got["new"][0] / got["old"][0])
                server_us.append((got["old"][1], got["new"][1]))
            backend.close()
        finally:
            server.stop()
    old_us = statistics.median(u for u, _ in server_us)
    new_us = statistics.median(u for _, u in server_us)
    print(
        f"limit {args.limit}: wall time new/old median {statistics.median(wall):.3f} "
        f"(quartiles {statistics.quantiles(wall, n=4)[0]:.3f} to "
        f"{statistics.quantiles(wall, n=4)[2]:.3f}); server µs per EVALSHA old {old_us:.2f}, "
        f"new {new_us:.2f} (new/old {new_us / old_us:.3f})"
    )


if __name__ == "__main__":
    main()
