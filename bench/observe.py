#!/usr/bin/env python3
"""What metrics and tracing cost: uncontended acquire + release with both off, metrics on,
tracing on, both on, and both on with every trace sampled out; and the floor: the same
library calls alone.

    .venv/bin/python bench/observe.py [--stores sqlite,redis] [--rounds 120] [--burst 50]
        [--src OTHER_TREE/src] [--out bench/results/observe.json]

One process per store. Metrics and tracing are switches that can be flipped at run time, so
the modes alternate inside that process in short bursts (``--burst`` pairs, one lock object
per pair), their order rotating every round, ``--rounds`` rounds: every mode sees the same
machine load, which on a shared machine moves far more than what is measured here. The figure
is each mode's total time per pair, and the rate with both off divided by the mode's rate.
Tracing uses the OpenTelemetry SDK with no span processor (spans are made and ended, exported
nowhere): the cost of the spans themselves, not of an exporter. Metrics go to a registry of
the run's own. ``metrics-no-rt``: ``enable_metrics(round_trips=False)``.

The floor (``lib-metrics``, ``lib-tracing``, ``lib-both``, timed in the same rounds): each
pair with both off, followed in the same loop by only the prometheus_client and
OpenTelemetry calls that one instrumented pair makes — eight updates on labelled children
looked up beforehand (acquisitions, wait, held +1, two round trips, release, held -1, hold);
two spans started with the same attributes, made current, given their outcome and ended.
That is the best any instrumentation making those calls could do; what a mode adds beyond
its floor is latchkey's own code. (The calls timed in a loop of their own cost less than
they add to a pair: on this machine the two spans add ~50 µs more to a sqlite pair than
they take alone — caches shared with the pair's own work.)
``--calls``: also count the Python function calls per pair (cProfile over 1000 pairs, after
the timed rounds), by whose code made them — latchkey's, the libraries' (prometheus_client,
opentelemetry), other (the driver…); a builtin counts as its caller's. Unlike times, these
counts do not move with the machine's load.
``--src``: run another tree (e.g. the commit before, for a before/after), modes it lacks are
left out.

Off versus the tree before instrumentation is a comparison of two trees:
``bench/headtohead.py OLD_SRC NEW_SRC --stores sqlite,redis``. Starts its own Redis
(tests/servers) and stops it by pid.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.servers import SERVERS, load_all  # noqa: E402

MODES = ["off", "metrics", "metrics-no-rt", "tracing", "both", "both-unsampled"]
FLOORS = ["lib-metrics", "lib-tracing", "lib-both"]

WORKER = """
import inspect, json, sys, time
import latchkey
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from opentelemetry import context, trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

url, rounds, burst = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
modes = json.loads(sys.argv[4])
if "round_trips" not in inspect.signature(latchkey.enable_metrics).parameters:
    modes.remove("metrics-no-rt")  # a tree before the option
registry, sampled = CollectorRegistry(), TracerProvider()
unsampled = TracerProvider(sampler=ALWAYS_OFF)

def switch(mode):
    latchkey.disable_metrics()
    latchkey.disable_tracing()
    if mode in ("metrics", "both", "both-unsampled"):
        latchkey.enable_metrics(registry)
    if mode == "metrics-no-rt":
        latchkey.enable_metrics(registry, round_trips=False)
    if mode in ("tracing", "both"):
        latchkey.enable_tracing(sampled)
    if mode == "both-unsampled":
        latchkey.enable_tracing(unsampled)

store = latchkey.connect(url)
def pairs(n):
    started = time.perf_counter()
    for _ in range(n):
        lock = store.lock("observe", ttl=30, wait=5)
        lock.acquire()
        lock.release()
    return time.perf_counter() - started

# The floor: the library calls of one pair, on metrics and a tracer of their own.
floor = CollectorRegistry()
def made(cls, name, labels, *values, **kw):
    return cls(name, name, labels, registry=floor, **kw).labels(*values)
scheme, lsk = url.split(":")[0], ("store", "kind")
c_acq = made(Counter, "f_acq", lsk + ("outcome",), scheme, "lock", "granted")
h_wait = made(Histogram, "f_wait", lsk + ("outcome",), scheme, "lock", "granted")
g_held = made(Gauge, "f_held", lsk, scheme, "lock")
h_rt = Histogram("f_rt", "f_rt", ("store", "op"), registry=floor)
h_rt_acq, h_rt_rel = h_rt.labels(scheme, "acquire"), h_rt.labels(scheme, "release")
c_rel = made(Counter, "f_rel", lsk + ("outcome",), scheme, "lock", "released")
h_hold = made(Histogram, "f_hold", lsk, scheme, "lock")
tracer = trace.get_tracer("floor", tracer_provider=TracerProvider())

def span(name, attributes, after):
    s = tracer.start_span(name, attributes=attributes)
    t = context.attach(trace.set_span_in_context(s))
    context.detach(t)
    s.set_attributes(after)
    s.end()

def lib(n, metrics, tracing):
    started = time.perf_counter()
    for _ in range(n):
        lock = store.lock("observe", ttl=30, wait=5)
        lock.acquire()
        lock.release()
        if tracing:
            span("latchkey.acquire",
                 {"latchkey.kind": "lock", "latchkey.store": scheme, "latchkey.name": "observe"},
                 {"latchkey.outcome": "granted", "latchkey.token": 1})
            span("latchkey.release",
                 {"latchkey.kind": "lock", "latchkey.store": scheme, "latchkey.name": "observe",
                  "latchkey.token": 1}, {"latchkey.outcome": "released"})
        if metrics:
            c_acq.inc(); h_wait.observe(0.0002); g_held.inc(); h_rt_acq.observe(0.0001)
            h_rt_rel.observe(0.0001); c_rel.inc(); g_held.dec(); h_hold.observe(0.00005)
    return time.perf_counter() - started

def measure(mode, n):
    switch("off" if mode.startswith("lib-") else mode)
    if mode.startswith("lib-"):
        return lib(n, mode in ("lib-metrics", "lib-both"), mode in ("lib-tracing", "lib-both"))
    return pairs(n)

for mode in modes:  # warm up every path
    measure(mode, burst)
spent = {mode: [] for mode in modes}
for i in range(rounds):
    k = i % len(modes)
    for mode in modes[k:] + modes[:k]:
        spent[mode].append(measure(mode, burst))
calls = {}
if sys.argv[5] == "calls":  # Python calls per pair, by whose code made them (cProfile)
    import cProfile, pstats
    def origin(func):
        path = func[0]
        if "prometheus_client" in path or "opentelemetry" in path:
            return "library"
        return "latchkey" if "latchkey" in path else "other"
    for mode in modes:
        measure(mode, burst)
        profile = cProfile.Profile()
        profile.enable()
        measure(mode, 1000)
        profile.disable()
        counts = {"library": 0, "latchkey": 0, "other": 0}
        for func, (_, ncalls, _, _, callers) in pstats.Stats(profile).stats.items():
            if func[0] == "~" and callers:  # a builtin: counted as its callers'
                for caller, (_, n, _, _) in callers.items():
                    counts[origin(caller)] += n
            else:
                counts[origin(func)] += ncalls
        calls[mode] = {k: v / 1000 for k, v in counts.items()}
switch("off")
store.close()
print(json.dumps({"spent": spent, "calls": calls}))
"""


def run(url: str, rounds: int, burst: int, src: str, calls: bool) -> dict[str, Any]:
    """The worker's answer: ``spent`` (seconds per burst, by mode) and ``calls``."""
    env = dict(os.environ, PYTHONPATH=src) if src else None
    modes = json.dumps(MODES + FLOORS)
    out = subprocess.run(
        [sys.executable, "-c", WORKER, url, str(rounds), str(burst), modes,
         "calls" if calls else ""],
        capture_output=True, text=True, check=True, env=env,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stores", default="sqlite,redis")
    parser.add_argument("--rounds", type=int, default=120)
    parser.add_argument("--burst", type=int, default=50)
    parser.add_argument("--src", default="", help="another tree's src (its latchkey)")
    parser.add_argument(
        "--calls",
        action="store_true",
        help="also count Python calls per pair by origin (cProfile, 1000 pairs)",
    )
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    load_all()
    results: dict[str, dict[str, dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="latchkey-observe-") as tmp:
        redis = None
        try:
            for store in args.stores.split(","):
                if store == "sqlite":
                    url = f"sqlite:///{tmp}/observe.db"
                else:
                    if redis is None:
                        redis = SERVERS["redis"].start(Path(tmp) / "redis")
                    url = redis.url
                answer = run(url, args.rounds, args.burst, args.src, args.calls)
                spent, calls = answer["spent"], answer["calls"]
                n = args.rounds * args.burst
                off = sum(spent["off"]) / n
                results[store] = {}
                for mode in spent:
                    per_pair = sum(spent[mode]) / n
                    added = per_pair - off
                    results[store][mode] = {
                        "us_per_pair": round(per_pair * 1e6, 1),
                        "added_us": round(added * 1e6, 1),
                        "rate_vs_off": round(off / per_pair, 3),
                    }
                    line = (
                        f"{store:7} {mode:15} {per_pair * 1e6:7.1f} us/pair "
                        f"({added * 1e6:+6.1f} us)  rate x{off / per_pair:.3f} of off"
                    )
                    if mode in calls:
                        results[store][mode]["calls_per_pair"] = calls[mode]
                        added_calls = {k: v - calls["off"][k] for k, v in calls[mode].items()}
                        line += "  calls added: " + ", ".join(
                            f"{k} {v:+.0f}" for k, v in added_calls.items()
                        )
                    print(line, flush=True)
        finally:
            if redis is not None:
                redis.stop()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
