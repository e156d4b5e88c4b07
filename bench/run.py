#!/usr/bin/env python3
"""latchkey benchmarks: latchkey vs the raw client doing the same round trips vs peer libraries.

    bench/setup.sh                       # once: bench/.venv with latchkey, drivers and peers
    bench/.venv/bin/python bench/run.py [--stores redis,postgresql,mysql,memcached,sqlite
        |etcd,zookeeper,redis+cluster,redis+sentinel]
        [--scenarios A,B,C,D,claim] [--peers] [--quick] [--rounds N] [--out results.json]
    bench/.venv/bin/python bench/run.py --roundtrips   # server-side commands per acquire+release

Starts its own disposable servers on free loopback ports (tests/servers), runs every scenario
for every subject, interleaved, ``--rounds`` times, and prints the median of the rounds. The
method is in docs/benchmarks.md and in scenarios.py.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
for path in (str(HERE), str(HERE.parent)):
    if path not in sys.path:
        sys.path.insert(0, path)

import peers  # noqa: E402
import scenarios  # noqa: E402
from subjects import REGISTRY, Spec  # noqa: E402

import servers  # noqa: E402

DASH, TIMES = "\u2013", "\u00d7"
FAMILIES = ["redis", "postgresql", "mysql", "memcached", "sqlite"]
#: The consensus and cluster stores (issue 16): run when named in --stores.
CONSENSUS = ["etcd", "zookeeper", "redis+cluster", "redis+sentinel"]
FAMILY_OF = {"postgresql+advisory": "postgresql", "mysql+getlock": "mysql", "local": "sqlite"}


def family(spec: Spec) -> str:
    return FAMILY_OF.get(spec.store, spec.store)


def selected(families: list[str], with_peers: bool) -> list[Spec]:
    kinds = {"latchkey", "raw"} | ({"peer"} if with_peers else set())
    return [s for s in REGISTRY.values() if family(s) in families and s.kind in kinds]


def measure(
    spec: Spec, scenario: str, env: dict[str, str], cfg: dict[str, Any], tag: str
) -> dict[str, Any]:
    try:
        if scenario == "A":
            return scenarios.scenario_a(spec.key, env, cfg["a_seconds"], cfg["a_max"], tag)
        if scenario == "B":
            return scenarios.scenario_b(spec.key, env, cfg["b_reps"], cfg["b_seconds"], tag)
        if scenario == "C":
            return scenarios.scenario_c(spec.key, env, 8, cfg["c_seconds"], tag)
        if scenario == "D":
            return scenarios.scenario_d(spec.key, env, 1000, cfg["d_budget"], tag)
        if scenario == "claim":
            return scenarios.scenario_claim(spec.key, env, 1000, tag)
    except Exception as exc:
        return {
            "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        }
    raise ValueError(scenario)


# -- summaries ------------------------------------------------------------------------------------


def summarise(runs: list[dict[str, Any]], scenario: str) -> dict[str, Any]:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[0]["error"] if runs else "not run"}
    med = lambda k: statistics.median(r[k] for r in ok)  # noqa: E731
    if scenario == "A":
        values = [r["pairs_per_s"] for r in ok]
        return {"value": med("pairs_per_s"), "min": min(values), "max": max(values), "n": len(ok)}
    if scenario == "B":
        samples = [s for r in ok for s in r["samples"]]
        if not samples:
            return {"error": f"no hand-off completed ({sum(r['failures'] for r in ok)} timeouts)"}
        out = scenarios.latency_summary(samples)
        out["round_medians_ms"] = [r.get("median_ms") for r in ok]
        out["n"] = len(samples)
        out["timeouts"] = sum(r["failures"] for r in ok)
        return out
    if scenario == "C":
        best = sorted(ok, key=lambda r: r["acq_per_s"])[len(ok) // 2]
        return {"value": best["acq_per_s"], "min": best["min"], "max": best["max"],
                "violations": sum(r["violations"] for r in ok),
                "timeouts": sum(r["timeouts"] for r in ok), "errors": best["errors"]}  # fmt: skip
    if scenario == "D":
        return {"acquire_s": med("acquire_s"), "release_s": med("release_s"),
                "complete": all(r["complete"] for r in ok),
                "held": min(r["held"] for r in ok),
                "failed": max(r["failed"] for r in ok)}  # fmt: skip
    if scenario == "claim":
        keys = ["single_acquire_s", "single_release_s", "claim_s", "release_all_s",
                "acquire_ratio", "release_ratio"]  # fmt: skip
        return {k: med(k) for k in keys} | {"claimed": min(r["claimed"] for r in ok)}
    raise ValueError(scenario)


def cell(summary: dict[str, Any] | None, scenario: str) -> str:
    if summary is None:
        return DASH
    if "error" in summary:
        return f"error: {summary['error'][:60]}"
    if scenario == "A":
        return f"{summary['value']:,.0f}"
    if scenario == "B":
        return f"{summary['median_ms']:.1f} ms (p90 {summary['p90_ms']:.1f})"
    if scenario == "C":
        text = f"{summary['value']:,.0f} ({summary['min']}/{summary['max']})"
        if summary["violations"]:
            text += f" {summary['violations']} VIOLATIONS"
        if summary["errors"]:
            text += " error: " + summary["errors"][0].strip().splitlines()[-1][:60]
        return text
    if scenario == "D":
        text = f"{summary['acquire_s']:.2f} s + {summary['release_s']:.2f} s"
        if not summary["complete"]:
            text += f" (held {summary['held']}/1000, {summary['failed']} failed)"
        return text
    if scenario == "claim":
        s = summary
        ms = {k: f"{v * 1000:.0f} ms" for k, v in s.items() if k.endswith("_s")}
        return (f"claim {ms['claim_s']} vs {ms['single_acquire_s']} "
                f"({s['acquire_ratio']:.0f}{TIMES}); release_all {ms['release_all_s']} "
                f"vs {ms['single_release_s']} ({s['release_ratio']:.0f}{TIMES})")  # fmt: skip
    raise ValueError(scenario)


def table(summaries: dict[str, dict[str, Any]], specs: list[Spec], wanted: list[str]) -> str:
    cols = [s for s in ["A", "B", "C", "D"] if s in wanted]
    heads = {"A": "A pairs/s", "B": "B hand-off median (p90)", "C": "C acq/s (min/max per proc)",
             "D": "D 1,000 names: acquire + release"}  # fmt: skip
    lines = []
    for fam in FAMILIES + CONSENSUS:
        rows = [s for s in specs if family(s) == fam]
        if not rows:
            continue
        lines.append(f"\n### {fam}\n")
        lines.append("| store | subject | " + " | ".join(heads[c] for c in cols) + " |")
        lines.append("| --- | --- | " + " | ".join("---" for _ in cols) + " |")
        for s in rows:
            got = summaries.get(s.key, {})
            cells = [cell(got.get(c), c) if c in s.scenarios else "n/a" for c in cols]
            lines.append(f"| {s.store} | {s.label} | " + " | ".join(cells) + " |")
    claims = [(s, summaries.get(s.key, {}).get("claim")) for s in specs if s.kind == "latchkey"]
    claims = [(s, c) for s, c in claims if c is not None]
    if claims:
        lines.append("\n### claim(1,000) vs 1,000 single acquires (latchkey)\n")
        lines.append("| store | result |")
        lines.append("| --- | --- |")
        for s, c in claims:
            lines.append(f"| {s.store} | {cell(c, 'claim')} |")
    return "\n".join(lines)


TARGETS = [
    # issue, text, numerator (key, scenario), denominator, kind (">=" ratio or "<=" ratio), bound
    ("3", "PostgreSQL B: latchkey / raw pg_advisory_lock hand-off", ("postgresql/latchkey", "B"),
     ("postgresql/raw-advisory", "B"), "<=", 1.2),
    ("ref", "PostgreSQL B: the durable floor (flushed commit, then unlock) / raw advisory",
     ("postgresql/raw-durable-floor", "B"), ("postgresql/raw-advisory", "B"), "<=", 1.2),
    ("ref", "PostgreSQL B: latchkey / the durable floor", ("postgresql/latchkey", "B"),
     ("postgresql/raw-durable-floor", "B"), "<=", 1.2),
    ("ref", "PostgreSQL B: latchkey / raw INSERT + DELETE with LISTEN/NOTIFY hand-off",
     ("postgresql/latchkey", "B"), ("postgresql/raw-notify", "B"), "<=", 1.2),
    ("3", "PostgreSQL A: latchkey / the same INSERT…ON CONFLICT + DELETE sent raw",
     ("postgresql/latchkey", "A"), ("postgresql/raw-same-sql", "A"), ">=", 0.9),
    ("3", "MariaDB A: latchkey / the same upsert…RETURNING + DELETE sent raw",
     ("mysql/latchkey", "A"), ("mysql/raw-same-sql", "A"), ">=", 0.9),
    ("ref", "PostgreSQL A: latchkey / the same SQL sent as latchkey sends it (psycopg.pq)",
     ("postgresql/latchkey", "A"), ("postgresql/raw-same-sql-pq", "A"), ">=", 0.9),
    ("ref", "MariaDB A: latchkey / the same EXECUTEs with positional parameters",
     ("mysql/latchkey", "A"), ("mysql/raw-same-sql-args", "A"), ">=", 0.9),
    ("ref", "postgresql+advisory A: latchkey / raw pg_advisory_lock+unlock via psycopg.pq",
     ("postgresql+advisory/latchkey", "A"), ("postgresql/raw-advisory-pq", "A"), ">=", 0.9),
    ("ref", "PostgreSQL A: latchkey / raw minimal-row INSERT…ON CONFLICT + DELETE",
     ("postgresql/latchkey", "A"), ("postgresql/raw", "A"), ">=", 0.9),
    ("ref", "MariaDB A: latchkey / raw minimal-row INSERT IGNORE + DELETE", ("mysql/latchkey", "A"),
     ("mysql/raw", "A"), ">=", 0.9),
    ("3", "postgresql+advisory A: latchkey / raw pg_advisory_lock+unlock",
     ("postgresql+advisory/latchkey", "A"), ("postgresql/raw-advisory", "A"), ">=", 0.9),
    ("3", "mysql+getlock A: latchkey / raw GET_LOCK+RELEASE_LOCK", ("mysql+getlock/latchkey", "A"),
     ("mysql/raw-getlock", "A"), ">=", 0.9),
    ("3", "postgresql+advisory B: latchkey / raw pg_advisory_lock hand-off",
     ("postgresql+advisory/latchkey", "B"), ("postgresql/raw-advisory", "B"), "<=", 1.2),
    ("3", "mysql+getlock B: latchkey / raw GET_LOCK hand-off", ("mysql+getlock/latchkey", "B"),
     ("mysql/raw-getlock", "B"), "<=", 1.2),
    ("4", "Redis B: latchkey / raw BLPOP wake-up", ("redis/latchkey", "B"),
     ("redis/raw-blpop", "B"), "<=", 1.2),
    ("4", "Redis A: latchkey / raw SET NX PX + EVALSHA", ("redis/latchkey", "A"),
     ("redis/raw", "A"),
     ">=", 0.9),
    ("4", "memcached A: latchkey / raw add + delete", ("memcached/latchkey", "A"),
     ("memcached/raw", "A"), ">=", 0.9),
    ("16", "etcd A: latchkey / its grant, transaction and revoke sent bare (httpx)",
     ("etcd/latchkey", "A"), ("etcd/raw-same", "A"), ">=", 0.9),
    ("ref", "etcd A: latchkey / raw grant, one-key txn, revoke", ("etcd/latchkey", "A"),
     ("etcd/raw", "A"), ">=", 0.9),
    ("16", "etcd A: latchkey / tooz etcd3gw", ("etcd/latchkey", "A"), ("etcd/tooz", "A"),
     ">=", 1.0),
    ("ref", "etcd B: latchkey / raw watch hand-off", ("etcd/latchkey", "B"), ("etcd/raw", "B"),
     "<=", 1.2),
    ("16", "etcd B: latchkey / tooz etcd3gw", ("etcd/latchkey", "B"), ("etcd/tooz", "B"),
     "<=", 1.0),
    ("16", "zookeeper A: latchkey / its two requests sent bare (kazoo)",
     ("zookeeper/latchkey", "A"), ("zookeeper/raw", "A"), ">=", 0.9),
    ("16", "zookeeper A: latchkey / tooz zookeeper", ("zookeeper/latchkey", "A"),
     ("zookeeper/tooz", "A"), ">=", 1.0),
    ("ref", "zookeeper B: latchkey / kazoo Lock recipe", ("zookeeper/latchkey", "B"),
     ("zookeeper/kazoo-lock", "B"), "<=", 1.2),
    ("16", "zookeeper B: latchkey / tooz zookeeper", ("zookeeper/latchkey", "B"),
     ("zookeeper/tooz", "B"), "<=", 1.0),
    ("16", "redis+cluster A: latchkey / its scripts by EVALSHA (RedisCluster)",
     ("redis+cluster/latchkey", "A"), ("redis+cluster/raw", "A"), ">=", 0.9),
    ("ref", "redis+cluster B: latchkey / raw BLPOP wake-up", ("redis+cluster/latchkey", "B"),
     ("redis+cluster/raw-blpop", "B"), "<=", 1.2),
    ("16", "redis+sentinel A: latchkey / its scripts by EVALSHA (master_for)",
     ("redis+sentinel/latchkey", "A"), ("redis+sentinel/raw", "A"), ">=", 0.9),
    ("ref", "redis+sentinel B: latchkey / raw BLPOP wake-up", ("redis+sentinel/latchkey", "B"),
     ("redis+sentinel/raw-blpop", "B"), "<=", 1.2),
]  # fmt: skip


def number(v: float | None) -> str:
    return DASH if v is None else f"{v:,.1f}" if v < 100 else f"{v:,.0f}"


def metric(summary: dict[str, Any] | None, scenario: str) -> float | None:
    if not summary or "error" in summary:
        return None
    return float(summary["median_ms"] if scenario == "B" else summary["value"])


def run_paired(env: dict[str, str], cfg: dict[str, Any], specs: list[Spec]) -> dict[str, Any]:
    """The A targets, measured latchkey/raw alternating in one process (see scenarios)."""
    keys = {s.key for s in specs}
    out: dict[str, Any] = {}
    for _issue, text, (nk, ns), (dk, _ds), _op, _bound in TARGETS:
        if ns != "A" or nk not in keys or dk not in keys:
            continue
        try:
            out[text] = scenarios.scenario_a_paired(
                nk, dk, env, cfg["pair_slices"], cfg["pair_seconds"], f"{nk}.{os.getpid()}"
            )
        except Exception as exc:
            out[text] = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"[paired A] {text}: {out[text].get('ratio', out[text])}", flush=True)
    return out


def paired(raw: dict[str, Any], nk: str, dk: str, scenario: str) -> list[float]:
    """Per-round ratios latchkey/raw, from the runs of one round (measured minutes apart at
    most): steadier than a ratio of medians when the machine's load drifts."""
    field = "median_ms" if scenario == "B" else "pairs_per_s"
    ours = {r["round"]: r.get(field) for r in raw.get(nk, {}).get(scenario, [])}
    theirs = {r["round"]: r.get(field) for r in raw.get(dk, {}).get(scenario, [])}
    return [ours[i] / theirs[i] for i in ours if ours[i] and theirs.get(i)]


def targets(summaries: dict[str, dict[str, Any]], raw: dict[str, Any],
            alternating: dict[str, Any]) -> list[dict[str, Any]]:  # fmt: skip
    out = []
    for issue, text, (nk, ns), (dk, ds), op, bound in TARGETS:
        if nk not in summaries and text not in alternating:
            continue  # a store not in this run
        num = metric(summaries.get(nk, {}).get(ns), ns)
        den = metric(summaries.get(dk, {}).get(ds), ds)
        ratios = paired(raw, nk, dk, ns)
        alt = alternating.get(text, {})
        if "ratios" in alt:  # A measured alternating in one process: the better estimate
            ratios = alt["ratios"]
            num, den = alt["latchkey"], alt["raw"]
        ratio = statistics.median(ratios) if ratios else None
        met = None if ratio is None else (ratio >= bound if op == ">=" else ratio <= bound)
        out.append({"issue": issue, "target": text, "ratio": ratio, "op": op, "bound": bound,
                    "latchkey": num, "raw": den, "met": met,
                    "round_ratios": [round(x, 3) for x in ratios]})  # fmt: skip
    return out


def target_table(rows: list[dict[str, Any]]) -> str:
    lines = ["\n### targets (ratio: median of paired latchkey/raw measurements; min-max)\n",
             "| issue | comparison | latchkey | raw | ratio | target | met? |",
             "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in rows:
        ratio = DASH if r["ratio"] is None else f"{r['ratio']:.2f}"
        if r["round_ratios"]:
            ratio += f" ({min(r['round_ratios']):.2f}-{max(r['round_ratios']):.2f})"
        met = {None: "not measured", True: "yes", False: "**no**"}[r["met"]]
        ours, theirs = number(r["latchkey"]), number(r["raw"])
        lines.append(f"| {r['issue']} | {r['target']} | {ours} | {theirs} | "
                     f"{ratio} | {r['op']} {r['bound']} | {met} |")  # fmt: skip
    return "\n".join(lines)


# -- round trips ----------------------------------------------------------------------------------


def roundtrips(specs: list[Spec], env: dict[str, str], pairs: int = 200) -> dict[str, Any]:
    """Server-side commands per acquire+release pair, for latchkey and the raw baselines."""
    out: dict[str, Any] = {}
    for spec in specs:
        server = servers.FAMILY_SERVERS[family(spec)]
        if spec.kind == "peer" or not server or "A" not in spec.scenarios:
            continue
        try:
            subject = scenarios.build(spec.key, env)
            for i in range(20):
                h = subject.make(f"rt:{i % 2}")
                h.acquire(5)
                h.release()
            idle0 = servers.counters(server[0], env)
            idle1 = servers.counters(server[0], env)
            before = servers.counters(server[0], env)
            for _ in range(pairs):
                h = subject.make("rt:x")
                h.acquire(5)
                h.release()
            after = servers.counters(server[0], env)
            subject.close()
            noise = idle1 - idle0
            delta = {k: (after[k] - before[k] - noise.get(k, 0)) / pairs for k in after}
            out[spec.key] = {k: round(v, 2) for k, v in sorted(delta.items()) if v >= 0.05}
        except Exception as exc:
            out[spec.key] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def report(path: Path) -> int:
    """Print the tables of a results file written by --out (no measuring)."""
    data = json.loads(path.read_text())
    summaries, meta = data["summaries"], data["meta"]
    specs = [s for s in REGISTRY.values() if s.key in summaries]
    wanted = sorted({sc for v in summaries.values() for sc in v})
    print(f"date {meta['date']}, commit {meta.get('commit', '?')}, {meta['machine']}, "
          f"{meta['cpus']} CPUs, Python {meta['python']}, "
          f"args {' '.join(meta['argv'])}")  # fmt: skip
    print(table(summaries, specs, wanted))
    print(target_table(data["targets"]))
    spread = data.get("a_spread") or {}
    if spread:
        print(f"\nA spread across rounds: median {statistics.median(spread.values()):.0%}, "
              f"worst {max(spread.values()):.0%}")  # fmt: skip
    print(f"load average start {meta['loadavg_start']}, end {meta.get('loadavg_end')}")
    return 0


def git_commit() -> str:
    """HEAD, with "+changes" when src/ differs from it (the code measured is the tree's)."""
    import subprocess

    def git(*cmd: str) -> str:
        out = subprocess.run(["git", *cmd], cwd=HERE.parent, capture_output=True, text=True)
        return out.stdout.strip()

    dirty = "+changes" if git("status", "--short", "src") else ""
    return git("rev-parse", "--short", "HEAD") + dirty


def versions() -> dict[str, str]:
    from importlib import metadata

    names = ["latchkey", "redis", "psycopg", "PyMySQL", "pymemcache", "python-redis-lock",
             "pottery", "sherlock", "tooz", "pals", "SQLAlchemy", "psycopg2-binary", "filelock",
             "portalocker", "pylibmc", "httpx", "kazoo", "etcd3gw"]  # fmt: skip
    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


# -- main -----------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--stores", default=",".join(FAMILIES),
                    help="families: " + ",".join(FAMILIES + CONSENSUS))  # fmt: skip
    ap.add_argument("--scenarios", default="A,B,C,D,claim")
    ap.add_argument("--peers", action="store_true", help="also measure the peer libraries")
    ap.add_argument("--only", default="", help="comma-separated subject keys (e.g. redis/latchkey)")
    ap.add_argument("--quick", action="store_true", help="short runs, one round (a smoke test)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds of A and B (default 5)")
    ap.add_argument("--d-rounds", type=int, default=3, help="rounds of D and claim (default 3)")
    ap.add_argument("--c-rounds", type=int, default=1, help="rounds of C (10 s each; default 1)")
    ap.add_argument("--out", default=None, help="write every raw result to this JSON file")
    ap.add_argument("--roundtrips", action="store_true", help="count server commands per pair")
    ap.add_argument("--report", default=None, help="print the tables of a saved --out JSON")
    args = ap.parse_args()
    if args.report:
        return report(Path(args.report))

    families = [f.strip() for f in args.stores.split(",") if f.strip()]
    unknown = [f for f in families if f not in FAMILIES + CONSENSUS]
    if unknown:
        ap.error(f"unknown store family {unknown}; choose from {FAMILIES + CONSENSUS}")
    wanted = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    quick = args.quick
    cfg = {
        "a_seconds": 1.0 if quick else 2.0, "a_max": 20_000,
        "b_reps": 8 if quick else 20, "b_seconds": 20 if quick else 60,
        "pair_slices": 6 if quick else 16, "pair_seconds": 0.3 if quick else 0.5,
        "c_seconds": 3.0 if quick else 10.0, "d_budget": 20.0 if quick else 30.0,
    }  # fmt: skip
    rounds = args.rounds or (1 if quick else 5)
    d_rounds = 1 if quick else args.d_rounds
    specs = selected(families, args.peers)
    if args.only:
        only = set(args.only.split(","))
        specs = [s for s in specs if s.key in only]

    workdir = Path(tempfile.mkdtemp(prefix="latchkey-bench-"))
    os.chmod(workdir, 0o755)
    print(f"starting servers for {families} in {workdir} …", flush=True)
    env, running = servers.start(families, workdir)
    meta: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "machine": platform.platform(),
        "cpus": os.cpu_count(), "python": platform.python_version(), "argv": sys.argv[1:],
        "rounds": rounds, "d_rounds": d_rounds, "c_rounds": args.c_rounds, "cfg": cfg,
        "loadavg_start": os.getloadavg(),
        "servers": {k: v for k, v in env.items() if k != "tmp"},
        "peers_missing": peers.MISSING, "commit": git_commit(),
        "versions": versions(),
    }  # fmt: skip
    raw: dict[str, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    alternating: dict[str, Any] = {}
    try:
        if args.roundtrips:
            pg = next((s for s in running if "postgresql" in s.url), None)
            if pg is not None:
                servers.enable_pg_stat_statements(pg)
            result = roundtrips(specs, env)
            print(json.dumps(result, indent=1))
            if args.out:
                Path(args.out).write_text(
                    json.dumps({"meta": meta, "roundtrips": result}, indent=1)
                )
            return 0
        if "A" in wanted:
            alternating = run_paired(env, cfg, specs)
        plan = [(sc, r) for r in range(rounds) for sc in wanted if sc in ("A", "B")]
        plan += [(sc, r) for r in range(d_rounds) for sc in wanted if sc in ("D", "claim")]
        plan += [("C", r) for r in range(args.c_rounds) if "C" in wanted]
        for scenario, r in plan:
            order = specs[r % len(specs) :] + specs[: r % len(specs)] if specs else []  # rotate
            for spec in order:
                if scenario not in spec.scenarios:
                    continue
                tag = f"{spec.key.replace('/', '.')}.{r}.{os.getpid()}"
                t0 = time.monotonic()
                result = measure(spec, scenario, env, cfg, tag) | {"round": r}
                raw[spec.key][scenario].append(result)
                brief = result.get("error") or {
                    k: (round(v, 3) if isinstance(v, float) else v)
                    for k, v in result.items() if k != "samples"
                }  # fmt: skip
                took = time.monotonic() - t0
                print(f"[{scenario} round {r + 1}] {spec.key}: {brief} ({took:.1f} s)", flush=True)
    finally:
        servers.stop(running)
    meta["loadavg_end"] = os.getloadavg()
    summaries = {k: {sc: summarise(v, sc) for sc, v in byscen.items()} for k, byscen in raw.items()}
    for why in peers.MISSING.values():
        if args.peers:
            print(f"skipped: {why}")
    print(table(summaries, specs, wanted))
    tgt = targets(summaries, raw, alternating)
    print(target_table(tgt))
    spread = {k: (s["A"]["max"] - s["A"]["min"]) / s["A"]["value"]
              for k, s in summaries.items() if "A" in s and "value" in s["A"]}  # fmt: skip
    if spread:
        worst = max(spread, key=spread.__getitem__)
        print(f"\nA spread across rounds (max-min)/median: median "
              f"{statistics.median(spread.values()):.0%}, worst {spread[worst]:.0%} ({worst})")
    print(f"load average start {meta['loadavg_start']}, end {meta['loadavg_end']}")
    if args.out:
        Path(args.out).write_text(json.dumps(
            {"meta": meta, "raw": raw, "summaries": summaries, "targets": tgt,
             "a_alternating": alternating, "a_spread": spread},
            indent=1, default=str))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
