#!/usr/bin/env python3
"""A paired A/B of row-claiming subjects: one git revision's latchkey against another's.

    PYTHONPATH=src bench/.venv/bin/python bench/rowsab.py --a REV [--b REV]
        [--stores postgresql,mysql] [--subjects lease10,take10] [--daemons 20] [--rows 3000]
        [--rounds 6] [--out results.json]

Each cell is one run of ``bench/eventqueue.py``'s subject (``run_subject``: fresh tables,
``--daemons`` forked daemons draining ``--rows`` due rows, normal round), in a process of its
own whose ``latchkey`` is the side's: ``--a``'s ``src`` (``git archive``), and ``--b``'s, or
this working tree's ``src`` without ``--b``. The sides alternate within every round and the
first side alternates between rounds (A B, B A, …), so a drift of the machine's load falls on
both. Servers: the tests' disposable ones (bench/servers.py), started once for the run.
Printed per store and subject: every round's rows/s, the medians, and the median of the
per-round ratios B/A; doubles and lost rows summed over the runs (both must be 0).

A small check for a change on a shared machine, not the 100-daemon benchmark
(bench/eventqueue.py), whose runs take minutes and which wants a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for path in (str(HERE), str(ROOT)):
    if path not in sys.path:
        sys.path.insert(0, path)


def cell(spec: dict[str, Any]) -> None:
    """Child: one run of a subject with the latchkey on PYTHONPATH; prints one JSON line."""
    import eventqueue

    import latchkey

    args = types.SimpleNamespace(daemons=spec["daemons"], sqlite_daemons=spec["daemons"],
                                 rows=spec["rows"], kill_fraction=0.1)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="latchkey-rowsab-") as tmp:
        result = eventqueue.run_subject(spec["store"], spec["subject"], "normal", spec["env"],
                                        Path(tmp), args)  # fmt: skip
    result["latchkey"] = latchkey.__file__
    print(json.dumps(result))


def source(rev: str, into: Path) -> Path:
    """The ``src`` directory of git revision ``rev``, extracted under ``into``."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "src"],
                             check=True, capture_output=True).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "src"


def run_cell(src: Path, spec: dict[str, Any]) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{ROOT}"}
    proc = subprocess.run([sys.executable, __file__, "--cell", json.dumps(spec)], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"failed": (proc.stderr or proc.stdout)[-300:]}
    result: dict[str, Any] = json.loads(lines[-1])
    if not result["latchkey"].startswith(str(src)):  # the side's latchkey, not another
        raise RuntimeError(f"ran {result['latchkey']}, not the one under {src}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cell", help=argparse.SUPPRESS)
    parser.add_argument("--a", help="git revision of side A (before)")
    parser.add_argument("--b", help="git revision of side B (default: this working tree)")
    parser.add_argument("--stores", default="postgresql,mysql")
    parser.add_argument("--subjects", default="lease10,take10")
    parser.add_argument("--daemons", type=int, default=20)
    parser.add_argument("--rows", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.cell:
        cell(json.loads(args.cell))
        return
    if not args.a:
        parser.error("--a REV is required")
    import servers

    stores = [s for s in args.stores.split(",") if s]
    subjects = [s for s in args.subjects.split(",") if s]
    results: dict[str, Any] = {"command": " ".join(sys.argv), "load_before": os.getloadavg(),
                               "cells": []}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="latchkey-rowsab-") as tmp:
        sides = {"A": source(args.a, Path(tmp, "a")),
                 "B": source(args.b, Path(tmp, "b")) if args.b else ROOT / "src"}  # fmt: skip
        env, running = servers.start([s for s in stores if s != "sqlite"], Path(tmp))
        try:
            for store in stores:
                for subject in subjects:
                    rates: dict[str, list[float]] = {"A": [], "B": []}
                    ratios, doubles, lost = [], 0, 0
                    for round_ in range(args.rounds):
                        got: dict[str, float] = {}
                        for side in ("A", "B") if round_ % 2 == 0 else ("B", "A"):
                            spec = {"store": store, "subject": subject, "env": env,
                                    "daemons": args.daemons, "rows": args.rows}  # fmt: skip
                            result = run_cell(sides[side], spec)
                            result.update(side=side, round=round_)
                            results["cells"].append(result)
                            if "rows_per_s" in result:
                                got[side] = result["rows_per_s"]
                                rates[side].append(result["rows_per_s"])
                                doubles += result.get("doubles", 0)
                                lost += result.get("lost", 0)
                            print(f"{store} {subject} round {round_} {side}: "
                                  f"{result.get('rows_per_s', result.get('failed'))}",
                                  flush=True)  # fmt: skip
                        if len(got) == 2:
                            ratios.append(got["B"] / got["A"])
                    if ratios:
                        print(f"== {store} {subject}: A median {statistics.median(rates['A']):.0f}"
                              f" rows/s, B median {statistics.median(rates['B']):.0f} rows/s, "
                              f"B/A median of {len(ratios)} pairs "
                              f"{statistics.median(ratios):.2f} "
                              f"(B faster in {sum(r > 1 for r in ratios)}); "
                              f"doubles {doubles}, lost {lost}", flush=True)  # fmt: skip
        finally:
            servers.stop(running)
    results["load_after"] = os.getloadavg()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
