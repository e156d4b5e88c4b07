#!/usr/bin/env python3
"""The client's share of a contended hand-off on MySQL/MariaDB: latchkey against raw GET_LOCK.

    PYTHONPATH=src bench/.venv/bin/python bench/handoff_path.py [--procs 8] [--seconds 4]
        [--rounds 2] [--out f.json]

Scenario C's loop (``procs`` processes, one name, acquire → ``sleep(0)`` → release) against a
disposable MariaDB (tests/servers), for ``mysql+getlock/latchkey`` and ``mysql/raw-getlock``
in turn. Each process stamps two moments with ``perf_counter`` and reports their medians:

- **release → sent**: from the ``release()`` call to the moment its statement's bytes go to
  the socket (PyMySQL's ``Connection._write_bytes``, wrapped for the stamp);
- **answer → return**: from the moment the wait's answer has been read (PyMySQL's
  ``Connection._read_packet``, wrapped) to ``acquire()`` returning.

Under contention the next holder is granted by the server while the holder's release runs
its statement, so both are on every hand-over's critical path: what latchkey adds to them,
each process pays once per acquisition and the whole loop waits for it. The wrapping costs
the same on both subjects. PyMySQL's private methods are patched here, in the bench only.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path
from time import perf_counter
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import scenarios

import servers

SUBJECTS = ("mysql+getlock/latchkey", "mysql/raw-getlock")
STAMP = {"sent": 0.0, "read": 0.0}


def _stamp_pymysql() -> None:
    import pymysql.connections as connections

    write, read = connections.Connection._write_bytes, connections.Connection._read_packet

    def _write_bytes(self: Any, data: bytes) -> Any:
        STAMP["sent"] = perf_counter()
        return write(self, data)

    def _read_packet(self: Any, *args: Any, **kwargs: Any) -> Any:
        packet = read(self, *args, **kwargs)
        STAMP["read"] = perf_counter()
        return packet

    connections.Connection._write_bytes = _write_bytes  # type: ignore[method-assign]
    connections.Connection._read_packet = _read_packet  # type: ignore[method-assign]


def _worker(key: str, env: dict[str, str], name: str, start: Any, seconds: float,
            out: Any) -> None:  # fmt: skip
    _stamp_pymysql()
    subject = scenarios.build(key, env)
    start.wait(60)
    before_send, after_read = [], []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        handle = subject.make(name)
        if not handle.acquire(10):
            continue
        after_read.append(perf_counter() - STAMP["read"])
        time.sleep(0)
        called = perf_counter()
        handle.release()
        before_send.append(STAMP["sent"] - called)
    subject.close()
    out.put((before_send, after_read))


def measure(key: str, env: dict[str, str], procs: int, seconds: float) -> dict[str, Any]:
    ctx = mp.get_context("fork")
    start, out = ctx.Event(), ctx.Queue()
    name = f"path:{time.time_ns()}"
    workers = [ctx.Process(target=_worker, args=(key, env, name, start, seconds, out))
               for _ in range(procs)]  # fmt: skip
    for w in workers:
        w.start()
    time.sleep(2.0)  # every child imported and connected
    start.set()
    before_send: list[float] = []
    after_read: list[float] = []
    for _ in workers:
        sent, read = out.get(timeout=seconds + 60)
        before_send += sent
        after_read += read
    for w in workers:
        w.join(10)
    return {
        "subject": key,
        "acq_per_s": len(before_send) / seconds,
        "release_to_sent_us": statistics.median(before_send) * 1e6,
        "answer_to_return_us": statistics.median(after_read) * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--procs", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out")
    args = parser.parse_args()
    env, running = servers.start(["mysql"], Path(tempfile.mkdtemp(prefix="latchkey-path-")))
    results = []
    try:
        for _ in range(args.rounds):
            for key in SUBJECTS:
                result = measure(key, env, args.procs, args.seconds)
                results.append(result)
                print(f"{key:24} {result['acq_per_s']:7.0f} acq/s   release → sent "
                      f"{result['release_to_sent_us']:5.1f} µs   answer → return "
                      f"{result['answer_to_return_us']:5.1f} µs", flush=True)  # fmt: skip
    finally:
        servers.stop(running)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
