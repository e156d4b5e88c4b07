"""Lock and Semaphore: the lease semantics, written once for every store."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping
from datetime import datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any

from latchkey._durations import format_duration, parse_ttl, parse_wait
from latchkey._owner import current_owner_json, new_owner_token
from latchkey._renew import Renewer
from latchkey._types import Busy, Grant, Holder
from latchkey._waiting import wait_for
from latchkey.errors import LatchkeyError, LockLost, LockTimeout

if TYPE_CHECKING:
    from latchkey._durations import Duration
    from latchkey._store import Store

_UNSET: Any = object()


def drift_margin(ttl: float) -> float:
    """How much earlier than the store the holder gives up its lease: 1% of the TTL + 2 ms,
    for clock-rate drift and the time the store took to start the lease after we sent it."""
    return min(ttl * 0.01 + 0.002, ttl / 2)


def describe_holder(holder: Holder | None) -> str:
    if holder is None:
        return "another holder"
    parts = [f"held by {holder.owner}"]
    if holder.token is not None:
        parts.append(f"token {holder.token}")
    if holder.expires_at is not None:
        parts.append(f"until {holder.expires_at.isoformat(timespec='milliseconds')}")
    return ", ".join(parts)


class Lock:
    """A leased mutex. Use it as a context manager, or call :meth:`acquire`/:meth:`release`.

    Created by :meth:`latchkey.Store.lock`; one object holds at most one lease at a time and
    may be acquired again after release.

    .. versionadded:: 0.1
    """

    kind = "lock"

    def __init__(
        self,
        store: Store,
        name: str,
        *,
        ttl: Duration,
        wait: Duration | None,
        renew: bool,
        metadata: Mapping[str, Any],
        limit: int = 1,
    ) -> None:
        self.store = store
        self.name = name
        self.ttl = parse_ttl(ttl)
        self.wait = parse_wait(wait)
        self.renew = bool(renew)
        self.metadata = dict(metadata)
        self._metadata_json = json.dumps(self.metadata, sort_keys=True) if self.metadata else ""
        self.limit = limit
        #: Fencing token of the current lease (None when not held or the store has no fencing).
        self.token: int | None = None
        #: When the current lease ends by the store's clock (None: not held, or no TTL).
        self.expires_at: datetime | None = None
        #: Who held the name when the last acquire gave up (for messages).
        self.holder: Holder | None = None
        self._owner: str | None = None
        self._deadline: float | None = None
        self._lost_reason: str | None = None
        self._renewer: Renewer | None = None
        self._state = threading.Lock()

    # -- state -----------------------------------------------------------------------------

    @property
    def held(self) -> bool:
        """True between a successful acquire and release (even if the lease was lost since)."""
        return self._owner is not None

    @property
    def lost(self) -> bool:
        """True if we acquired the lease and can no longer be sure it is ours: the local
        deadline passed, renewal failed, or an extend found it gone."""
        if self._owner is None:
            return False
        if self._lost_reason is not None:
            return True
        return self._deadline is not None and time.monotonic() >= self._deadline

    def check(self) -> None:
        """Raise :class:`LockLost` unless the lease is held and still ours by our own clock.
        Asks nothing of the store: call it before each step that needs the lock."""
        if self._owner is None:
            raise LockLost(f"{self.kind} {self.name!r} is not held")
        if self.lost:
            raise LockLost(
                f"{self.kind} {self.name!r} was lost: {self._lost_reason or 'lease expired'}"
            )

    def remaining(self) -> float | None:
        """Seconds until our local deadline (0 when lost or not held; None: no TTL)."""
        if self._owner is None or self._lost_reason is not None:
            return 0.0
        if self._deadline is None:
            return None
        return max(0.0, self._deadline - time.monotonic())

    # -- operations ------------------------------------------------------------------------

    def acquire(self, wait: Duration | None = _UNSET) -> bool:
        """Take the lease. Waits up to ``wait`` (default: the lock's own; None: forever).

        Returns True when acquired, False when still busy after the wait. Raises
        :class:`~latchkey.errors.StoreUnavailable` when the store fails, never False for that.
        """
        if self._owner is not None:
            raise LatchkeyError(f"{self.kind} {self.name!r} is already held by this object")
        wait_s = self.wait if wait is _UNSET else parse_wait(wait)
        backend = self.store.backend
        owner = new_owner_token()
        owner_info = current_owner_json(self._metadata_json)
        sent = time.monotonic()
        result = backend.acquire(self.name, owner, owner_info, self.ttl, self.limit)
        if isinstance(result, Busy) and wait_s != 0:  # wait: the uncontended path skips this

            def attempt() -> Grant | Busy:
                nonlocal sent
                sent = time.monotonic()
                return backend.acquire(self.name, owner, owner_info, self.ttl, self.limit)

            def block(timeout: float | None) -> Grant | Busy:
                nonlocal sent
                sent = time.monotonic()
                return backend.acquire_blocking(
                    self.name, owner, owner_info, self.ttl, self.limit, timeout
                )

            result = wait_for(
                attempt,
                lambda: backend.wait_in_line(self.name, owner, owner_info, self.ttl, self.limit),
                wait=wait_s,
                limit=self.limit,
                push=backend.capabilities.push,
                block=block if backend.capabilities.blocking and self.limit == 1 else None,
                first=result,
            )
        if isinstance(result, Busy):
            self.holder = result.holder
            return False
        with self._state:
            self._owner = owner
            self._lost_reason = None
            self.holder = None
            self._granted(result, sent)
        if self.renew:
            self._renewer = Renewer(self, interval=self.ttl / 3)
        return True

    def release(self) -> bool:
        """End the lease. True if it was still live in the store; False if it had already
        expired or was taken from us (and then nothing is touched). Never raises for a lease
        that is not held; raises StoreUnavailable if the store cannot be asked."""
        owner = self._owner
        if owner is None:
            return False
        self._stop_renewer()
        try:
            return self.store.backend.release(self.name, owner)
        finally:
            self._forget()

    def extend(self, ttl: Duration | None = None) -> None:
        """Make the lease end ``ttl`` from now (default: the lock's TTL). Only the holder can.

        Raises :class:`LockLost` if the lease already ended (by our clock or the store's).
        """
        self.check()
        ttl_s = self.ttl if ttl is None else parse_ttl(ttl)
        sent = time.monotonic()
        assert self._owner is not None
        grant = self.store.backend.extend(self.name, self._owner, ttl_s)
        with self._state:
            if grant is None:
                self._lost_reason = (
                    "the store no longer has our lease (its session ended)"
                    if self.store.backend.capabilities.session_tied
                    else "the store no longer has our lease (expired or released)"
                )
                raise LockLost(f"{self.kind} {self.name!r} was lost: {self._lost_reason}")
            self._granted(grant, sent, ttl_s)

    def _end(self, keep: float) -> bool:
        """Finish with the lease: release it now, or, when ``keep`` seconds of an at-least
        period remain, leave it in the store for those seconds and let it expire there (the
        singleton's ``at_least`` and ``latchkey run --at-least``). False if the lease had
        already ended (expired, released or taken)."""
        if keep <= 0.001 or self.lost or not self.store.backend.capabilities.ttl:
            return self.release()
        self._stop_renewer()
        try:
            self.extend(keep)
            return True
        except LockLost:
            return False
        finally:
            self._forget()

    # -- internals ---------------------------------------------------------------------------

    def _granted(self, grant: Grant, sent: float, ttl: float | None = None) -> None:
        ttl = self.ttl if ttl is None else ttl
        self.token = grant.token if grant.token is not None else self.token
        self.expires_at = grant.expires_at
        if self.store.backend.capabilities.ttl:
            left = ttl if grant.remaining is None else min(ttl, grant.remaining)
            self._deadline = sent + left - drift_margin(ttl)
        else:
            self._deadline = None

    def _forget(self) -> None:
        with self._state:
            self._owner = None
            self._deadline = None
            self._lost_reason = None
            self.token = None
            self.expires_at = None

    def _stop_renewer(self) -> None:
        if self._renewer is not None:
            self._renewer.stop()
            self._renewer = None

    def _renew_once(self) -> float:
        self.extend()
        return self.ttl / 3

    def _mark_lost(self, reason: str) -> None:
        with self._state:
            if self._owner is not None and self._lost_reason is None:
                self._lost_reason = reason

    def _seconds_left(self) -> float:
        left = self.remaining()
        return float("inf") if left is None else left

    def _timeout_error(self, wait: float | None) -> LockTimeout:
        waited = "" if not wait else f" after waiting {format_duration(wait)}"
        return LockTimeout(
            f"{self.kind} {self.name!r} is busy{waited}: {describe_holder(self.holder)}",
            name=self.name,
            holder=self.holder,
        )

    def __enter__(self) -> Lock:
        if not self.acquire():
            raise self._timeout_error(self.wait)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "lost" if self.lost else "held" if self.held else "free"
        token = f" token={self.token}" if self.token is not None else ""
        return f"<{type(self).__name__} {self.name!r} {state}{token}>"


class Semaphore(Lock):
    """One slot of a counting semaphore: at most ``limit`` holders of a name at once, each
    with its own lease, owner and fencing token. Same interface as :class:`Lock`.

    .. versionadded:: 0.1
    """

    kind = "semaphore"
