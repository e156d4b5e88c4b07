"""Claim, the sync shell over the batch-claim rules (:mod:`latchkey._core.claim`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

from latchkey._core.claim import ClaimCore
from latchkey._run import run

if TYPE_CHECKING:
    from latchkey._store import Store


class Claim(ClaimCore):
    """The names a batch claim took (``acquired``, in input order) and the ones it skipped
    because someone else holds them (``busy``). All leases share one TTL and one deadline.

    Use as a context manager to release whatever is left at the end. Iterating a claim yields
    the acquired names. Created by :meth:`latchkey.Store.claim`, which takes the names at once.

    .. versionadded:: 0.1
    """

    def __init__(
        self, store: Store, names: Iterable[str], *, ttl: float, metadata: Mapping[str, Any]
    ) -> None:
        super().__init__(store, names, ttl=ttl, metadata=metadata)
        run(self._take(), store.backend)

    def release(self, name: str) -> bool:
        """Release one acquired name; True if its lease was still live."""
        return run(self._release(name), self.store.backend)

    def release_all(self) -> int:
        """Release every name still held, in a constant number of round trips."""
        return run(self._release_all(), self.store.backend)

    def __enter__(self) -> Claim:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release_all()
