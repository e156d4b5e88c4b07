#!/usr/bin/env python3
"""The client's instructions per uncontended acquire + release, by callgrind: a figure that
holds on a loaded or noisy machine, where wall time between two trees moves ±20 % from one
second to the next (headtohead.py's ranges on a shared VM).

    bench/.venv/bin/python bench/instructions.py SRC [SRC ...] [--stores memory,redis,...]
        [--pairs 200,1200]

For each store and each tree (a ``src`` directory: ``git worktree add /tmp/old REV``), runs a
fresh process under ``valgrind --tool=callgrind`` twice — ``--pairs`` A and B pairs on one lock
object — and prints (instructions of B - instructions of A) / (B - A): the cost of one pair,
start-up and connecting cancelled out. Two rows per store: the whole pair through the lock,
and the store's primitives alone (``store.backend.acquire``/``release``, with the owner JSON
a lock would send, made once), so the core's share is the difference; ``--layers async``
adds the pair through an ``AsyncLock`` in a running loop. Instructions are
counted in the client only: not the server's time, not the kernel's (a syscall counts as the
instructions that make it). Memory and SQLite are exact to a few hundred; a networked store's
figure moves by a few thousand (how many reads a reply takes). Starts its own servers
(tests/servers), stops them by pid.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.servers import SERVERS, load_all  # noqa: E402

SERVER = {
    "memory": None, "sqlite": None, "redis": "redis", "memcached": "memcached",
    "postgresql": "postgresql", "postgresql+advisory": "postgresql", "mysql": "mysql",
    "mysql+getlock": "mysql", "mongodb": "mongodb",
}  # fmt: skip

WORKER = """
import sys
sys.path.insert(0, sys.argv[1])
import latchkey
store = latchkey.connect(sys.argv[2])
n, layer = int(sys.argv[3]), sys.argv[4]
if layer == "lock":
    lock = store.lock("instructions", ttl=30, wait=0)
    for _ in range(n):
        lock.acquire()
        lock.release()
elif layer == "async":
    import asyncio
    store.close()
    async def main():
        async with latchkey.connect_async(sys.argv[2]) as astore:
            lock = astore.lock("instructions", ttl=30, wait=0)
            for _ in range(n):
                await lock.acquire()
                await lock.release()
    asyncio.run(main())
    sys.exit(0)
else:
    from latchkey._owner import current_owner_json
    backend, info = store.backend, current_owner_json("")  # what a lock sends, made once
    for i in range(n):
        owner = "%032x" % i
        backend.acquire("instructions", owner, info, 30.0, 1)
        backend.release("instructions", owner)
store.close()
"""


def count(src: str, url: str, pairs: int, layer: str) -> int:
    out = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
         sys.executable, "-c", WORKER, src, url, str(pairs), layer],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    found = re.search(r"Collected : (\d+)", out.stderr)
    if found is None:
        raise RuntimeError(f"no count from callgrind: {out.stderr[-500:]}")
    return int(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trees", nargs="+", metavar="SRC")
    parser.add_argument("--stores", default="memory,sqlite,redis,postgresql,memcached")
    parser.add_argument("--pairs", default="200,1200", help="A,B: pairs in the two runs")
    parser.add_argument(
        "--layers", default="lock,store", help="lock, store, async (through AsyncLock): any of"
    )
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        sys.exit("valgrind is not installed (apt-get install valgrind)")
    low, high = (int(p) for p in args.pairs.split(","))
    layers = args.layers.split(",")
    if not set(layers) <= {"lock", "store", "async"}:
        parser.error(f"--layers: {args.layers!r}: each must be lock, store or async")
    load_all()
    running = {}
    print(f"{'store':22} {'layer':8} " + " ".join(f"{t[-28:]:>28}" for t in args.trees))
    with tempfile.TemporaryDirectory(prefix="latchkey-instr-") as tmp:
        try:
            for store in args.stores.split(","):
                server = SERVER[store]
                if store == "memory":
                    url = "memory://"
                elif server is None:
                    url = f"sqlite:///{tmp}/instructions.db"
                else:
                    if server not in running:
                        running[server] = SERVERS[server].start(Path(tmp) / server)
                    url = running[server].url.replace(f"{server}://", f"{store}://", 1)
                for layer in layers:
                    cells = []
                    for src in args.trees:
                        a = count(src, url, low, layer)
                        b = count(src, url, high, layer)
                        cells.append(f"{(b - a) / (high - low):>28,.0f}")
                    print(f"{store:22} {layer:8} " + " ".join(cells), flush=True)
        finally:
            for srv in running.values():
                srv.stop()


if __name__ == "__main__":
    main()
