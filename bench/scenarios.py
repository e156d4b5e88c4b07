"""The scenarios. Each one is bounded in count and in time; each returns a plain dict.

A     uncontended acquire+release pairs per second, one thread, a lock object per use.
B     hand-off latency: the holder records ``t_release`` (``time.monotonic()``, i.e.
      CLOCK_MONOTONIC, shared by every process on the machine) just before calling release; a
      waiter blocked in acquire in another process records ``t_acquired`` right after acquire
      returns. The holder waits a random 50-250 ms after the waiter reported "about to acquire"
      before releasing, so that the waiter is really blocked and polling phases average out.
C     8 processes take and release one name for a fixed time: acquisitions/s in total, and the
      fewest/most any process got (0 = starved). A flag in shared memory, set inside the
      critical section and checked on entry, detects a mutual-exclusion violation.
D     hold 1,000 distinct names at once: seconds to acquire all, then to release all.
claim latchkey only: ``store.claim(1,000 names)`` and ``release_all()`` against 1,000 single
      acquires and releases of the same store (measured right before).
"""

from __future__ import annotations

import multiprocessing as mp
import random
import statistics
import time
import traceback
from typing import Any

import subjects
from subjects import REGISTRY, Subject

CTX = mp.get_context("spawn")  # children build their own clients from scratch


def build(key: str, env: dict[str, str]) -> Subject:
    import peers  # noqa: F401  (registers the peers in a child process too)

    return REGISTRY[key].build(env)


def scenario_a(
    key: str, env: dict[str, str], seconds: float, max_pairs: int, tag: str
) -> dict[str, Any]:
    subject = build(key, env)
    try:
        name = f"a:{tag}"
        for _ in range(20):  # warm up: connections, prepared statements, script cache
            h = subject.make(name)
            if not h.acquire(5):
                raise RuntimeError("uncontended acquire failed")
            h.release()
        pairs, started = 0, time.perf_counter()
        deadline = started + seconds
        while pairs < max_pairs and time.perf_counter() < deadline:
            h = subject.make(name)
            if not h.acquire(5):
                raise RuntimeError("uncontended acquire failed")
            h.release()
            pairs += 1
        elapsed = time.perf_counter() - started
        return {"pairs_per_s": pairs / elapsed, "pairs": pairs, "seconds": elapsed}
    finally:
        subject.close()


def _b_waiter(key: str, env: dict[str, str], name: str, conn: Any) -> None:
    try:
        subject = build(key, env)
        conn.send("ready")
        while conn.poll(60):
            if conn.recv() == "stop":
                break
            handle = subject.make(name)
            conn.send("waiting")
            ok = handle.acquire(10)
            t_acquired = time.monotonic()
            if ok:
                handle.release()
            conn.send((ok, t_acquired))
        subject.close()
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def scenario_b(
    key: str, env: dict[str, str], reps: int, seconds: float, tag: str
) -> dict[str, Any]:
    name = f"b:{tag}"
    subject = build(key, env)
    ours, theirs = CTX.Pipe()
    waiter = CTX.Process(target=_b_waiter, args=(key, env, name, theirs), daemon=True)
    waiter.start()
    samples: list[float] = []
    failures = 0
    try:
        if not ours.poll(60) or ours.recv() != "ready":
            raise RuntimeError("waiter did not start")
        deadline = time.monotonic() + seconds
        for _ in range(reps):
            if time.monotonic() > deadline:
                break
            handle = subject.make(name)
            if not handle.acquire(10):
                raise RuntimeError("holder could not acquire")
            ours.send("go")
            if not ours.poll(30):
                raise RuntimeError("waiter silent")
            msg = ours.recv()
            if msg != "waiting":
                raise RuntimeError(f"waiter: {msg}")
            time.sleep(random.uniform(0.05, 0.25))
            t_release = time.monotonic()
            handle.release()
            if not ours.poll(30):
                raise RuntimeError("waiter never acquired")
            ok, t_acquired = ours.recv()
            if ok == "error":
                raise RuntimeError(f"waiter: {t_acquired}")
            if ok:
                samples.append(t_acquired - t_release)
            else:
                failures += 1
        ours.send("stop")
    finally:
        waiter.join(10)
        if waiter.is_alive():
            waiter.kill()
        subject.close()
    return {"samples": samples, "failures": failures, **latency_summary(samples)}


def latency_summary(samples: list[float]) -> dict[str, float]:
    if not samples:
        return {}
    ordered = sorted(samples)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return {"median_ms": statistics.median(ordered) * 1000, "p90_ms": p90 * 1000}


def _c_worker(key: str, env: dict[str, str], name: str, inside: Any, start: Any,
              seconds: float, out: Any, index: int) -> None:  # fmt: skip
    count = violations = timeouts = 0
    error = None
    try:
        subject = build(key, env)
        start.wait(60)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and count < 10_000_000:
            handle = subject.make(name)
            if not handle.acquire(max(0.1, min(10, deadline - time.monotonic()))):
                timeouts += 1
                continue
            if inside.value:  # another process is inside the critical section
                violations += 1
            inside.value = 1
            time.sleep(0)  # yield, so that an overlapping holder would be seen
            inside.value = 0
            handle.release()
            count += 1
        subject.close()
    except BaseException:
        error = traceback.format_exc()
    out.put((index, count, violations, timeouts, error))


def scenario_c(
    key: str, env: dict[str, str], procs: int, seconds: float, tag: str
) -> dict[str, Any]:
    name = f"c:{tag}"
    inside = CTX.RawValue("i", 0)
    start, out = CTX.Event(), CTX.Queue()
    workers = [
        CTX.Process(target=_c_worker, args=(key, env, name, inside, start, seconds, out, i),
                    daemon=True)
        for i in range(procs)
    ]  # fmt: skip
    for w in workers:
        w.start()
    time.sleep(3.0)  # let every child import and connect before the start signal
    start.set()
    results = []
    for _ in workers:
        try:
            results.append(out.get(timeout=seconds + 60))
        except Exception:
            break
    for w in workers:
        w.join(10)
        if w.is_alive():
            w.kill()
    errors = [r[4] for r in results if r[4]]
    counts = [r[1] for r in results] + [0] * (procs - len(results))
    return {
        "acq_per_s": sum(counts) / seconds,
        "min": min(counts),
        "max": max(counts),
        "violations": sum(r[2] for r in results),
        "timeouts": sum(r[3] for r in results),
        "errors": errors[:1],
    }


def scenario_d(
    key: str, env: dict[str, str], count: int, budget: float, tag: str
) -> dict[str, Any]:
    subject = build(key, env)
    try:
        handles = [subject.make(f"d:{tag}:{i}") for i in range(count)]
        held, failed = [], 0
        started = time.perf_counter()
        for h in handles:
            if time.perf_counter() - started > budget:
                break
            if h.acquire(2):
                held.append(h)
            else:
                failed += 1
        acquire_s = time.perf_counter() - started
        started = time.perf_counter()
        for h in held:
            h.release()
        release_s = time.perf_counter() - started
        return {"acquire_s": acquire_s, "release_s": release_s, "held": len(held),
                "failed": failed, "complete": len(held) == count}  # fmt: skip
    finally:
        subject.close()


def scenario_claim(key: str, env: dict[str, str], count: int, tag: str) -> dict[str, Any]:
    """claim(count) + release_all() against count single acquires + releases, same store."""
    subject = build(key, env)
    assert isinstance(subject, subjects.LatchkeySubject)
    store = subject.store
    try:
        if not store.capabilities.claims:
            return {"error": "store has no batch claims"}
        names = [f"claim:{tag}:single:{i}" for i in range(count)]
        locks = [store.lock(n, ttl=subjects.TTL, wait=0) for n in names]
        started = time.perf_counter()
        got = sum(1 for lock in locks if lock.acquire())
        single_acquire = time.perf_counter() - started
        started = time.perf_counter()
        for lock in locks:
            lock.release()
        single_release = time.perf_counter() - started
        names = [f"claim:{tag}:batch:{i}" for i in range(count)]
        started = time.perf_counter()
        claim = store.claim(names, ttl=subjects.TTL)
        claim_s = time.perf_counter() - started
        started = time.perf_counter()
        claim.release_all()
        release_all_s = time.perf_counter() - started
        return {
            "single_acquire_s": single_acquire, "single_release_s": single_release,
            "claim_s": claim_s, "release_all_s": release_all_s,
            "claimed": len(claim.acquired), "single_acquired": got,
            "acquire_ratio": single_acquire / claim_s,
            "release_ratio": single_release / release_all_s,
        }  # fmt: skip
    finally:
        subject.close()


def _pairs_for(subject: Subject, name: str, seconds: float) -> float:
    pairs, started = 0, time.perf_counter()
    while pairs < 100_000 and time.perf_counter() - started < seconds:
        h = subject.make(name)
        if not h.acquire(5):
            raise RuntimeError("uncontended acquire failed")
        h.release()
        pairs += 1
    return pairs / (time.perf_counter() - started)


def scenario_a_paired(ours: str, theirs: str, env: dict[str, str], slices: int,
                      seconds: float, tag: str) -> dict[str, Any]:  # fmt: skip
    """A for a target: latchkey and its raw baseline alternate in short slices (ABBA order)
    in one process, so both see the same machine load; one ratio per pair of slices."""
    a, b = build(ours, env), build(theirs, env)
    try:
        name = f"ap:{tag}"
        _pairs_for(a, name, 0.3)  # warm up both
        _pairs_for(b, name + ":raw", 0.3)
        ratios, ours_rates, theirs_rates = [], [], []
        for i in range(slices):
            if i % 2 == 0:
                x = _pairs_for(a, name, seconds)
                y = _pairs_for(b, name + ":raw", seconds)
            else:
                y = _pairs_for(b, name + ":raw", seconds)
                x = _pairs_for(a, name, seconds)
            ours_rates.append(x)
            theirs_rates.append(y)
            ratios.append(x / y)
        med = statistics.median
        return {"ratio": med(ratios), "ratios": ratios,
                "latchkey": med(ours_rates), "raw": med(theirs_rates)}  # fmt: skip
    finally:
        a.close()
        b.close()
