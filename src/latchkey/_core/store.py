"""What :class:`latchkey.Store` and :class:`latchkey.AsyncStore` share: input validation, the
decorators' rules (singleton, locked), the health check, and the capability checks. I/O-free:
the operations are generators (see :mod:`latchkey._core.ops`)."""

from __future__ import annotations

import inspect as _inspect
import logging
import statistics
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from latchkey._core.holds import Holds
from latchkey._core.lease import describe_holder
from latchkey._core.ops import Steps, call, sleep, user
from latchkey._durations import Duration, parse_duration, parse_ttl
from latchkey._names import validate_name
from latchkey._owner import check_metadata
from latchkey.errors import ConfigError, InvalidValue, LockLost, Unsupported
from latchkey.stores.base import BackendBase, Capabilities

if TYPE_CHECKING:
    from latchkey._core.claim import ClaimCore
    from latchkey._core.lease import LeaseCore
    from latchkey._core.record import RecordCore

log = logging.getLogger("latchkey")

#: The lease length when ``ttl=`` is not given.
DEFAULT_TTL = 60.0

#: Purging: the first batch's size (rows a store deletes in one statement), the bounds it is
#: kept within, and the time one batch should take. The batch grows or shrinks to take about
#: PURGE_STEP, and between batches the purge rests at least as long as the batch took (and at
#: least PURGE_REST): whatever a batch holds (SQLite's write lock, row locks, the server's
#: attention) is held for about PURGE_STEP at a time, and others get it at least half the time.
PURGE_BATCH = 500
PURGE_MIN, PURGE_MAX = 50, 20_000
PURGE_STEP = 0.01
PURGE_REST = 0.01


def check_callback(fn: Callable[[Any], Any] | None) -> Callable[[Any], Any] | None:
    """``on_lost`` must be callable (or None): said at once, not when the lease is lost."""
    if fn is not None and not callable(fn):
        raise InvalidValue(f"on_lost must be a function taking the lock, got {fn!r}")
    return fn


def check_limit(limit: object) -> int:
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


@dataclass(frozen=True)
class SingletonRule:
    name: str
    at_most: float
    at_least: float
    metadata: dict[str, Any]


LockT = TypeVar("LockT", bound="LeaseCore")
SemaphoreT = TypeVar("SemaphoreT", bound="LeaseCore")
ClaimT = TypeVar("ClaimT", bound="ClaimCore")
RecordT = TypeVar("RecordT", bound="RecordCore")


class StoreCore(Generic[LockT, SemaphoreT, ClaimT, RecordT]):
    """The store-wide rules; the shells add the blocking or awaiting methods and name the
    classes their factories make (``Lock`` or ``AsyncLock``, …)."""

    backend: BackendBase  # the shell's Backend or AsyncBackend
    #: This process's live leases through this store object, where it may answer busy
    #: without the store (see _core/holds.py); set by the shells.
    _holds: Holds | None = None
    _lock_class: type[LockT]
    _semaphore_class: type[SemaphoreT]
    _claim_class: type[ClaimT]
    _record_class: type[RecordT]

    @property
    def capabilities(self) -> Capabilities:
        """What this store guarantees (see the docs' store pages)."""
        return self.backend.capabilities

    @property
    def scheme(self) -> str:
        """The URL scheme, e.g. ``postgresql``."""
        return self.backend.url.scheme

    @property
    def url(self) -> str:
        """The store URL with its password masked."""
        return self.backend.url.redacted()

    # -- the objects a store makes (no I/O, except a sync claim, which takes at once) --------

    def lock(
        self,
        name: str,
        *,
        ttl: Duration = DEFAULT_TTL,
        wait: Duration | None = None,
        renew: bool = False,
        metadata: Mapping[str, Any] | None = None,
        on_lost: Callable[[Any], Any] | None = None,
    ) -> LockT:
        """A leased mutex on ``name``. ``wait=None`` waits without limit, ``wait=0`` tries
        once; ``renew=True`` keeps the lease alive in the background (a thread, or a task of
        the running loop). ``on_lost(lock)`` is called once when the lease is known lost (the
        renewer or an extend found it gone, or renewing failed until it ended); a coroutine
        function is awaited on the asyncio API."""
        return self._lock_class(
            self,
            validate_name(name),
            ttl=ttl,
            wait=wait,
            renew=renew,
            metadata=check_metadata(metadata),
            on_lost=check_callback(on_lost),
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
        on_lost: Callable[[Any], Any] | None = None,
    ) -> SemaphoreT:
        """A counting semaphore: at most ``limit`` holders of ``name`` at once (``on_lost``:
        as for :meth:`lock`, called with this slot)."""
        limit = self._semaphore_limit(limit)
        return self._semaphore_class(
            self,
            validate_name(name),
            ttl=ttl,
            wait=wait,
            renew=renew,
            metadata=check_metadata(metadata),
            limit=limit,
            on_lost=check_callback(on_lost),
        )

    def claim(
        self,
        names: Iterable[str],
        *,
        ttl: Duration = DEFAULT_TTL,
        metadata: Mapping[str, Any] | None = None,
    ) -> ClaimT:
        """Take every free name of ``names`` at once; skip the busy ones (seed 000). The sync
        store takes them here; the asyncio one on ``await`` or ``async with``."""
        ttl_s, meta = self._claim_args(names, ttl, metadata)
        return self._claim_class(self, names, ttl=ttl_s, metadata=meta)

    def record(self, name: str) -> RecordT:
        """A versioned JSON record for optimistic updates (seed 003)."""
        return self._record_class(self, self._record_name(name))

    # -- validation --------------------------------------------------------------------------

    def _semaphore_limit(self, limit: object) -> int:
        limit = check_limit(limit)
        if limit > 1 and not self.capabilities.semaphores:
            raise Unsupported(f"the {self.scheme} store does not support semaphores")
        return limit

    def _claim_args(
        self, names: Iterable[str], ttl: Duration, metadata: Mapping[str, Any] | None
    ) -> tuple[float, dict[str, Any]]:
        if isinstance(names, str):
            raise ConfigError("claim() takes an iterable of names, not one str")
        if not self.capabilities.claims:
            raise Unsupported(f"the {self.scheme} store does not support batch claims")
        return parse_ttl(ttl), check_metadata(metadata)

    def _list_prefix(self, prefix: object) -> str:
        if not self.capabilities.listing:
            raise Unsupported(f"the {self.scheme} store cannot list locks")
        if not isinstance(prefix, str):
            raise ConfigError(f"prefix must be a str, got {prefix!r}")
        return prefix

    def _record_name(self, name: str) -> str:
        if not self.capabilities.records:
            raise Unsupported(f"the {self.scheme} store does not support versioned records")
        return validate_name(name)

    # -- decorators --------------------------------------------------------------------------

    @staticmethod
    def _singleton_rule(
        name: str, at_most: Duration, at_least: Duration, metadata: Mapping[str, Any] | None
    ) -> SingletonRule:
        validate_name(name)
        most = parse_ttl(at_most, what="at_most")
        least = parse_duration(at_least, what="at_least")
        if least > most:
            raise ConfigError(f"at_least ({at_least!r}) must not exceed at_most ({at_most!r})")
        return SingletonRule(name, most, least, check_metadata(metadata))

    def _singleton(
        self, rule: SingletonRule, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: Any
    ) -> Steps[Any]:
        """Run ``fn`` only if nobody else is: None (logged at INFO) when the lock is busy;
        the lock kept ``at_least`` after the start, even when ``fn`` finished sooner."""
        lock = self.lock(rule.name, ttl=rule.at_most, wait=0, metadata=rule.metadata)
        started = time.monotonic()
        if not (yield from lock._acquire()):
            log.info("skipped %s: %r is %s", _qualname(fn), rule.name, describe_holder(lock.holder))
            return None
        try:
            return (yield user(fn, *args, **kwargs))
        finally:
            if not (yield from lock._end(rule.at_least - (time.monotonic() - started))):
                log.warning("%r expired while the job ran (at_most too short?)", rule.name)

    @staticmethod
    def _locked_template(name: object) -> str:
        if not isinstance(name, str) or not name:
            raise ConfigError("locked() needs a non-empty name template")
        return name

    @staticmethod
    def _locked_name(
        template: str, fn: Callable[..., Any], signature: _inspect.Signature, args: Any, kw: Any
    ) -> str:
        bound = signature.bind(*args, **kw)
        bound.apply_defaults()
        try:
            return template.format(**bound.arguments)
        except (KeyError, IndexError, AttributeError) as exc:
            raise ConfigError(
                f"locked({template!r}): cannot fill the name from {_qualname(fn)}'s "
                f"arguments: {exc!r}"
            ) from None

    @staticmethod
    def _locked(
        lock: LeaseCore, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: Any
    ) -> Steps[Any]:
        yield from lock._enter()
        try:
            return (yield user(fn, *args, **kwargs))
        finally:
            yield from lock._release()

    # -- purging -----------------------------------------------------------------------------

    def _purge(self) -> Steps[int]:
        """Delete expired leases in bounded batches until none is left; return how many.

        One statement that deletes a backlog of millions holds its locks (or SQLite's write
        lock) for seconds and can hit the statement timeout and delete nothing; so each call
        asks the store for at most ``limit`` expired leases, found through its expiry index
        (a batch costs what it removes, not what is live), and rests between batches."""
        total, limit = 0, PURGE_BATCH
        while True:
            started = time.monotonic()
            count = int((yield call("purge_expired", limit)))
            took = time.monotonic() - started
            total += count
            if count < limit:
                return total
            if took < PURGE_STEP / 2:
                limit = min(PURGE_MAX, limit * 2)
            elif took > PURGE_STEP * 2:
                limit = max(PURGE_MIN, limit // 2)
            yield sleep(max(PURGE_REST, took))

    # -- health ------------------------------------------------------------------------------

    def _check(self, samples: int) -> Steps[Health]:
        """Reach the store, read its clock, and acquire/inspect/release a probe lease."""
        trips: list[float] = []
        offsets: list[float] = []
        for _ in range(max(1, samples)):
            before_wall, before = time.time(), time.monotonic()
            store_now = yield call("now")
            trip = time.monotonic() - before
            trips.append(trip)
            offsets.append(store_now.timestamp() - (before_wall + trip / 2))
        started = time.monotonic()
        probe = self.lock(f"latchkey:check:{uuid.uuid4().hex}", ttl=30, wait=0)
        if not (yield from probe._acquire()):
            raise LockLost("check: a fresh probe name was reported busy")
        try:
            if self.capabilities.ttl and (yield call("inspect", probe.name)) is None:
                raise LockLost("check: the probe lease was not visible after acquire")
        finally:
            yield from probe._release()
        return Health(
            self.url,
            statistics.median(trips),
            statistics.median(offsets),
            time.monotonic() - started,
            self.capabilities,
        )


def _qualname(fn: Callable[..., Any]) -> str:
    return str(getattr(fn, "__qualname__", repr(fn)))
