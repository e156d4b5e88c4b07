"""The public Store: what ``latchkey.connect()`` returns. It validates input, builds the lease
objects, and delegates atomic work to its backend."""

from __future__ import annotations

import functools
import inspect as _inspect
import logging
import os
import statistics
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from latchkey._claim import Claim
from latchkey._durations import Duration, parse_duration, parse_ttl
from latchkey._lock import Lock, Semaphore, describe_holder
from latchkey._names import validate_name
from latchkey._owner import check_metadata
from latchkey._record import Record
from latchkey._types import LockInfo
from latchkey.errors import ConfigError, LockLost, Unsupported
from latchkey.stores import Backend, Capabilities, open_backend

log = logging.getLogger("latchkey")
F = TypeVar("F", bound=Callable[..., Any])

#: The lease length when ``ttl=`` is not given.
DEFAULT_TTL = 60.0


def default_url() -> str:
    """``LATCHKEY_URL``, else an SQLite file in the user's state directory."""
    if url := os.environ.get("LATCHKEY_URL"):
        return url
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(Path.home(), ".local", "state")
    path = Path(state) / "latchkey" / "locks.db"
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


def connect(url: str | None = None) -> Store:
    """Open a store by URL (default: ``LATCHKEY_URL``, else embedded SQLite in the user's
    state directory, ``$XDG_STATE_HOME/latchkey/locks.db``). Connects lazily.

    Raises :class:`~latchkey.errors.ConfigError` for a bad URL or option.
    """
    return Store(open_backend(url if url is not None else default_url()))


def _check_limit(limit: object) -> int:
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ConfigError(f"limit must be a whole number ≥ 1, got {limit!r}")
    return limit


@dataclass(frozen=True)
class Health:
    """What ``Store.check()`` measured."""

    url: str
    round_trip: float
    """Median seconds for one store round trip (a clock read)."""
    clock_offset: float
    """Store clock minus local clock, seconds (positive: the store is ahead)."""
    probe: float
    """Seconds to acquire, inspect and release a probe lease."""
    capabilities: Capabilities


class Store:
    """Locks, semaphores, claims and records on one store. Create with :func:`connect`.

    .. versionadded:: 0.1
    """

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    @property
    def capabilities(self) -> Capabilities:
        """What this store guarantees (see the docs' store pages)."""
        return self.backend.capabilities

    @property
    def scheme(self) -> str:
        return self.backend.url.scheme

    @property
    def url(self) -> str:
        """The store URL with its password masked."""
        return self.backend.url.redacted()

    # -- leases ------------------------------------------------------------------------------

    def lock(
        self,
        name: str,
        *,
        ttl: Duration = DEFAULT_TTL,
        wait: Duration | None = None,
        renew: bool = False,
        metadata: Mapping[str, Any] | None = None,
    ) -> Lock:
        """A leased mutex on ``name``. ``wait=None`` blocks without limit, ``wait=0`` tries
        once; ``renew=True`` keeps the lease alive from a background thread."""
        return Lock(
            self,
            validate_name(name),
            ttl=ttl,
            wait=wait,
            renew=renew,
            metadata=check_metadata(metadata),
        )

    def semaphore(
        self,
        name: str,
        limit: int,
        *,
        ttl: Duration = DEFAULT_TTL,
        wait: Duration | None = None,
        renew: bool = False,
        metadata: Mapping[str, Any] | None = None,
    ) -> Semaphore:
        """A counting semaphore: at most ``limit`` holders of ``name`` at once."""
        limit = _check_limit(limit)
        if limit > 1 and not self.capabilities.semaphores:
            raise Unsupported(f"the {self.scheme} store does not support semaphores")
        return Semaphore(
            self,
            validate_name(name),
            ttl=ttl,
            wait=wait,
            renew=renew,
            metadata=check_metadata(metadata),
            limit=limit,
        )

    def claim(
        self,
        names: Iterable[str],
        *,
        ttl: Duration = DEFAULT_TTL,
        metadata: Mapping[str, Any] | None = None,
    ) -> Claim:
        """Take every free name of ``names`` at once; skip the busy ones (seed 000)."""
        if isinstance(names, str):
            raise ConfigError("claim() takes an iterable of names, not one str")
        if not self.capabilities.claims:
            raise Unsupported(f"the {self.scheme} store does not support batch claims")
        return Claim(self, names, ttl=parse_ttl(ttl), metadata=check_metadata(metadata))

    def is_free(self, name: str) -> bool:
        """True if nobody holds a live lease on ``name``."""
        return self.inspect(name) is None

    def inspect(self, name: str) -> LockInfo | None:
        """The live holders of ``name``, or None."""
        return self.backend.inspect(validate_name(name))

    def list(self, prefix: str = "") -> Iterator[LockInfo]:
        """Every held name starting with ``prefix``, in name order."""
        if not self.capabilities.listing:
            raise Unsupported(f"the {self.scheme} store cannot list locks")
        if not isinstance(prefix, str):
            raise ConfigError(f"prefix must be a str, got {prefix!r}")
        return self.backend.list(prefix)

    def force_release(self, name: str) -> bool:
        """Drop every lease on ``name``, whoever holds it. The operator's lever: latchkey
        never calls it by itself. True if a live lease was dropped."""
        return self.backend.force_release(validate_name(name))

    def purge_expired(self) -> int:
        """Delete expired lease rows (fencing counters stay); return how many."""
        return self.backend.purge_expired()

    # -- records -----------------------------------------------------------------------------

    def record(self, name: str) -> Record:
        """A versioned JSON record for optimistic updates (seed 003)."""
        if not self.capabilities.records:
            raise Unsupported(f"the {self.scheme} store does not support versioned records")
        return Record(self, validate_name(name))

    def update(self, name: str, fn: Callable[[Any], Any], *, retries: int = 10) -> Any:
        """Read-modify-write ``name`` with ``fn`` until it applies without a conflict."""
        return self.record(name).update(fn, retries=retries)

    # -- decorators --------------------------------------------------------------------------

    def singleton(
        self,
        name: str,
        *,
        at_most: Duration,
        at_least: Duration = 0,
        metadata: Mapping[str, Any] | None = None,
    ) -> Callable[[F], F]:
        """Run the function only if nobody else is running it (ShedLock-style).

        If the lock is busy the call returns None and logs at INFO who holds it. The lock is
        held at most ``at_most`` (its TTL) and at least ``at_least``, even when the function
        finished sooner, so that nodes whose schedules fire a little apart skip this tick.
        """
        validate_name(name)
        most = parse_ttl(at_most, what="at_most")
        least = parse_duration(at_least, what="at_least")
        if least > most:
            raise ConfigError(f"at_least ({at_least!r}) must not exceed at_most ({at_most!r})")
        meta = check_metadata(metadata)

        def decorate(fn: F) -> F:
            @functools.wraps(fn)
            def run(*args: Any, **kwargs: Any) -> Any:
                lock = self.lock(name, ttl=most, wait=0, metadata=meta)
                started = time.monotonic()
                if not lock.acquire():
                    log.info(
                        "skipped %s: %r is %s",
                        fn.__qualname__,
                        name,
                        describe_holder(lock.holder),
                    )
                    return None
                try:
                    return fn(*args, **kwargs)
                finally:
                    if not lock._end(least - (time.monotonic() - started)):
                        log.warning("%r expired while the job ran (at_most too short?)", name)

            return run  # type: ignore[return-value]

        return decorate

    def locked(
        self,
        name: str,
        *,
        ttl: Duration = DEFAULT_TTL,
        wait: Duration | None = None,
        renew: bool = False,
        metadata: Mapping[str, Any] | None = None,
    ) -> Callable[[F], F]:
        """Hold the lock ``name.format(**arguments)`` while the function runs (blocking)."""
        if not isinstance(name, str) or not name:
            raise ConfigError("locked() needs a non-empty name template")

        def decorate(fn: F) -> F:
            signature = _inspect.signature(fn)

            @functools.wraps(fn)
            def run(*args: Any, **kwargs: Any) -> Any:
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                try:
                    lock_name = name.format(**bound.arguments)
                except (KeyError, IndexError, AttributeError) as exc:
                    raise ConfigError(
                        f"locked({name!r}): cannot fill the name from {fn.__qualname__}'s "
                        f"arguments: {exc!r}"
                    ) from None
                with self.lock(lock_name, ttl=ttl, wait=wait, renew=renew, metadata=metadata):
                    return fn(*args, **kwargs)

            return run  # type: ignore[return-value]

        return decorate

    # -- health and lifecycle ----------------------------------------------------------------

    def now(self) -> datetime:
        """The store's clock (UTC)."""
        return self.backend.now()

    def check(self, samples: int = 5) -> Health:
        """Reach the store, read its clock, and acquire/inspect/release a probe lease."""
        trips: list[float] = []
        offsets: list[float] = []
        for _ in range(max(1, samples)):
            before_wall, before = time.time(), time.monotonic()
            store_now = self.backend.now()
            trip = time.monotonic() - before
            trips.append(trip)
            offsets.append(store_now.timestamp() - (before_wall + trip / 2))
        started = time.monotonic()
        probe = self.lock(f"latchkey:check:{uuid.uuid4().hex}", ttl=30, wait=0)
        if not probe.acquire():
            raise LockLost("check: a fresh probe name was reported busy")
        try:
            if self.capabilities.ttl and self.inspect(probe.name) is None:
                raise LockLost("check: the probe lease was not visible after acquire")
        finally:
            probe.release()
        return Health(
            self.url,
            statistics.median(trips),
            statistics.median(offsets),
            time.monotonic() - started,
            self.capabilities,
        )

    def init(self) -> None:
        """Create the store's tables/indexes now (they are otherwise created on first use)."""
        self.backend.init()

    def close(self) -> None:
        """Close connections. Session-tied locks (advisory, GET_LOCK) end with them."""
        self.backend.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<latchkey.Store {self.url}>"
