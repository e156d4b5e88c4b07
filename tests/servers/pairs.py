"""A primary and a synchronous replica, failed over again and again: the chaos run's
PostgreSQL and MariaDB setups with failovers (tests/faults/run.py, ``--failover``).

The pair's URL names both servers (``postgresql://…@h:A,h:B/db?target_session_attrs=
read-write``, ``mysql://…@h:A,h:B/db``), and the URL is fixed for a run, so the two ports stay
the pair's for its life: a failover SIGKILLs the primary, promotes the replica (now the
primary, on its port), then builds a new replica from it on the dead primary's port. Which
server is the primary alternates between the two ports; latchkey finds it by itself.

Replication is synchronous (PostgreSQL: ``synchronous_standby_names`` and ``remote_apply``;
MariaDB: semi-synchronous ``AFTER_SYNC`` with a timeout too long ever to fall back), and stays
so while the pair has no replica: between a promotion and the new replica's first
acknowledgement, commits on the new primary wait. So every acknowledged write is on both
servers whenever a failover may happen (``replica_ready``), and a failover loses nothing.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

from tests.servers import RunningServer, ServerUnavailable


def until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Wait until ``condition()``; ServerUnavailable naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise ServerUnavailable(f"{what}: not after {timeout}s")
        time.sleep(0.02)


class ReplicatedPair(RunningServer):
    """The primary stands for the server (``pid``, ``port``); ``extra["primary"]`` and
    ``extra["replica"]`` are the two servers as they now are. ``stop``, ``start``, ``crash``
    and ``frozen`` act on both. A subclass says how its store promotes a replica
    (:meth:`promote`), builds one (:meth:`replica_of`) and tells that it is in sync
    (:meth:`replica_ready`)."""

    @property
    def primary(self) -> RunningServer:
        return self.extra["primary"]  # type: ignore[return-value]

    @property
    def replica(self) -> RunningServer:
        return self.extra["replica"]  # type: ignore[return-value]

    def stop(self) -> None:
        for server in (self.primary, self.replica):
            server.stop()

    def start(self) -> None:
        """Start both again on their data, the primary first (its commits wait for the
        replica until it is back)."""
        for server in (self.primary, self.replica):
            server.start()
        self.pid = self.primary.pid

    def crash(self) -> None:
        for server in (self.primary, self.replica):
            server.crash()

    def processes(self) -> list[int]:
        return [*self.primary.processes(), *self.replica.processes()]

    def replica_ready(self) -> bool:
        """The replica acknowledges the primary's commits (a failover loses nothing)."""
        raise NotImplementedError

    def promote(self, replica: RunningServer) -> None:
        """Make ``replica`` a primary that replicates synchronously to its next replica."""
        raise NotImplementedError

    def replica_of(self, primary: RunningServer, workdir: Path, port: int) -> RunningServer:
        """A new synchronous replica of ``primary`` in ``workdir``, listening on ``port``."""
        raise NotImplementedError

    def failover(self, how: str) -> None:
        """``kill``: SIGKILL the primary (and its children), promote the replica, then build
        a new replica from it on the dead primary's port; returns once that replica
        acknowledges the new primary's commits. Call when :meth:`replica_ready`."""
        if how != "kill":
            raise ValueError(f"failover how? {how!r}")
        old, new = self.primary, self.replica
        old.crash()
        self.promote(new)
        generation = int(self.extra.get("generation", 1)) + 1  # type: ignore[call-overload]
        fresh = self.replica_of(new, self.workdir / f"gen{generation}", old.port)
        self.extra.update(primary=new, replica=fresh, generation=generation)
        self.pid, self.port = new.pid, new.port
        until(self.replica_ready, 60, "the new replica synchronous")
        for gone in (old.workdir, old.extra.get("sockets")):  # the dead primary's: not needed
            if gone:
                shutil.rmtree(str(gone), ignore_errors=True)
