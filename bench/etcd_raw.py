#!/usr/bin/env python3
"""etcd: latchkey's uncontended acquire + release against raw httpx doing the same round trips.

    .venv/bin/python bench/etcd_raw.py [--slices 16] [--seconds 0.5]

Starts its own etcd (tests/servers/etcd.py) and stops it by pid. Two subjects, one thread,
one name, a new lock object per pair:

- ``latchkey``: ``store.lock(name, ttl=30, wait=0)``, ``acquire()``, ``release()`` — which
  sends the lease grant, the acquire transaction (create-if-absent of slot and holder keys),
  and the revoke;
- ``raw``: httpx posting the same three requests (a one-key create-if-absent transaction).

Subjects alternate in slices of ``--seconds`` (ABBA order) so that all see the same load; the
ratio is the median of the per-pair ratios, with its range.
"""

from __future__ import annotations

import argparse
import base64
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.servers.etcd import start_etcd  # noqa: E402

import latchkey  # noqa: E402


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def raw_subject(base: str) -> Callable[[], None]:
    client = httpx.Client(timeout=5)
    key, counter = b64(f"raw:{uuid.uuid4().hex}"), iter(range(1, 1 << 62))

    def txn(lease: int) -> dict[str, object]:
        put = {"request_put": {"key": key, "value": b64("owner"), "lease": str(lease)}}
        body = {
            "compare": [
                {"key": key, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
            ],
            "success": [put],
            "failure": [{"request_range": {"key": key}}],
        }
        return client.post(f"{base}/v3/kv/txn", json=body).json()  # type: ignore[no-any-return]

    def pair() -> None:
        lease = next(counter) + 1_000_000_000
        client.post(f"{base}/v3/lease/grant", json={"ID": str(lease), "TTL": "30"})
        assert txn(lease).get("succeeded")
        client.post(f"{base}/v3/lease/revoke", json={"ID": str(lease)})

    return pair


def latchkey_subject(url: str) -> Callable[[], None]:
    store, name = latchkey.connect(url), f"bench:{uuid.uuid4().hex}"

    def pair() -> None:
        lock = store.lock(name, ttl=30, wait=0)
        assert lock.acquire()
        lock.release()

    return pair


def rate(pair: Callable[[], None], seconds: float) -> float:
    count, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        pair()
        count += 1
    return count / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slices", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=0.5)
    args = parser.parse_args()
    server = start_etcd(Path(tempfile.mkdtemp(prefix="latchkey-bench-etcd-")))
    try:
        base = f"http://127.0.0.1:{server.port}"
        subjects = {
            "latchkey": latchkey_subject(server.url),
            "raw": raw_subject(base),
        }
        for pair in subjects.values():
            rate(pair, 0.3)  # warm-up
        rates: dict[str, list[float]] = {k: [] for k in subjects}
        names = list(subjects)
        for i in range(args.slices):
            for k in names if i % 2 == 0 else reversed(names):
                rates[k].append(rate(subjects[k], args.seconds))
        ratios = [a / b for a, b in zip(rates["latchkey"], rates["raw"], strict=True)]
        print(f"etcd 3.4, one member; {args.slices} slices of {args.seconds}s, ABBA")
        for k, values in rates.items():
            print(f"  {k:18} {statistics.median(values):7.0f} pairs/s (median)")
        print(
            f"  latchkey / raw: {statistics.median(ratios):.2f}"
            f" (range {min(ratios):.2f}-{max(ratios):.2f})"
        )
    finally:
        server.stop()


if __name__ == "__main__":
    main()
