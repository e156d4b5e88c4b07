"""Batch claims (seed 000): take what is free of many names at once, with one deadline.

The rules for both :class:`latchkey.Claim` and :class:`latchkey.AsyncClaim`: names validated
and de-duplicated in input order, one owner for the batch, one local deadline, releases only
of what this claim still holds, and a claim that failed gives back whatever it may have taken
(as a failed acquire does, :mod:`latchkey._core.lease`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from datetime import datetime
from typing import Any, TypeVar

from latchkey import _observe
from latchkey._core.lease import ask, drift_margin, giving_back
from latchkey._core.ops import Op, Steps, call
from latchkey._names import validate_name
from latchkey._owner import Owner, new_owner_token
from latchkey._types import Grant

log = logging.getLogger("latchkey")
T = TypeVar("T")


class ClaimCore:
    """The state of one batch claim. Not public: see :class:`latchkey.Claim`."""

    #: While metrics count its names as held: (recorder, when taken); see _observe.
    _observed: Any = None

    def __init__(
        self, store: Any, names: Iterable[str], *, ttl: float, metadata: Mapping[str, Any]
    ) -> None:
        #: The Store (or AsyncStore) that made this claim.
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
        self._names = ordered
        self._metadata = metadata
        self._owner = new_owner_token()
        self._deadline = 0.0
        #: Names taken, in input order.
        self.acquired: list[str] = []
        #: Names someone else holds, in input order.
        self.busy: list[str] = []
        #: Fencing token of each acquired name (None where the store has no fencing).
        self.tokens: dict[str, int | None] = {}
        #: When the batch's leases end, by the store's clock (None if nothing was acquired).
        self.deadline: datetime | None = None
        self._held: set[str] = set()

    def _take(self) -> Steps[None]:
        hooks = _observe.hooks
        steps = self._take_steps()
        return steps if hooks is None else hooks.claim(self, steps)

    def _take_steps(self) -> Steps[None]:
        ordered, ttl = self._names, self.ttl
        sent = time.monotonic()
        grants: dict[str, Grant] = {}
        if ordered:
            info = Owner.current(self._metadata).to_json()
            owner = self._owner
            # Part of the batch may have been taken before a failure (one server's or one
            # slot's part, or all of it with the answer lost): every name is given back,
            # owner-checked; what even that cannot reach ends by its TTL, none of it is
            # reported held.
            grants = yield from giving_back(
                ask(call("claim", ordered, owner, info, ttl)),
                call("release_many", ordered, owner),
                ttl,
            )
        self._deadline = sent + ttl - drift_margin(ttl)
        self.acquired = [name for name in ordered if name in grants]
        self.busy = [name for name in ordered if name not in grants]
        self.tokens = {name: grants[name].token for name in self.acquired}
        expiries = [g.expires_at for g in grants.values() if g.expires_at is not None]
        self.deadline = min(expiries) if expiries else None
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

    def _release(self, name: str) -> Steps[bool]:
        if name not in self._held:
            return _nothing(False)
        self._held.discard(name)
        return self._give_back([name], call("release", name, self._owner))

    def _release_all(self) -> Steps[int]:
        names = self.held
        self._held.clear()
        if not names:
            return _nothing(0)
        return self._give_back(names, call("release_many", names, self._owner))

    def _give_back(self, names: list[str], op: Op) -> Steps[Any]:
        """Release ``names`` (no longer in ``_held``) with the one store call ``op``."""
        if self._observed is not None:
            _observe.ended(self._observed, len(names))
            if not self._held:
                self._observed = None
        hooks = _observe.hooks
        steps = _one(op)
        return steps if hooks is None else hooks.claim_release(self, names, steps)

    def __iter__(self) -> Iterator[str]:
        return iter(self.acquired)

    def __len__(self) -> int:
        return len(self.acquired)

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} acquired={len(self.acquired)} busy={len(self.busy)} "
            f"held={len(self._held)}>"
        )


def _one(op: Op) -> Steps[Any]:
    return (yield op)


def _nothing(value: T) -> Steps[T]:
    return value
    yield  # a generator that asks for nothing
