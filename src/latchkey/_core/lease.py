"""The lease rules, once for every store and both APIs: acquiring with try/wait/timeout, the
holder's local deadline and drift margin, extend, release, renewal, lost versus unavailable.

:class:`LeaseCore` holds one lock's (or semaphore slot's) parameters and state. Its operations
are generators of :mod:`latchkey._core.ops`; the sync :class:`latchkey.Lock` and the asyncio
:class:`latchkey.AsyncLock` subclass it and only drive them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any, NoReturn, TypeVar

from latchkey import _observe
from latchkey._core.holds import Holds
from latchkey._core.ops import CALL, Op, Steps, background, call, renew, sleep, unrenew, user
from latchkey._core.waiting import Attempts, ask_in_turn, wait_for
from latchkey._durations import Duration, format_duration, parse_ttl, parse_wait
from latchkey._owner import current_owner_json, new_owner_token
from latchkey._types import Busy, Grant, Holder
from latchkey.errors import LatchkeyError, LockLost, LockTimeout, StoreUnavailable
from latchkey.stores.base import Capabilities

T = TypeVar("T")

log = logging.getLogger("latchkey")

#: The default of ``acquire(wait=...)``: the lock's own ``wait``.
UNSET: Any = object()


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


#: The first answer of a waiting acquire that skipped its attempt: the name was contended a
#: moment ago (``Backend.contended``), so it waits in a blocking store at once.
CONTENDED = Busy(holders=1)


class LeaseCore:
    """One lease's parameters and state, and its rules as generators. Not public: see
    :class:`latchkey.Lock` and :class:`latchkey.AsyncLock`."""

    kind = "lock"
    #: While metrics count this lease as held: (recorder, when granted); see _observe.
    _observed: Any = None

    def __init__(
        self,
        store: Any,
        name: str,
        *,
        ttl: Duration,
        wait: Duration | None,
        renew: bool,
        metadata: Mapping[str, Any],
        limit: int = 1,
        on_lost: Callable[[Any], Any] | None = None,
    ) -> None:
        #: The Store (or AsyncStore) that made this lease.
        self.store = store
        self._backend = store.backend
        self._caps: Capabilities = self._backend.capabilities
        self.name = name
        self.ttl = parse_ttl(ttl)
        self.wait = parse_wait(wait)
        self.renew = bool(renew)
        self.metadata = dict(metadata)
        self._metadata_json = json.dumps(self.metadata, sort_keys=True) if self.metadata else ""
        self.limit = limit
        self.on_lost = on_lost
        #: Fencing token of the current lease (None when not held or the store has no fencing).
        self.token: int | None = None
        #: When the current lease ends by the store's clock (None: not held, or no TTL).
        self.expires_at: datetime | None = None
        #: Who held the name when the last acquire gave up (for messages).
        self.holder: Holder | None = None
        self._owner: str | None = None
        self._deadline: float | None = None
        self._granted_for: float = self.ttl  # the lease the store last granted (seconds)
        self._lost_reason: str | None = None
        self._renew_failure: str | None = None  # the last renewal's error, if it failed
        self._lost_told = False  # the loss of the current lease was logged and on_lost called
        #: The shell's renewer (a thread or a task) while one runs; see ops.RENEW.
        self._renewer: Any = None
        self._state = threading.Lock()
        #: The store object's record of this process's leases (None: not kept there).
        self._holds: Holds | None = getattr(store, "_holds", None)
        self._grant: Grant | None = None  # the current lease's grant, for local busy answers
        self._owner_info = ""  # and the owner JSON it was taken with
        self._hold: Any = None  # this lease's entry in _holds while it is there

    # -- state (no I/O) ----------------------------------------------------------------------

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

    # -- the rules (generators) --------------------------------------------------------------

    def _acquire(self, wait: Duration | None = UNSET) -> Steps[bool]:
        steps = self._acquire_steps(wait)
        hooks = _observe.hooks
        if hooks is None:
            return steps
        return hooks.acquire(self, steps, self.wait if wait is UNSET else wait)

    def _acquire_steps(
        self, wait: Duration | None, attempt: tuple[float | None, tuple[Any, ...]] | None = None
    ) -> Steps[bool]:
        wait_s, args = self._attempt(wait) if attempt is None else attempt
        sent = time.monotonic()
        result: Any
        try:
            if self._asks_store_first(wait_s):
                result = yield (CALL, None, "acquire", args)
            else:
                result = yield from self._first_answer(args)
        except BaseException as exc:
            yield from after_failure(exc, call("release", self.name, args[1]), self.ttl)
            raise  # (after_failure raises it)
        if type(result) is not Grant and wait_s != 0:
            result, sent = yield from self._wait_more(result, args, sent, wait_s)
        if not self._took(result, args, sent):
            return False
        if self.renew:
            yield renew(self)
        return True

    # The acquire's rules as parts, each once: the generator above composes them, and so do
    # the shells' direct paths for an uncontended acquire (``Lock.acquire``, ``AsyncLock.
    # acquire``), which call the store without driving a generator (docs/concepts/
    # architecture.md; what the generator costs: docs/benchmarks.md, runs 34-35).

    def _attempt(self, wait: Duration | None) -> tuple[float | None, tuple[Any, ...]]:
        """An acquire's wait (seconds, None: for ever) and its attempts' arguments ``(name,
        owner, owner JSON, ttl, limit)``, a new owner; refused while this object holds it."""
        if self._owner is not None:
            raise LatchkeyError(f"{self.kind} {self.name!r} is already held by this object")
        wait_s = self.wait if wait is UNSET else parse_wait(wait)
        owner_info = current_owner_json(self._metadata_json)
        return wait_s, (self.name, new_owner_token(), owner_info, self.ttl, self.limit)

    def _asks_store_first(self, wait_s: float | None) -> bool:
        """Whether the first attempt is one plain store call (the uncontended case): this
        process's record has nothing to answer for the name (``_core/holds.py``), and it was
        not contended a moment ago in a blocking store. Else :meth:`_first_answer`."""
        holds = self._holds
        if holds is None:
            return not (
                wait_s != 0
                and self.limit == 1
                and self._caps.blocking
                and self._backend.contended(self.name)
            )
        name = self.name
        return name not in holds.names and (self.limit != 1 or name not in holds.queue)

    def _first_answer(self, args: tuple[Any, ...]) -> Steps[Grant | Busy]:
        """The first attempt when :meth:`_asks_store_first` says no: a blocking store's name
        contended a moment ago waits there at once (CONTENDED); this process's own record
        may answer busy without the store while another lease of it through this store
        object is live by its holder's clock; a mutex attempt waits for the outcome of one
        already in flight from this process (waiters of this process take turns)."""
        holds = self._holds
        if holds is None:
            return CONTENDED
        name = self.name
        local = holds.busy(name, self.limit) if name in holds.names else None
        if local is not None:
            return local
        if self.limit != 1 or name not in holds.queue:
            return (yield (CALL, None, "acquire", args))  # type: ignore[no-any-return]
        return (yield from ask_in_turn(holds, args))

    def _wait_more(
        self, first: Busy, args: tuple[Any, ...], sent: float, wait_s: float | None
    ) -> Steps[tuple[Grant | Busy, float]]:
        """After a ``first`` answer busy: attempt until granted or ``wait_s`` has passed since
        ``sent`` (:func:`wait_for`). The answer, and when its attempt was sent."""
        caps = self._caps
        attempts = Attempts(args, time.monotonic, sent, self._holds)
        try:
            result = yield from wait_for(
                attempts,
                first,
                wait=wait_s,
                limit=self.limit,
                push=caps.push,
                blocking=caps.blocking and self.limit == 1,
                poll_share=self._backend.poll_share,
            )
        except BaseException as exc:
            yield from after_failure(exc, call("release", self.name, args[1]), self.ttl)
            raise  # (after_failure raises it)
        return result, attempts.sent

    def _took(self, result: Grant | Busy, args: tuple[Any, ...], sent: float) -> bool:
        """Record an acquire's answer: a grant (the lease is ours from ``sent``, when its
        attempt was sent) and True, or who holds the name and False."""
        if type(result) is not Grant:
            assert isinstance(result, Busy), result
            self.holder = result.holder
            return False
        with self._state:
            self._owner = args[1]
            self._lost_reason = None
            self._lost_told = False
            self._renew_failure = None
            self.holder = None
            self._granted(result, sent, self.ttl)
            self._grant, self._owner_info = result, args[2]
        if self._holds is not None:
            self._hold = self._holds.add(self)
        return True

    def _release(self) -> Steps[bool]:
        steps = self._release_steps()
        hooks = _observe.hooks
        if hooks is None or self._owner is None:
            return steps
        return hooks.release(self, steps)

    def _release_steps(self) -> Steps[bool]:
        owner = self._owner
        if owner is None:
            return False
        if self._renewer is not None:
            yield unrenew(self)
        if self._hold is not None:  # before the release: a waiter it wakes must not find it
            self._unhold()
        try:
            return (yield (CALL, None, "release", (self.name, owner)))  # type: ignore[no-any-return]
        finally:
            self._forget()

    def _extend(self, ttl: Duration | None = None) -> Steps[None]:
        steps = self._extend_steps(ttl)
        hooks = _observe.hooks
        return steps if hooks is None else hooks.extend(self, steps)

    def _extend_steps(self, ttl: Duration | None) -> Steps[None]:
        if self._owner is not None and self.lost:
            failed = self._renew_failure
            reason = f"could not renew before the lease ended: {failed}" if failed else None
            yield from self._lose(self._lost_reason or reason or "lease expired")
        self.check()
        ttl_s = self.ttl if ttl is None else parse_ttl(ttl)
        sent = time.monotonic()
        owner = self._owner
        assert owner is not None
        grant = yield call("extend", self.name, owner, ttl_s)
        if self._owner != owner:
            # Released (or acquired again) while this extend was in flight — a renewal's: a
            # release does not wait for it. Its answer is about a lease no longer ours.
            return
        if grant is None:
            reason = (
                "the store no longer has our lease (its session ended)"
                if self._caps.session_tied
                else "the store no longer has our lease (expired or released)"
            )
            yield from self._lose(reason)
            raise LockLost(f"{self.kind} {self.name!r} was lost: {reason}")
        with self._state:
            self._granted(grant, sent, ttl_s)

    def _end(self, keep: float) -> Steps[bool]:
        """Finish with the lease: release it now, or, when ``keep`` seconds of an at-least
        period remain, leave it in the store for those seconds and let it expire there (the
        singleton's ``at_least`` and ``latchkey run --at-least``). False if the lease had
        already ended (expired, released or taken)."""
        if keep <= 0.001 or self.lost or not self._caps.ttl:
            return (yield from self._release())
        if self._renewer is not None:
            yield unrenew(self)
        try:
            yield from self._extend(keep)
            return True
        except LockLost:
            return False
        finally:
            self._forget()

    def _renew_step(self) -> Steps[float | None]:
        """One renewal: extend the lease; return the seconds until the next one, or None
        when renewing must stop (the lease is lost: marked so, with the reason; or released
        meanwhile — a release does not wait for a renewal in flight, whose outcome is then
        no longer this lease's to record)."""
        owner = self._owner
        if owner is None:
            return None
        try:
            yield from self._extend()
            if self._owner != owner:
                return None
            self._renew_failure = None
            return self._renew_interval()
        except LockLost as exc:
            if self._owner != owner:
                return None
            yield from self._lose(str(exc))
            return None
        except LatchkeyError as exc:  # StoreUnavailable and the like: retry while time is left
            if self._owner != owner:
                return None
            self._renew_failure = str(exc)
            left = self.remaining()
            left = float("inf") if left is None else left
            if left <= 0:
                yield from self._lose(f"could not renew before the lease ended: {exc}")
                return None
            log.warning("renewing %r failed, retrying: %s", self.name, exc)
            return min(self._renew_interval(), max(left / 4, 0.05))

    def _renew_interval(self) -> float:
        """How long the renewer waits between renewals: a third of the lease the store last
        granted — the TTL, or less where the store grants less (a ZooKeeper lease is also
        bounded by its session's timeout)."""
        return self._granted_for / 3

    # -- internals ---------------------------------------------------------------------------

    def _granted(self, grant: Grant, sent: float, ttl: float) -> None:
        self.token = grant.token if grant.token is not None else self.token
        self.expires_at = grant.expires_at
        if self._caps.ttl:
            left = ttl if grant.remaining is None else min(ttl, grant.remaining)
            self._deadline = sent + left - drift_margin(ttl)
            self._granted_for = left
        else:
            self._deadline = None

    def _forget(self) -> None:
        with self._state:
            self._owner = None
            self._deadline = None
            self._lost_reason = None
            self.token = None
            self.expires_at = None
            self._grant = None
            observed, self._observed = self._observed, None
        if self._hold is not None:
            self._unhold()
        if observed is not None:
            _observe.ended(observed)

    def _unhold(self) -> None:
        """Take this lease out of the store object's record of this process's leases."""
        hold, self._hold = self._hold, None
        if hold is not None and self._holds is not None:
            self._holds.remove(self.name, hold)

    def _mark_lost(self, reason: str) -> None:
        with self._state:
            if self._owner is not None and self._lost_reason is None:
                self._lost_reason = reason
        self._unhold()

    def _lose(self, reason: str) -> Steps[None]:
        """The lease is known lost: mark it, log a WARNING (name, token, reason) and call
        ``on_lost(self)`` — once per lease, whoever learns it first (renewer or extend). An
        error raised by the callback is logged, never passed on to the renewer."""
        self._mark_lost(reason)
        with self._state:
            if self._owner is None or self._lost_told:
                return
            self._lost_told = True
            reason = self._lost_reason or reason
            observed, self._observed = self._observed, None
        if observed is not None:
            _observe.ended(observed)
        hooks = _observe.hooks
        if hooks is not None:
            hooks.lost(self)
        log.warning(
            "%s %r lost (token %s): %s", self.kind, self.name, self.token, reason,
            extra={"latchkey_name": self.name, "latchkey_token": self.token},
        )  # fmt: skip
        if self.on_lost is not None:
            try:
                yield user(self.on_lost, self)
            except Exception:
                log.exception("on_lost callback of %s %r failed", self.kind, self.name)

    def _busy_text(self) -> str:
        """Who keeps the name busy, as the last failed acquire saw it (for messages): for a
        semaphore, "all N slots taken; the soonest to end: held by …"."""
        if self.limit > 1:
            slots = f"all {self.limit} slots taken"
            if self.holder is None:
                return slots
            return f"{slots}; the soonest to end: {describe_holder(self.holder)}"
        return describe_holder(self.holder)

    def _timeout_error(self, wait: float | None) -> LockTimeout:
        waited = "" if not wait else f" after waiting {format_duration(wait)}"
        return LockTimeout(
            f"{self.kind} {self.name!r} is busy{waited}: {self._busy_text()}",
            name=self.name,
            holder=self.holder,
        )

    def _enter(self) -> Steps[None]:
        if not (yield from self._acquire()):
            raise self._timeout_error(self.wait)

    def __repr__(self) -> str:
        state = "lost" if self.lost else "held" if self.held else "free"
        token = f" token={self.token}" if self.token is not None else ""
        return f"<{type(self).__name__} {self.name!r} {state}{token}>"


#: How a background give-back retries (seconds): the first pause and the longest.
GIVE_BACK_FIRST, GIVE_BACK_CAP = 0.1, 2.0


#: A give-back: one owner-checked release (an operation), or steps that find what to release.
Undo = Op | Callable[[], Steps[Any]]


def _run_undo(undo: Undo) -> Steps[Any]:
    return (yield from undo()) if callable(undo) else (yield undo)


def give_back(release: Undo, ttl: float) -> Steps[None]:
    """Carry out ``release`` — an owner-checked ``release`` of one name, ``release_many``
    of a batch claim's names, or the steps that find and release a lease batch's rows —
    for a call that failed and may have taken them before its answer was lost: tried until
    a release gets an answer, or until the lease would have ended anyway. Run in the
    background (a thread or a task), so a store that stays unreachable costs the caller
    nothing."""
    until, pause = time.monotonic() + ttl, GIVE_BACK_FIRST
    while True:
        try:
            yield from _run_undo(release)
            return
        except StoreUnavailable:
            if time.monotonic() + pause >= until:
                return
        yield sleep(pause)
        pause = min(pause * 2, GIVE_BACK_CAP)


def after_failure(exc: BaseException, undo: Undo, ttl: float) -> Steps[NoReturn]:
    """The rule for a call that may grant and failed with ``exc`` (raised again at the end):
    after StoreUnavailable its answer may have been lost, so ``undo`` runs in the background
    (:func:`give_back`) and the caller has the error now; after a cancellation or an
    interruption in flight, at once (its own failure is not the one raised); another error
    of latchkey's granted nothing. Acquires, batch claims and row leases all follow it."""
    if isinstance(exc, StoreUnavailable):
        yield background(give_back(undo, ttl))
    elif not isinstance(exc, LatchkeyError):
        with contextlib.suppress(Exception):
            yield from _run_undo(undo)
    raise exc


def giving_back(request: Steps[T], undo: Undo, ttl: float) -> Steps[T]:
    """``request``, a call that may grant, under :func:`after_failure`'s rule (batch claims
    and row leases)."""
    try:
        return (yield from request)
    except BaseException as exc:
        yield from after_failure(exc, undo, ttl)
        raise  # (after_failure raises it)


def ask(op: Op) -> Steps[Any]:
    """One operation as steps (for :func:`giving_back`)."""
    return (yield op)
