"""ZooKeeper hand-off, step by step: where the time from release to the waiter's return goes,
and which requests each side sends in it (issue 16, item 7).

Scenario B's shape (a waiter process blocked in acquire, the holder releases after 50-250 ms),
with kazoo instrumented in both processes: every request written to the socket, every answer
and watch event read, and the waiter's wake-up are stamped with ``time.monotonic()`` (one
clock for every process on the machine). Per hand-off it reports the phases

    release → delete sent → watch event read (waiter) → waiter woken → its requests → return

and the requests each side sent between the release call and the waiter's return. Subjects
alternate hand-off by hand-off, so each sees the same load::

    PYTHONPATH=src bench/.venv/bin/python bench/zkhandoff.py --reps 40 \
        --out bench/results/zkhandoff.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from scenarios import build

import servers

CTX = mp.get_context("spawn")
SUBJECTS = ["zookeeper/latchkey", "zookeeper/kazoo-lock", "zookeeper/tooz"]
LOG: list[tuple[float, str]] = []


def instrument() -> None:
    """Stamp kazoo's socket traffic and the waiters' wake-ups into :data:`LOG`."""
    from kazoo.protocol import connection

    handler = connection.ConnectionHandler
    submit, response, event = handler._submit, handler._read_response, handler._read_watch_event

    def _submit(self: Any, request: Any, timeout: Any, xid: Any = None) -> Any:
        LOG.append((time.monotonic(), f"send {type(request).__name__}"))
        return submit(self, request, timeout, xid)

    def _read_response(self: Any, header: Any, buffer: Any, offset: Any) -> Any:
        kind = type(self.client._pending[0][0]).__name__ if self.client._pending else "?"
        LOG.append((time.monotonic(), f"answer {kind}"))
        return response(self, header, buffer, offset)

    def _read_watch_event(self: Any, buffer: Any, offset: Any) -> Any:
        LOG.append((time.monotonic(), "event"))
        return event(self, buffer, offset)

    handler._submit, handler._read_response = _submit, _read_response  # type: ignore[method-assign]
    handler._read_watch_event = _read_watch_event  # type: ignore[method-assign]

    from kazoo.recipe.lock import Lock

    watch = Lock._watch_predecessor

    def _watch_predecessor(self: Any, ev: Any) -> None:
        LOG.append((time.monotonic(), "wake"))
        watch(self, ev)

    Lock._watch_predecessor = _watch_predecessor  # type: ignore[method-assign]
    try:
        from latchkey.stores.zookeeper_nodes import InLine
    except ImportError:
        return
    wake = InLine.wake

    def _wake(self: Any, ev: Any = None) -> None:
        LOG.append((time.monotonic(), "wake"))
        wake(self, ev)

    InLine.wake = _wake  # type: ignore[method-assign]


def _waiter(env: dict[str, str], name: str, conn: Any) -> None:
    try:
        instrument()
        subjects = {key: build(key, env) for key in SUBJECTS}
        conn.send("ready")
        while True:
            msg = conn.recv()
            if msg == "stop":
                break
            handle = subjects[msg].make(f"{name}:{msg}")
            conn.send("waiting")
            LOG.clear()
            ok = handle.acquire(10)
            t_acquired = time.monotonic()
            log = list(LOG)
            if ok:
                handle.release()
            conn.send((ok, t_acquired, log))
        for subject in subjects.values():
            subject.close()
    except BaseException:
        conn.send(("error", traceback.format_exc(), []))


def phases(t_release: float, t_acquired: float, holder: list[Any], waiter: list[Any]) -> dict:
    """The phases of one hand-off, ms, and the requests each side sent during it."""
    after = [(t, what) for t, what in holder if t >= t_release]
    seen = [(t, what) for t, what in waiter if t >= t_release]
    sent = next((t for t, w in after if w.startswith("send")), None)
    event = next((t for t, w in seen if w == "event"), None)
    woken = next((t for t, w in seen if w == "wake"), None)
    asked = [(t, w) for t, w in seen if w.startswith("send") and woken and t >= woken]
    answers = [t for t, w in seen if w.startswith("answer") and woken and t >= woken]

    def ms(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else (b - a) * 1000

    return {
        "total": ms(t_release, t_acquired),
        "release→sent": ms(t_release, sent),
        "sent→event": ms(sent, event),
        "event→wake": ms(event, woken),
        "wake→first request": ms(woken, asked[0][0] if asked else None),
        "requests→last answer": ms(
            asked[0][0] if asked else None, answers[-1] if answers else None
        ),
        "last step→return": ms(answers[-1] if answers else woken, t_acquired),
        "holder requests": [w[5:] for t, w in after if w.startswith("send") and t <= t_acquired],
        "waiter requests": [w[5:] for t, w in asked if t <= t_acquired],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=40, help="hand-offs per subject")
    parser.add_argument("--subjects", default=",".join(SUBJECTS))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    chosen = args.subjects.split(",")
    instrument()
    import latchkey

    meta = {
        "argv": sys.argv[1:],
        "date": time.strftime("%Y-%m-%d %H:%M:%S +0000", time.gmtime()),
        "latchkey": str(Path(latchkey.__file__).parent),  # which tree (PYTHONPATH)
        "loadavg_start": os.getloadavg(),
    }
    with tempfile.TemporaryDirectory() as tmp:
        env, running = servers.start(["zookeeper"], Path(tmp))
        try:
            results = run(env, chosen, args.reps)
        finally:
            servers.stop(running)
    meta["loadavg_end"] = os.getloadavg()
    report(results)
    print(f"latchkey from {meta['latchkey']}; load average {meta['loadavg_start']} → "
          f"{meta['loadavg_end']}")
    if args.out:
        args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))


def run(env: dict[str, str], chosen: list[str], reps: int) -> dict[str, list[dict]]:
    name = f"probe:{random.randrange(1 << 30)}"
    holders = {key: build(key, env) for key in chosen}
    ours, theirs = CTX.Pipe()
    child = CTX.Process(target=_waiter, args=(env, name, theirs), daemon=True)
    child.start()
    results: dict[str, list[dict]] = {key: [] for key in chosen}
    try:
        if ours.recv() != "ready":
            raise RuntimeError("waiter did not start")
        for _ in range(reps):
            for key in random.sample(chosen, len(chosen)):
                handle = holders[key].make(f"{name}:{key}")
                if not handle.acquire(10):
                    raise RuntimeError("holder could not acquire")
                ours.send(key)
                if ours.recv() != "waiting":
                    raise RuntimeError("waiter is not waiting")
                time.sleep(random.uniform(0.05, 0.25))
                LOG.clear()
                t_release = time.monotonic()
                handle.release()
                ok, t_acquired, log = ours.recv()
                if ok == "error":
                    raise RuntimeError(t_acquired)
                if ok:
                    results[key].append(phases(t_release, t_acquired, list(LOG), log))
        ours.send("stop")
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
        for subject in holders.values():
            subject.close()
    return results


def report(results: dict[str, list[dict]]) -> None:
    for key, rows in results.items():
        print(f"\n{key}: {len(rows)} hand-offs (medians, ms)")
        for phase in [k for k in rows[0] if not k.endswith("requests")] if rows else []:
            values = [r[phase] for r in rows if r[phase] is not None]
            if values:
                print(f"  {phase:22} {statistics.median(values):6.3f}  (n={len(values)})")
        for side in ("holder requests", "waiter requests"):
            counts: dict[str, int] = {}
            for r in rows:
                label = " + ".join(r[side]) or "none"
                counts[label] = counts.get(label, 0) + 1
            print(f"  {side}: " + "; ".join(f"{k} x{v}" for k, v in counts.items()))


if __name__ == "__main__":
    main()
