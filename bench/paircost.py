#!/usr/bin/env python3
"""The client's cost of one uncontended acquire + release, two ways steadier than wall time on a
loaded machine: CPU time per pair (``time.process_time``) and Python + C calls per pair
(``sys.setprofile``), for one tree's ``src`` against a running server.

    bench/.venv/bin/python bench/paircost.py SRC URL [--pairs 2000]

Run it for two trees alternately, several times: the call count is exact, the CPU time still
moves with the machine's load (compare medians).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("src")
    parser.add_argument("url")
    parser.add_argument("--pairs", type=int, default=2000)
    args = parser.parse_args()
    sys.path.insert(0, args.src)
    import latchkey

    store = latchkey.connect(args.url)
    lock = store.lock("paircost", ttl="10s", wait=0)
    for _ in range(200):  # warm: connections open, statements prepared
        lock.acquire()
        lock.release()
    calls = 0

    def count(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    sys.setprofile(count)
    for _ in range(100):
        lock.acquire()
        lock.release()
    sys.setprofile(None)
    started = time.process_time()
    for _ in range(args.pairs):
        lock.acquire()
        lock.release()
    cpu = (time.process_time() - started) / args.pairs
    print(f"cpu_us_per_pair {cpu * 1e6:.1f} calls_per_pair {calls / 100:.0f}")
    store.close()


if __name__ == "__main__":
    main()
