"""Run by tests/contrib/test_celery_green.py in a subprocess patched by gevent, as a
``-P gevent`` worker is: ``python green_frozen.py <store URL through a proxy> <name>``.
Takes a lock, says "ready", waits for a line on stdin (the test has frozen the proxy
meanwhile), then takes another lock and prints, as JSON, what that did: its error, how long it
took, and the longest pause of a greenlet ticking every 0.1 s meanwhile."""

from gevent import monkey

monkey.patch_all()

import itertools  # noqa: E402  (after the patching, as in a gevent worker)
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import gevent  # noqa: E402

import latchkey  # noqa: E402

url, name = sys.argv[1], sys.argv[2]
store = latchkey.connect(url)
assert store.lock(f"{name}:first", ttl="30s").acquire()
ticks: list[float] = []


def tick() -> None:
    while True:
        ticks.append(time.monotonic())
        time.sleep(0.1)


gevent.spawn(tick)
time.sleep(0.2)
print("ready", flush=True)
sys.stdin.readline()
started = time.monotonic()
try:
    store.lock(f"{name}:second", ttl="30s").acquire()
    error = None
except latchkey.StoreUnavailable as exc:
    error = str(exc)
took = time.monotonic() - started
during = [t for t in ticks if t >= started - 0.2]
gaps = [b - a for a, b in itertools.pairwise(during)]
print(json.dumps({"error": error, "took": took, "max_gap": max(gaps, default=took)}), flush=True)
