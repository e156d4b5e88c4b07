"""A consensus cluster — etcd's members, a ZooKeeper ensemble — as one server for the chaos
run (tests/faults/run.py), with a leader to fail over.

:class:`Quorum` stands for all its members: ``url`` names every one (the client follows the
leader), ``stop``/``start``/``frozen``/``processes`` act on all of them (a start launches
every member at once, since none serves before a quorum is up), and :meth:`Quorum.failover`
SIGKILLs the member that leads, waits for the others to elect a new leader, and starts the
killed one again on its data, until it serves in the quorum again — so that the next
failover has a quorum left when it kills. :meth:`Quorum.freeze_leader` stalls the leader
alone (SIGSTOP … SIGCONT).

Neither store may lose anything in a leader failover (a grant is acknowledged once a majority
has it in its log): the chaos run does not treat these failovers as loss windows.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from tests.servers import RunningServer, ServerUnavailable, wait_gone, wait_port_closed

#: How long a killed leader's successor, or a restarted member, may take (s).
PATIENCE = 60.0


class Quorum(RunningServer):
    """``extra``: ``members`` (each member's RunningServer, its ``restart_cmd`` taking
    ``wait``), ``leader_of`` (members -> the one that leads, or ServerUnavailable),
    ``ready`` (port -> whether that member serves as part of a quorum)."""

    def members(self) -> list[RunningServer]:
        return self.extra["members"]  # type: ignore[return-value]

    def leader(self) -> RunningServer:
        """The member that leads now (ServerUnavailable if none says so)."""
        return self.extra["leader_of"](self.members())  # type: ignore[operator,no-any-return]

    def _ready(self, member: RunningServer) -> bool:
        return bool(self.extra["ready"](member.port))  # type: ignore[operator]

    def stop(self) -> None:
        for member in self.members():
            with contextlib.suppress(ProcessLookupError):
                os.kill(member.pid, member.stop_signal)
        for member in self.members():
            wait_port_closed(member.port)
            wait_gone([member.pid])

    def kill(self) -> None:
        """SIGKILL every member (a test's cleanup: etcd members told to stop take ~5 s)."""
        for member in self.members():
            with contextlib.suppress(ProcessLookupError):
                os.kill(member.pid, signal.SIGKILL)
        for member in self.members():
            wait_port_closed(member.port)
            wait_gone([member.pid])

    def crash(self) -> None:
        """The chaos run's ``kill``: every member at once, as when their machines die (each
        member's port closed, not just the first's)."""
        self.kill()

    def start(self) -> None:
        """Start every member again on its data (all at once: none serves alone), and wait
        until each serves."""
        for member in self.members():
            member.pid = member.restart_cmd(wait=False)  # type: ignore[call-arg,misc]
        self._until(lambda: all(self._ready(m) for m in self.members()), "every member serves")
        self.pid = self.members()[0].pid

    def processes(self) -> list[int]:
        return [member.pid for member in self.members()]

    def replica_ready(self) -> bool:
        """Every member serves and one leads: a failover leaves a quorum."""
        if not all(self._ready(m) for m in self.members()):
            return False
        try:
            self.leader()
        except ServerUnavailable:
            return False
        return True

    def failover(self, how: str = "kill") -> None:
        """``kill``: SIGKILL the leader, as when its machine dies; returns once another
        member leads and the killed one, started again on its data, serves as a member. Call
        when :meth:`replica_ready`."""
        if how != "kill":
            raise ValueError(f"failover how? {how!r}")
        old = self.leader()
        with contextlib.suppress(ProcessLookupError):
            os.kill(old.pid, signal.SIGKILL)
        wait_port_closed(old.port)
        wait_gone([old.pid])
        others = [m for m in self.members() if m is not old]

        def elected() -> bool:
            try:
                return self.extra["leader_of"](others) is not None  # type: ignore[operator]
            except ServerUnavailable:
                return False

        self._until(elected, "the other members elect a leader")
        old.pid = old.restart_cmd(wait=False)  # type: ignore[call-arg,misc]
        self._until(lambda: self._ready(old), "the killed leader serves again as a member")
        self.pid = self.members()[0].pid

    @contextlib.contextmanager
    def freeze_leader(self) -> Iterator[RunningServer]:
        """SIGSTOP the leader alone, SIGCONT it on exit: a stalled machine in the quorum (the
        others elect a new leader if it stays stalled past their election timeout)."""
        leader = self.leader()
        single = RunningServer(leader.url, leader.pid, leader.port, leader.workdir)
        with single.frozen():
            yield leader

    def _until(self, ok: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + PATIENCE
        while not ok():
            if time.monotonic() > deadline:
                raise ServerUnavailable(f"{what}: not within {PATIENCE}s (see {self.workdir})")
            time.sleep(0.02)


def quorum(
    workdir: Path,
    scheme: str,
    members: list[RunningServer],
    leader_of: Callable[[list[RunningServer]], RunningServer],
    ready: Callable[[int], bool],
    path: str = "",
) -> Quorum:
    """The Quorum of ``members`` (already started and serving); its URL names them all."""
    hosts = ",".join(f"127.0.0.1:{m.port}" for m in members)
    first = members[0]
    return Quorum(
        url=f"{scheme}://{hosts}{path}", pid=first.pid, port=first.port, workdir=workdir,
        restart_cmd=lambda: first.pid,  # restartable (start() above restarts every member)
        extra={"members": members, "leader_of": leader_of, "ready": ready},
    )  # fmt: skip
