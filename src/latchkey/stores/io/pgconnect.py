"""Opening a PostgreSQL connection within one deadline, sync and asyncio.

psycopg 3.3's ``connect()`` gives each host of a URL its own ``connect_timeout``, in whole
seconds and at least 2 s: a call with ``timeout=1s`` waited 2 s for one hung host, 4 s for two.
Here latchkey drives libpq's non-blocking connect itself, through psycopg's public low-level
layer (``psycopg.pq``: ``PGconn.connect_start``, ``connect_poll``, the socket to wait on), so
that the whole attempt ends within the timeout:

- the URL's hosts are tried one by one (:func:`attempts`: libpq's ``host``/``hostaddr``/
  ``port`` lists split as libpq and psycopg split them; ``load_balance_hosts=random`` shuffles
  them, ``target_session_attrs=prefer-standby`` tries every host as a standby first), each
  with a fair share of the time left: what is left divided by the attempts left, so a hung
  first host cannot starve a live second one, and one that fails at once leaves its share to
  the next. libpq's own ``connect_timeout`` (ours, or the URL's) caps a host's share;
- a host name is resolved first (as psycopg does: the asyncio flavour on the loop's resolver,
  within the share; the sync one with ``socket.getaddrinfo``, patched under green threads),
  each address an attempt of its own;
- libpq checks ``target_session_attrs`` on each attempt: a host that is not what it asks for
  fails its attempt and the next is tried;
- the error names each host that failed and why (libpq's reason, or the time it had), never
  a password.

:func:`connecting` is the one connect, a generator that yields what it waits for (:class:`Wait`
on the socket, :class:`Resolve` a host name) and is sent the answer; :func:`connect_pgconn`
(select/poll) and ``psycopg_async.aconnect_pgconn`` (the event loop's readers and writers)
drive it. The
drivers wrap the finished ``PGconn`` in a ``psycopg.Connection`` / ``AsyncConnection`` (their
documented constructor). What this cannot bound: a sync host-name lookup (the system's resolver
takes no deadline), and libpq's own blocking steps, if any, between two polls.
"""

from __future__ import annotations

import os
import random
import select
import socket
import time
from collections.abc import Generator, Mapping
from ipaddress import ip_address
from typing import Any, NamedTuple, Union

import psycopg
from psycopg import pq
from psycopg.conninfo import make_conninfo

from latchkey.stores.io.green import patched

__all__ = ["Resolve", "Wait", "addresses", "attempts", "connect_pgconn", "connecting"]

BAD = pq.ConnStatus.BAD
POLL_OK = pq.PollingStatus.OK
POLL_READING = pq.PollingStatus.READING
POLL_WRITING = pq.PollingStatus.WRITING
POLL_FAILED = pq.PollingStatus.FAILED


class Wait(NamedTuple):
    """Wait until ``fd`` is readable (writable if ``write``), at most ``seconds``: answered
    True if it is, False if the time ran out."""

    fd: int
    write: bool
    seconds: float


class Resolve(NamedTuple):
    """Resolve ``host`` (``port`` for getaddrinfo), at most ``seconds``: answered with its
    addresses, or the OSError (TimeoutError) that stopped the lookup."""

    host: str
    port: str
    seconds: float


Request = Union[Wait, Resolve]  # noqa: UP007 - a runtime alias on Python 3.10 too
_ENV: dict[str, str] = {}


def _param(params: Mapping[str, Any], key: str) -> str | None:
    """A connection parameter as libpq would see it: given, else from its environment
    variable (``PGHOST``…; libpq's table, ``PQconndefaults``)."""
    if key in params and params[key] is not None:
        return str(params[key])
    if not _ENV:
        for option in pq.Conninfo.get_defaults():
            if option.envvar:
                _ENV[option.keyword.decode()] = option.envvar.decode()
    envvar = _ENV.get(key)
    return os.environ.get(envvar) if envvar else None


def attempts(params: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The connection attempts for ``params``: one per host (libpq's comma-separated ``host``,
    ``hostaddr`` and ``port``, a single port for every host), in the order libpq would try
    them. psycopg.OperationalError if the lists do not match, as libpq's own message says."""
    base = {key: value for key, value in params.items() if value is not None}
    hosts = (_param(params, "host") or "").split(",")
    addrs = (_param(params, "hostaddr") or "").split(",")
    ports = (_param(params, "port") or "").split(",")
    count = max(len(hosts), len(addrs))
    if hosts != [""] and addrs != [""] and len(hosts) != len(addrs):
        raise psycopg.OperationalError(
            f"could not match {len(hosts)} host names to {len(addrs)} hostaddr values"
        )
    if len(ports) not in (1, count):
        raise psycopg.OperationalError(
            f"could not match {len(ports)} port numbers to {count} hosts"
        )
    if count == 1:
        plan = [base]
    else:
        plan = []
        for i in range(count):
            attempt = dict(base)
            for key, values in (("host", hosts), ("hostaddr", addrs), ("port", ports)):
                value = values[i] if len(values) == count else values[0]
                if value:
                    attempt[key] = value
                else:
                    attempt.pop(key, None)
            plan.append(attempt)
    if _param(params, "load_balance_hosts") == "random":
        random.shuffle(plan)
    if _param(params, "target_session_attrs") == "prefer-standby":  # standbys, then any
        plan = [{**a, "target_session_attrs": "standby"} for a in plan] + [
            {**a, "target_session_attrs": "any"} for a in plan
        ]
    return plan


def where(attempt: Mapping[str, Any]) -> str:
    """An attempt's host and port, for an error message (nothing else of the parameters)."""
    host = _param(attempt, "host") or ""
    addr = attempt.get("hostaddr")
    shown = f"{host} ({addr})" if host and addr and host != addr else host or addr or "local"
    return f"{shown}:{_param(attempt, 'port') or 5432}"


def _needs_lookup(attempt: Mapping[str, Any]) -> bool:
    host = _param(attempt, "host")
    if not host or attempt.get("hostaddr") or host.startswith("/") or host[1:2] == ":":
        return False  # none, resolved, a Unix socket directory (or a Windows path)
    try:
        ip_address(host)
    except ValueError:
        return True
    return False


def _reason(pgconn: pq.abc.PGconn) -> str:
    """libpq's message, on one line."""
    text = pgconn.error_message.decode("utf-8", "replace")
    return " ".join(text.split()) or "connection failed"


class _Failed(Exception):
    def __init__(self, reason: str, timed_out: bool = False) -> None:
        super().__init__(reason)
        self.timed_out = timed_out


def _one(
    attempt: Mapping[str, Any], seconds: float
) -> Generator[Request, Any, pq.abc.PGconn]:
    """One attempt (one host), within ``seconds``: the connected PGconn, non-blocking as
    psycopg leaves it; _Failed with the reason otherwise (its PGconn finished)."""
    deadline = time.monotonic() + seconds
    conninfo = make_conninfo("", **attempt).encode()
    pgconn = pq.PGconn.connect_start(conninfo)
    connected = False
    try:
        while True:
            if pgconn.status == BAD:
                raise _Failed(_reason(pgconn))
            status = pgconn.connect_poll()
            if status == POLL_OK:
                pgconn.nonblocking = 1
                connected = True
                return pgconn
            if status == POLL_FAILED:
                raise _Failed(_reason(pgconn))
            if status not in (POLL_READING, POLL_WRITING):
                raise _Failed(f"unexpected poll status {status}")
            left = deadline - time.monotonic()
            try:
                fd = pgconn.socket
            except psycopg.OperationalError as exc:  # libpq let its socket go (-1)
                raise _Failed(" ".join(str(exc).split())) from None
            if left <= 0 or not (yield Wait(fd, status == POLL_WRITING, left)):
                raise _Failed(f"no answer within {seconds:.2f}s (timeout expired)", True)
    finally:
        if not connected:
            pgconn.finish()  # also when the caller gives up (GeneratorExit, a cancellation)


def connecting(
    params: Mapping[str, Any], timeout: float
) -> Generator[Request, Any, pq.abc.PGconn]:
    """Connect with ``params`` (libpq's) within ``timeout`` seconds in all: the connected
    PGconn (see the module docstring); psycopg.OperationalError naming every host that failed
    (psycopg.errors.ConnectionTimeout if the time ran out)."""
    deadline = time.monotonic() + timeout
    plan = attempts(params)
    failed: list[str] = []
    timed_out = False
    i = 0
    while i < len(plan):
        attempt = plan[i]
        left = deadline - time.monotonic()
        if left <= 0:
            failed.extend(f"{where(a)}: not tried (no time left)" for a in plan[i:])
            timed_out = True
            break
        share = left / (len(plan) - i)
        cap = _param(attempt, "connect_timeout")
        if cap and cap.strip().lstrip("-").isdigit() and int(cap) > 0:
            share = min(share, float(cap))  # libpq's per-host bound, when it is shorter
        if _needs_lookup(attempt):
            host, port = _param(attempt, "host") or "", _param(attempt, "port") or "5432"
            found = yield Resolve(host, port, share)
            if not found:
                found = OSError("no address")
            if isinstance(found, BaseException):
                why = "no address within the time" if isinstance(found, TimeoutError) else found
                failed.append(f"{where(attempt)}: could not resolve the host name: {why}")
                timed_out = isinstance(found, TimeoutError)
                i += 1
                continue
            plan[i : i + 1] = [{**attempt, "hostaddr": addr} for addr in found]
            continue
        try:
            return (yield from _one(attempt, share))
        except _Failed as exc:
            failed.append(f"{where(attempt)}: {exc}")
            timed_out = exc.timed_out
        i += 1
    if len(failed) == 1:
        message = failed[0]
    else:
        message = f"{len(failed)} connection attempts failed: " + "; ".join(failed)
    raise (psycopg.errors.ConnectionTimeout if timed_out else psycopg.OperationalError)(message)


# -- the sync shell ----------------------------------------------------------------------------


def connect_pgconn(params: Mapping[str, Any], timeout: float) -> pq.abc.PGconn:
    """:func:`connecting`, waiting with poll() (select() under green threads, where it is
    the patched one; and on Windows)."""
    green = patched()
    gen = connecting(params, timeout)
    try:
        request = next(gen)
        while True:
            if isinstance(request, Wait):
                answer: Any = _ready(request, green)
            else:
                answer = _lookup(request)
            request = gen.send(answer)
    except StopIteration as done:
        pgconn: pq.abc.PGconn = done.value
        return pgconn
    finally:
        gen.close()  # interrupted: the half-open connection is finished


def _ready(wait: Wait, green: bool) -> bool:
    if green or not hasattr(select, "poll"):
        w = [wait.fd]
        r, w, _ = select.select([] if wait.write else w, w if wait.write else [], [], wait.seconds)
        return bool(r or w)
    poller = select.poll()
    poller.register(wait.fd, select.POLLOUT if wait.write else select.POLLIN)
    return bool(poller.poll(max(1, int(wait.seconds * 1000 + 0.999))))


def _lookup(resolve: Resolve) -> list[str] | OSError:
    try:
        found = socket.getaddrinfo(
            resolve.host, resolve.port, proto=socket.IPPROTO_TCP, type=socket.SOCK_STREAM
        )
    except OSError as exc:
        return exc
    return addresses(found)


def addresses(found: list[Any]) -> list[str]:
    """getaddrinfo's answer: its addresses, each once, in its order."""
    return list(dict.fromkeys(str(item[4][0]) for item in found))
