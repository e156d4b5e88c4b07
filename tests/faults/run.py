"""A chaos run: real server, a proxy in front of it, worker processes, faults, the checker.

``run(store, seconds=…)`` starts a disposable server for ``store`` (tests/servers; SQLite
needs none), a :class:`~tests.faults.proxy.Proxy` in front of it, the recorder, and
``workers`` processes (tests/faults/worker.py, some with their wall clock offset), then
injects faults one after another until ``seconds`` have passed, waits for the workers, reads
the final record values and runs the checker. Faults (each held for a second or two, then
healed):

- network, through the proxy: ``latency`` (+50 ms each way), ``blackhole`` (nothing
  forwarded, nothing reset), ``reset`` (every connection reset at once);
- server: ``freeze`` (SIGSTOP … SIGCONT), ``restart`` (SIGTERM, start again on the same
  data), ``kill`` (SIGKILL, start again);
- client: ``worker-stop`` (SIGSTOP a worker past its leases' TTL, then SIGCONT),
  ``worker-kill`` (SIGKILL a worker, start a new one in its place);
- ``failover`` (Redis Sentinel and Redis Cluster, started with a replica per master): the
  master moves to its replica — ``kill`` (SIGKILL the master; the sentinel or the cluster
  promotes the replica; the old master is started again, empty, as the new one's replica)
  or ``command`` (``SENTINEL FAILOVER``) — held until the old master replicates from the
  new one. Replication is asynchronous, so the checker treats it as a loss window
  (``losses``: leases granted before it closes may be lost, record updates that overlap it
  are unknown).
- ``failover`` on etcd and ZooKeeper, with ``failover=True`` (``scripts/chaos --failover``):
  a 3-member cluster / 3-server ensemble (tests/servers/quorum.py) whose leader is
  SIGKILLed, held until another member leads and the killed one, started again on its data,
  serves again. Not a loss window: a grant is acknowledged once a majority has it, so a
  lease lost, a token repeated or an update lost there is a violation like any other. And
  ``freeze-leader``: the leader alone SIGSTOPped, then SIGCONTed. ``freeze``, ``restart``
  and ``kill`` act on every member at once.
- ``failover`` on PostgreSQL and MariaDB, with ``failover=True`` (``scripts/chaos --failover``;
  tests/servers/pairs.py): a primary and a synchronous replica (PostgreSQL
  ``synchronous_standby_names`` + ``remote_apply``, MariaDB semi-synchronous ``AFTER_SYNC``),
  the URL naming both (``postgresql://h1,h2/…?target_session_attrs=read-write``,
  ``mysql://h1,h2/…``); the fault SIGKILLs the primary, promotes the replica and builds a new
  replica from it on the dead primary's port, held until that replica is synchronous. Not a
  loss window: a lease granted before the failover must outlive it. ``postgresql+advisory``
  runs on the pair too, its locks cut by a failover as by a kill (they live in the dead
  primary's sessions); ``mysql+getlock`` does not (its URL takes one host).

Which faults reach which store: the network faults go through the proxy in front of the
URL's address (a proxy per host for a pair), so they apply only to stores whose clients talk
to those addresses. A Sentinel client asks the sentinel for the master's address and
connects there; a Cluster client reads the nodes' addresses from the node it was given: the
proxy would cut their discovery only, never a lease's request, so those two run without it
(server, failover and client faults).
An etcd or ZooKeeper cluster's URL names every member, and its client moves to another when
one fails: a proxy in front of one member would cut a third of the cluster, so those runs
have no proxy either.

Command line (scripts/chaos): ``python -m tests.faults.run --store redis --minutes 10``;
``--failover`` for etcd's cluster, ZooKeeper's ensemble, the PostgreSQL and MariaDB pairs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pickle
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import latchkey
from latchkey.stores.io.psycopg import MARGIN as PG_WATCHDOG_MARGIN
from tests import servers
from tests.faults.checker import Report, check
from tests.faults.history import Recorder
from tests.faults.proxy import Proxies
from tests.servers import etcd, mariadb, postgresql, redis_cluster, redis_sentinel, zookeeper
from tests.servers.quorum import Quorum

ROOT = Path(__file__).resolve().parents[2]
SERVER_OF = {
    "sqlite": None, "postgresql": "postgresql", "postgresql+advisory": "postgresql",
    "mysql": "mysql", "mysql+getlock": "mysql", "redis": "redis", "memcached": "memcached",
    "mongodb": "mongodb", "etcd": "etcd", "zookeeper": "zookeeper",
    "redis+sentinel": "redis_sentinel", "redis+cluster": "redis_cluster",
}  # fmt: skip


class Failovers(NamedTuple):
    """How a setup with failovers is started for a chaos run, and how it fails over."""

    start: Callable[[Path], Any]
    ways: tuple[str, ...]  # how a ``failover`` fault may move the leader, master or primary
    #: A failover may lose the latest writes (asynchronous replication): a loss window for
    #: the checker (``losses``). False: it must lose nothing.
    loses: bool
    #: Used only when a run asks for failovers (``failover=True``): the store's own chaos
    #: run is on one server, behind the proxy.
    on_request: bool = False


#: The setups with failovers (a replica per master; a three-member quorum; a primary and a
#: synchronous replica, tests/servers/pairs.py).
FAILOVERS: dict[str, Failovers] = {
    "redis_sentinel": Failovers(redis_sentinel.start_setup, ("kill", "command"), loses=True),
    "redis_cluster": Failovers(
        lambda d: redis_cluster.start_cluster(d, replicas=1), ("kill",), loses=True
    ),
    "etcd": Failovers(etcd.start_quorum, ("kill",), loses=False, on_request=True),
    "zookeeper": Failovers(zookeeper.start_quorum, ("kill",), loses=False, on_request=True),
    "postgresql": Failovers(postgresql.start_pair, ("kill",), loses=False, on_request=True),
    "mysql": Failovers(mariadb.start_pair, ("kill",), loses=False, on_request=True),
}
#: How long past the store's timeout one call may run by its driver's design: PostgreSQL's
#: server ends a statement at the timeout (``statement_timeout``) but not everything a call
#: waits for — a frozen server, or a commit waiting for a synchronous standby, which
#: PostgreSQL never times out — and those end by latchkey's watchdog a second later
#: (docs/reliability.md, "A frozen server").
PAST_TIMEOUT = {"postgresql": PG_WATCHDOG_MARGIN}
#: Stores whose server has a failover setup they cannot use, and why.
NO_FAILOVER = {"mysql+getlock": "GET_LOCK's locks live in one server: its URL takes one host"}
NETWORK = ("latency", "blackhole", "reset")
#: Servers whose restart takes longer than a short run (mongod under qemu: ~25 s): the short
#: runs freeze them but do not restart them; ``scripts/chaos --restarts`` does.
SLOW_RESTART = ("mongodb",)
SERVER = ("freeze", "restart", "kill")
#: A server restarted by a fault has run at least this long (s): memcached's fencing tokens
#: count from its start time in whole seconds, documented to rise across restarts at least a
#: second apart (docs/stores/memcached.md); back-to-back restart and kill faults made two starts
#: within one second and, once, duplicate tokens.
MIN_LIFE = 1.1
CLIENT = ("worker-stop", "worker-kill")
#: Seconds past its TTL that a store may keep a dead holder's lease, beyond the 2 s every store
#: gets: memcached drops items by its whole-second clock, at an absolute time counted from an
#: upper bound of that clock (2 to 5 s after the TTL: docs/stores/memcached.md).
EXPIRY_TAIL = {"memcached": 3.0}
#: Stores whose leases also end when their holder closes its store: ZooKeeper's close ends
#: the session, and the server deletes its ephemeral nodes at once. A worker abandons a lease
#: now and then, and closes its store when the run ends: the next grant may follow at once.
CLOSES_END = ("zookeeper",)


@dataclass
class Outcome:
    store: str
    seconds: float
    report: Report
    timeout: float
    ttl: float
    history: Any = None

    def summary(self) -> dict[str, Any]:
        return {"store": self.store, "seconds": round(self.seconds, 1), "timeout_s": self.timeout,
                "ttl_s": self.ttl, **self.report.summary()}  # fmt: skip


def run(
    store: str,
    seconds: float = 20.0,
    *,
    workers: int = 4,
    faults: tuple[str, ...] | None = None,
    variant: str | None = None,
    seed: int | None = None,
    ttl: float = 1.0,
    timeout: float = 2.0,
    clock_offsets: tuple[float, ...] = (0.0, 3.0, -3.0),
    workdir: Path | None = None,
    slow_restarts: bool = False,
    failovers: tuple[str, ...] | None = None,
    failover: bool = False,
) -> Outcome:
    """``failovers``: how a ``failover`` fault moves the master (see FAILOVERS; None: every
    way the setup knows, chosen at random each time). ``failover``: run the store on its
    setup with failovers asked for (FAILOVERS, ``on_request``: etcd or ZooKeeper on a
    three-member cluster whose leader fails over; PostgreSQL or MariaDB on a primary and a
    synchronous replica)."""
    rng = random.Random(seed)
    kind = SERVER_OF[store]
    setup = FAILOVERS.get(kind or "")
    if failover and (setup is None or store in NO_FAILOVER):
        why = NO_FAILOVER.get(store, "no setup with failovers (see FAILOVERS)")
        raise ValueError(f"{store}: {why}")
    if setup is not None and setup.on_request and not failover:
        setup = None
    tmp = Path(workdir or tempfile.mkdtemp(prefix="latchkey-chaos-"))
    server = None
    proxy = None
    if kind is None:
        url = f"sqlite:///{tmp}/chaos.db?timeout={timeout}s"
        allowed: tuple[str, ...] = CLIENT
    else:
        servers.load_all()
        given = os.environ.get(servers.SERVERS[kind].env_var)
        if given and setup is None:  # an existing server: the network and clients are broken,
            base_url = given  # never the server
        else:
            server = (setup.start if setup else servers.SERVERS[kind].start)(tmp / kind)
            base_url = server.url
        base = servers.replace_scheme(base_url, store) if store != kind else base_url
        url = servers.with_query(base, timeout=f"{timeout}s")
        allowed = CLIENT
        discovers = any(row.id == store and row.discovers for row in servers.ROWS)
        if not discovers and not isinstance(server, Quorum):
            hosts = urlsplit(base).netloc.rsplit("@", 1)[-1]  # h:p, or h1:p1,h2:p2 for a pair
            targets = [(h, int(p)) for h, _, p in (hp.rpartition(":") for hp in hosts.split(","))]
            proxy = Proxies(targets)
            fronts = ",".join(f"127.0.0.1:{p.port}" for p in proxy.proxies)
            url = url.replace(hosts, fronts, 1)
            allowed += NETWORK
        if server is not None:
            restarts = server.restart_cmd is not None and (
                slow_restarts or kind not in SLOW_RESTART
            )
            allowed += SERVER if restarts else ("freeze",)
            if setup is not None:
                allowed += ("failover",)
                ways = setup.ways
                server.extra["failovers"] = tuple(
                    w for w in ways if failovers is None or w in failovers
                ) or ways[:1]
            if isinstance(server, Quorum):
                allowed += ("freeze-leader",)
    if faults is not None:
        allowed = tuple(f for f in allowed if f in faults)
    caps = latchkey.connect(url).capabilities
    names = [f"hot-{i}" for i in range(2)]
    semaphore = "pool"
    record = "counter"
    recorder = Recorder()
    procs: dict[int, subprocess.Popen[bytes]] = {}

    def spawn(worker: int, run_for: float) -> None:
        config = {
            "url": url, "worker": worker, "recorder": recorder.address, "seed": rng.random(),
            "names": names, "semaphore": semaphore, "record": record, "ttl": ttl, "limit": 2,
            "seconds": run_for, "variant": variant, "stop": str(tmp / "stop"),
            "clock_offset": clock_offsets[worker % len(clock_offsets)],
        }  # fmt: skip
        env = {**os.environ, "PYTHONPATH": f"{ROOT}/src{os.pathsep}{ROOT}"}
        procs[worker] = subprocess.Popen(
            [sys.executable, "-m", "tests.faults.worker", json.dumps(config)], cwd=ROOT, env=env
        )

    started = time.monotonic()
    end = started + seconds
    try:
        for w in range(workers):
            spawn(w, seconds + 60)  # they stop when the file "stop" appears
        next_worker = workers
        warm = time.monotonic() + 30  # faults start once the workers work (first grant)
        while (
            time.monotonic() < warm
            and not recorder.holders()
            and not any(
                isinstance(op.result, tuple) and op.result[:1] == ("granted",)
                for op in list(recorder.history.ops)
            )
        ):
            time.sleep(0.05)
        end = max(end, time.monotonic() + seconds * 0.8)
        schedule: list[str] = []
        while time.monotonic() < end - 2 and allowed:
            if not schedule:  # every kind once per round, in a random order
                schedule = rng.sample(allowed, len(allowed))
            fault = schedule.pop()
            _inject(fault, rng, recorder, proxy, server, procs, ttl, names)
            if fault == "worker-kill":
                spawn(next_worker, seconds + 60)
                next_worker += 1
            time.sleep(rng.uniform(0.5, 1.5))
        while time.monotonic() < end:
            time.sleep(0.05)
        (tmp / "stop").touch()
        for proc in procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        values = {}
        if caps.records:
            with latchkey.connect(url) as reader:
                values[record] = int(reader.record(record).get()[0] or 0)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
        if proxy is not None:
            proxy.close()
        if server is not None:
            _resume(server)
            server.stop()
        recorder.close()
    report = check(
        recorder.history,
        timeout=timeout,
        semaphores={semaphore: 2},
        records=[record] if caps.records else [],
        record_values=values,
        fencing=caps.fencing,
        heal_bound=2 * timeout + ttl + 4.0,
        kill_bound=timeout + 2.0 + EXPIRY_TAIL.get(store, 0.0),
        cuts=_cuts(caps),
        records_cut=not caps.durable,
        losses=("failover",) if setup is not None and setup.loses else (),
        ttl_bounded=caps.ttl,
        closes_end=store in CLOSES_END,
        call_bound=timeout + PAST_TIMEOUT.get(kind or "", 0.0),
    )
    return Outcome(store, time.monotonic() - started, report, timeout, ttl, recorder.history)


def _inject(
    fault: str,
    rng: random.Random,
    recorder: Recorder,
    proxy: Proxies | None,
    server: servers.RunningServer | None,
    procs: dict[int, subprocess.Popen[bytes]],
    ttl: float,
    names: list[str],
) -> None:
    hold = rng.uniform(1.0, 2.0)
    live = [w for w, p in procs.items() if p.poll() is None]
    if fault.startswith("worker") and not live:
        return
    started = None if server is None else server.extra.get("chaos_started")
    if fault in ("restart", "kill") and isinstance(started, float):  # see MIN_LIFE
        # Before the fault is recorded: the checker ends the leases a restart loses at the
        # fault's start, so nothing may be granted between that and the restart itself.
        time.sleep(max(0.0, started + MIN_LIFE - time.monotonic()))
    if fault == "failover" and server is not None:
        # Before the fault is recorded, as above: the replica known and in sync (the
        # sentinel learns of a restarted one from the master's INFO, within ~10 s).
        ready = time.monotonic() + 60
        while not server.replica_ready() and time.monotonic() < ready:  # type: ignore[attr-defined]
            time.sleep(0.05)
    record = recorder.fault(fault)
    if fault == "failover" and server is not None:
        how = rng.choice(server.extra["failovers"])  # type: ignore[arg-type]
        record.detail = str(how)
        key = "{" + rng.choice(names).encode().hex() + "}"  # the slot of a hot name
        if isinstance(server, redis_cluster.RunningCluster):
            server.failover(how, key)
        else:
            server.failover(how)  # type: ignore[attr-defined]
    elif fault == "latency" and proxy is not None:
        proxy.set("pass", latency=0.05)
        time.sleep(hold)
        proxy.heal()
    elif fault == "blackhole" and proxy is not None:
        proxy.set("blackhole")
        time.sleep(hold)
        proxy.reset()  # the clients' timeouts closed their ends; drop the stuck pumps too
        proxy.heal()
    elif fault == "reset" and proxy is not None:
        proxy.reset()
    elif fault == "freeze-leader" and isinstance(server, Quorum):
        with server.freeze_leader() as leader:
            record.detail = f"member {leader.port}"
            time.sleep(hold)
    elif fault == "freeze" and server is not None:
        with server.frozen():  # the server and its children: PostgreSQL's sessions too
            time.sleep(hold)
        settle = getattr(server, "settle", None)
        if settle is not None and settle():
            # Thawed, the sentinel found the master silent past its down-after time and
            # failed over by itself (a split brain until the old master is turned into a
            # replica): a failover as far as the checker is concerned.
            record.detail = "failed over when thawed"
            extra = recorder.fault("failover", detail="by the setup itself, after a freeze")
            extra.start = record.start
            recorder.healed(extra)
    elif fault in ("restart", "kill") and server is not None:
        if fault == "kill":  # the server and its children, as when its machine dies
            server.crash()
        else:
            server.stop()
        server.start()
        server.extra["chaos_started"] = time.monotonic()
    elif fault == "worker-stop":
        holders = [w for w in live if w in recorder.holders()]
        victim = rng.choice(holders or live)  # a holder if there is one: the telling case
        record.detail = f"worker {victim}"
        procs[victim].send_signal(signal.SIGSTOP)
        time.sleep(ttl * 2)
        procs[victim].send_signal(signal.SIGCONT)
    elif fault == "worker-kill":
        holders = [w for w in live if w in recorder.holders()]
        victim = rng.choice(holders or live)
        record.detail = f"worker {victim}"
        recorder.killed(victim)
        procs[victim].kill()
        procs[victim].wait()
    recorder.healed(record)


def _cuts(caps: Any) -> tuple[str, ...]:
    """The faults that end every lease at once on this store (see checker.check)."""
    if caps.session_tied:  # a lock lives as long as its connection (a failover kills it)
        return ("reset", "blackhole", "freeze", "restart", "kill", "failover")
    if not caps.durable:  # a restart forgets every lease
        return ("restart", "kill")
    return ()


def _resume(server: servers.RunningServer) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(server.pid, signal.SIGCONT)


def main() -> None:
    parser = argparse.ArgumentParser(description="A latchkey chaos run against a real server.")
    parser.add_argument("--store", required=True, choices=sorted(SERVER_OF))
    parser.add_argument("--minutes", type=float, default=1.0)
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--history", metavar="FILE",
        help="keep the run's history (a pickle of tests.faults.history.History) for a look",
    )
    parser.add_argument(
        "--failover", action="store_true",
        help="etcd, zookeeper: a three-member cluster whose leader is killed; postgresql, "
        "postgresql+advisory, mysql: a primary and a synchronous replica (URL h1,h2), failed "
        "over (SIGKILL the primary, promote the replica, build a new one). A failover must "
        f"lose nothing. Not {', '.join(NO_FAILOVER)} (one host)",
    )
    parser.add_argument(
        "--restarts", action="store_true",
        help=f"restart and kill the slow servers too ({', '.join(SLOW_RESTART)})",
    )
    args = parser.parse_args()
    try:
        outcome = run(
            args.store,
            args.minutes * 60,
            workers=args.workers,
            seed=args.seed,
            slow_restarts=args.restarts,
            failover=args.failover,
        )
    except ValueError as exc:
        parser.error(str(exc))
    summary = outcome.summary()
    if args.history:
        with open(args.history, "wb") as out:
            pickle.dump(outcome.history, out)
    if args.json:
        print(json.dumps(summary))
    else:
        for key, value in summary.items():
            print(f"{key:22} {value}")
    for violation in outcome.report.violations[:50]:
        print(f"VIOLATION {violation}", file=sys.stderr)
    sys.exit(1 if outcome.report.violations else 0)


if __name__ == "__main__":
    main()
