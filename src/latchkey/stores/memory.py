"""``memory://[namespace]``: leases in this process's memory, for tests and examples.

Every ``connect("memory://x")`` in one process shares namespace ``x``; other processes see
nothing. The store's clock is this process's wall clock. Releases wake waiters at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone

from latchkey._owner import Owner
from latchkey._types import Busy, Grant, Holder, LockInfo
from latchkey._url import StoreURL
from latchkey.stores.base import (
    Backend,
    Capabilities,
    EventWaiter,
    Waiter,
)


@dataclass
class _Lease:
    owner: str
    owner_info: str
    token: int
    acquired: float
    expires: float

    def holder(self) -> Holder:
        return Holder(
            self.token, Owner.from_json(self.owner_info), _dt(self.acquired), _dt(self.expires)
        )


@dataclass
class _Space:
    mutex: threading.Lock = field(default_factory=threading.Lock)
    leases: dict[str, dict[int, _Lease]] = field(default_factory=dict)
    fences: dict[str, int] = field(default_factory=dict)
    records: dict[str, tuple[str, int]] = field(default_factory=dict)
    #: Per name, how to wake each waiter (a threading.Event's set, or a loop's call_soon).
    waiters: dict[str, set[Callable[[], object]]] = field(default_factory=dict)


_SPACES: dict[str, _Space] = {}
_SPACES_MUTEX = threading.Lock()


def _dt(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, timezone.utc)


class MemoryBackend(Backend):
    scheme = "memory"
    capabilities = Capabilities(durable=False, push=True, multiprocess=False)

    def __init__(self, url: StoreURL) -> None:
        super().__init__(url)
        key = ",".join(h for h, _ in url.hosts) + url.path
        with _SPACES_MUTEX:
            self._space = _SPACES.setdefault(key, _Space())

    def _live(self, name: str, now: float) -> dict[int, _Lease]:
        slots = self._space.leases.get(name, {})
        for slot in [s for s, lease in slots.items() if lease.expires <= now]:
            del slots[slot]
        return slots

    def _notify(self, name: str) -> None:
        for wake in self._space.waiters.get(name, ()):
            wake()

    def acquire(
        self, name: str, owner: str, owner_info: str, ttl: float, limit: int = 1
    ) -> Grant | Busy:
        with self._space.mutex:
            now = time.time()
            slots = self._live(name, now)
            for lease in slots.values():
                if lease.owner == owner:  # already ours: that lease, as it is
                    return Grant(lease.token, _dt(lease.expires), lease.expires - now)
            free = next((s for s in range(limit) if s not in slots), None)
            if free is None:
                soonest = min(slots.values(), key=lambda lease: lease.expires)
                return Busy(len(slots), soonest.holder(), soonest.expires - now)
            token = self._space.fences.get(name, 0) + 1
            self._space.fences[name] = token
            lease = _Lease(owner, owner_info, token, now, now + ttl)
            self._space.leases.setdefault(name, {})[free] = lease
            return Grant(token, _dt(lease.expires))

    def _find(self, name: str, owner: str) -> tuple[int, _Lease] | None:
        for slot, lease in self._space.leases.get(name, {}).items():
            if lease.owner == owner:
                return slot, lease
        return None

    def release(self, name: str, owner: str) -> bool:
        with self._space.mutex:
            found = self._find(name, owner)
            if found is None:
                return False
            slot, lease = found
            del self._space.leases[name][slot]
            self._notify(name)
            return lease.expires > time.time()

    def extend(self, name: str, owner: str, ttl: float) -> Grant | None:
        with self._space.mutex:
            now = time.time()
            found = self._find(name, owner)
            if found is None or found[1].expires <= now:
                return None
            found[1].expires = now + ttl
            return Grant(found[1].token, _dt(found[1].expires))

    def claim(
        self, names: Sequence[str], owner: str, owner_info: str, ttl: float
    ) -> dict[str, Grant]:
        grants: dict[str, Grant] = {}
        for name in names:
            result = self.acquire(name, owner, owner_info, ttl)
            if isinstance(result, Grant):
                grants[name] = result
        return grants

    def inspect(self, name: str) -> LockInfo | None:
        with self._space.mutex:
            slots = self._live(name, time.time())
            if not slots:
                return None
            leases = sorted(slots.values(), key=lambda lease: (lease.acquired, lease.token))
            return LockInfo(name, tuple(lease.holder() for lease in leases))

    def list(self, prefix: str = "") -> Iterator[LockInfo]:
        with self._space.mutex:
            names = sorted(n for n in self._space.leases if n.startswith(prefix))
        for name in names:
            info = self.inspect(name)
            if info is not None:
                yield info

    def force_release(self, name: str) -> bool:
        with self._space.mutex:
            live = bool(self._live(name, time.time()))
            self._space.leases.pop(name, None)
            self._notify(name)
            return live

    def purge_expired(self, limit: int | None = None) -> int:
        with self._space.mutex:
            now = time.time()
            count = 0
            for name in list(self._space.leases):
                if limit is not None and count >= limit:
                    break
                slots = self._space.leases[name]
                expired = [s for s, lease in slots.items() if lease.expires <= now]
                count += len(expired)
                for slot in expired:
                    del slots[slot]
                if not slots:
                    del self._space.leases[name]
            return count

    def record_get(self, name: str) -> tuple[str | None, int]:
        with self._space.mutex:
            return self._space.records.get(name, (None, 0))

    def record_set(self, name: str, value: str, version: int) -> int | None:
        with self._space.mutex:
            current = self._space.records.get(name, (None, 0))[1]
            if current != version:
                return None
            self._space.records[name] = (value, version + 1)
            return version + 1

    def record_delete(self, name: str, version: int) -> bool:
        with self._space.mutex:
            if self._space.records.get(name, (None, 0))[1] != version or version == 0:
                return False
            del self._space.records[name]
            return True

    def subscribe(self, name: str) -> Waiter:
        event = threading.Event()
        return EventWaiter(event, self._listen(name, event.set))

    def _listen(self, name: str, wake: Callable[[], object]) -> Callable[[], None]:
        """Call ``wake`` on every release of ``name`` until the returned function is called."""
        with self._space.mutex:
            self._space.waiters.setdefault(name, set()).add(wake)

        def unsubscribe() -> None:
            with self._space.mutex:
                waiting = self._space.waiters.get(name)
                if waiting is not None:
                    waiting.discard(wake)
                    if not waiting:
                        del self._space.waiters[name]

        return unsubscribe

    def now(self) -> datetime:
        return _dt(time.time())
