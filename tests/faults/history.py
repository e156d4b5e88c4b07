"""The recorder: one thread in the test process that every worker reports to, and the
protected resource.

Workers talk to it over a Unix socket (``multiprocessing.connection``), synchronously: each
message is answered before the worker goes on, and every time in the history is the
recorder's own monotonic clock when a message arrived. So an operation's recorded
invocation is no later than its real start, and its recorded return no earlier than its real
end: the intervals the checker reads are wide enough to be true whatever the workers' clocks
say (some workers run with their wall clock offset on purpose).

The resource is a register per name that accepts a write only with a fencing token at least
the highest it has seen, and records whether the write continued the chain of accepted
values (its ``prev`` is the value the writer read under its lock).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Listener
from typing import Any


@dataclass
class Op:
    """One call a worker made through latchkey's public API."""

    id: int
    worker: int
    kind: str  # acquire, release, extend, update, read_record, stale_release, stale_extend
    name: str
    args: dict[str, Any]
    inv: float
    ret: float | None = None  # None: the worker died or was stopped before it returned
    result: Any = None  # kind-specific; ("error", type name, text) for an exception


@dataclass
class Step:
    """A holder about to act on its lease: recorded *before* it calls ``lock.check()``, so
    ``at`` is a lower bound of the check. ``ok``: the check passed and it acted."""

    worker: int
    name: str
    token: int | None
    at: float
    lid: str = ""
    ok: bool = False


@dataclass
class Write:
    worker: int
    name: str
    token: int
    prev: int
    new: int
    at: float
    accepted: bool
    chained: bool  # prev was the register's value when the write arrived
    lid: str = ""  # the writer's lease (its Lock object)


@dataclass
class Fault:
    kind: str
    start: float
    end: float | None = None
    detail: str = ""


@dataclass
class History:
    ops: list[Op] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    writes: list[Write] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    kills: list[tuple[int, float]] = field(default_factory=list)  # (worker, when SIGKILLed)
    exits: list[tuple[int, float]] = field(default_factory=list)  # (worker, when it closed)


class Recorder:
    def __init__(self) -> None:
        self.history = History()
        self._dir = tempfile.mkdtemp(prefix="latchkey-chaos-")
        self.address = os.path.join(self._dir, "recorder.sock")
        self._listener = Listener(self.address, family="AF_UNIX")
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._ops: dict[int, Op] = {}
        self._steps: dict[tuple[int, str], Step] = {}
        self.register: dict[str, int] = {}
        #: (worker, name, token) of the leases workers hold now, as far as their reports say.
        self.holding: set[tuple[int, str, Any]] = set()
        self._highest: dict[str, int] = {}
        self._closed = False
        threading.Thread(target=self._accept, name="recorder", daemon=True).start()

    def now(self) -> float:
        return time.monotonic()

    def fault(self, kind: str, detail: str = "") -> Fault:
        fault = Fault(kind, self.now(), detail=detail)
        with self._lock:
            self.history.faults.append(fault)
        return fault

    def healed(self, fault: Fault) -> None:
        fault.end = self.now()

    def holders(self) -> set[int]:
        with self._lock:
            return {worker for worker, _, _ in self.holding}

    def killed(self, worker: int) -> None:
        with self._lock:
            self.history.kills.append((worker, self.now()))

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()
        with contextlib.suppress(OSError):
            os.unlink(self.address)
        with contextlib.suppress(OSError):
            os.rmdir(self._dir)

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        with contextlib.suppress(EOFError, OSError):
            while True:
                message = conn.recv()
                conn.send(self._handle(message))

    def _handle(self, message: tuple[Any, ...]) -> Any:
        at = self.now()
        kind = message[0]
        with self._lock:
            if kind == "inv":
                _, worker, op_kind, name, args = message
                op = Op(next(self._ids), worker, op_kind, name, args, at)
                if op_kind in ("release", "stale_release"):
                    self.holding.discard((worker, name, args.get("token")))
                self._ops[op.id] = op
                self.history.ops.append(op)
                return op.id
            if kind == "ret":
                _, op_id, result = message
                op = self._ops.pop(op_id)
                op.ret, op.result = at, result
                if op.kind == "acquire" and isinstance(result, tuple) and result[0] == "granted":
                    self.holding.add((op.worker, op.name, result[1]))
                return None
            if kind == "step":
                _, worker, name, token, lid = message
                step = Step(worker, name, token, at, lid)
                self.history.steps.append(step)
                self._steps[(worker, name)] = step
                return None
            if kind == "exit":  # the worker is about to close its store (sessions end)
                self.history.exits.append((message[1], at))
                return None
            if kind == "read":  # the holder passed its check and reads the register
                _, worker, name = message
                self._steps[(worker, name)].ok = True
                return self.register.get(name, 0)
            if kind == "write":
                _, worker, name, token, prev, new, lid = message
                accepted = token >= self._highest.get(name, 0)
                chained = prev == self.register.get(name, 0)
                if accepted:
                    self._highest[name] = token
                    self.register[name] = new
                write = Write(worker, name, token, prev, new, at, accepted, chained, lid)
                self.history.writes.append(write)
                return accepted
        raise AssertionError(f"unknown message {message!r}")
