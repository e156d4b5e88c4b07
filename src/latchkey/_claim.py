"""Batch claims (seed 000): take what is free of many names at once, with one deadline."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from datetime import datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any

from latchkey._lock import drift_margin
from latchkey._names import validate_name
from latchkey._owner import Owner, new_owner_token

if TYPE_CHECKING:
    from latchkey._store import Store

log = logging.getLogger("latchkey")


class Claim:
    """The names a batch claim took (``acquired``, in input order) and the ones it skipped
    because someone else holds them (``busy``). All leases share one TTL and one deadline.

    Use as a context manager to release whatever is left at the end. Iterating a claim yields
    the acquired names. Created by :meth:`latchkey.Store.claim`.

    .. versionadded:: 0.1
    """

    def __init__(
        self, store: Store, names: Iterable[str], *, ttl: float, metadata: Mapping[str, Any]
    ) -> None:
        self.store = store
        self.ttl = ttl
        ordered: list[str] = []
        seen: set[str] = set()
        duplicates: list[str] = []
        for name in names:
            validate_name(name)
            if name in seen:
                duplicates.append(name)
            else:
                seen.add(name)
                ordered.append(name)
        #: Names given more than once (each was claimed once).
        self.duplicates = duplicates
        if duplicates:
            log.warning(
                "claim of %d names had %d duplicates (claimed once each): %r",
                len(ordered),
                len(duplicates),
                duplicates[:5],
            )
        self._owner = new_owner_token()
        sent = time.monotonic()
        grants = (
            store.backend.claim(ordered, self._owner, Owner.current(metadata).to_json(), ttl)
            if ordered
            else {}
        )
        self._deadline = sent + ttl - drift_margin(ttl)
        #: Names taken, in input order.
        self.acquired = [name for name in ordered if name in grants]
        #: Names someone else holds, in input order.
        self.busy = [name for name in ordered if name not in grants]
        #: Fencing token of each acquired name (None where the store has no fencing).
        self.tokens = {name: grants[name].token for name in self.acquired}
        expiries = [g.expires_at for g in grants.values() if g.expires_at is not None]
        #: When the batch's leases end, by the store's clock (None if nothing was acquired).
        self.deadline: datetime | None = min(expiries) if expiries else None
        self._held = set(self.acquired)

    def remaining(self) -> float:
        """Seconds left before the batch deadline, by our own clock (safe side)."""
        return max(0.0, self._deadline - time.monotonic())

    @property
    def expired(self) -> bool:
        """True once the deadline passed: stop working on the batch."""
        return time.monotonic() >= self._deadline

    @property
    def held(self) -> list[str]:
        """Acquired names not released yet, in input order."""
        return [name for name in self.acquired if name in self._held]

    def release(self, name: str) -> bool:
        """Release one acquired name; True if its lease was still live."""
        if name not in self._held:
            return False
        self._held.discard(name)
        return self.store.backend.release(name, self._owner)

    def release_all(self) -> int:
        """Release every name still held, in a constant number of round trips."""
        names = self.held
        self._held.clear()
        return self.store.backend.release_many(names, self._owner) if names else 0

    def __iter__(self) -> Iterator[str]:
        return iter(self.acquired)

    def __len__(self) -> int:
        return len(self.acquired)

    def __enter__(self) -> Claim:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release_all()

    def __repr__(self) -> str:
        return f"<Claim acquired={len(self.acquired)} busy={len(self.busy)} held={len(self._held)}>"
