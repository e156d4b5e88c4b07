#!/usr/bin/env python3
"""Two latchkey trees head to head on the same servers: did a change make the sync API slower?

    bench/.venv/bin/python bench/headtohead.py OLD_SRC NEW_SRC [--stores redis,memcached,...]
        [--pairs 8] [--seconds 1.5] [--limit 1]

OLD_SRC and NEW_SRC are ``src`` directories of two checkouts (``git worktree add /tmp/old
REV``). For each store: uncontended acquire + release, one lock object per pair, for
``--seconds`` in a fresh process per slice (so each tree imports its own code), the trees
alternating (ABBA), ``--pairs`` pairs of slices; prints the median of new/old and its range.
``--limit N`` (N > 1) measures a semaphore of N slots instead of a lock (one holder at a time).
Starts its own servers (tests/servers), stops them by pid.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.servers import SERVERS, load_all  # noqa: E402

SERVER = {
    "redis": "redis", "memcached": "memcached", "postgresql": "postgresql",
    "postgresql+advisory": "postgresql", "mysql": "mysql", "mysql+getlock": "mysql",
    "mongodb": "mongodb", "sqlite": None, "etcd": "etcd", "zookeeper": "zookeeper",
    "redis+cluster": "redis_cluster", "redis+sentinel": "redis_sentinel",
}  # fmt: skip

WORKER = """
import sys, time
sys.path.insert(0, sys.argv[1])
import latchkey
store = latchkey.connect(sys.argv[2])
limit = int(sys.argv[4])
def pairs(seconds):
    n, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        if limit > 1:
            lock = store.semaphore("headtohead", limit, ttl=30, wait=5)
        else:
            lock = store.lock("headtohead", ttl=30, wait=5)
        lock.acquire()
        lock.release()
        n += 1
    return n / (time.perf_counter() - started)
pairs(0.3)
print(pairs(float(sys.argv[3])))
store.close()
"""


def rate(src: str, url: str, seconds: float, limit: int = 1) -> float:
    out = subprocess.run(
        [sys.executable, "-c", WORKER, src, url, str(seconds), str(limit)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--stores", default="redis,postgresql+advisory,memcached")
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=1.5)
    parser.add_argument("--limit", type=int, default=1, help="> 1: a semaphore of that many")
    args = parser.parse_args()
    load_all()
    running = {}
    with tempfile.TemporaryDirectory(prefix="latchkey-h2h-") as tmp:
        try:
            for store in args.stores.split(","):
                server = SERVER[store]
                if server is None:  # embedded: a file in the temporary directory
                    url = f"sqlite:///{tmp}/headtohead.db"
                else:
                    if server not in running:
                        running[server] = SERVERS[server].start(Path(tmp) / server)
                    base = running[server].url
                    url = base.replace(f"{server}://", f"{store}://", 1)
                ratios = []
                for i in range(args.pairs):
                    order = (args.old, args.new) if i % 2 == 0 else (args.new, args.old)
                    rates = {src: rate(src, url, args.seconds, args.limit) for src in order}
                    ratios.append(rates[args.new] / rates[args.old])
                print(f"{store:22} new/old {statistics.median(ratios):.3f} "
                      f"(min {min(ratios):.2f}, max {max(ratios):.2f})", flush=True)  # fmt: skip
        finally:
            for srv in running.values():
                srv.stop()


if __name__ == "__main__":
    main()
