"""Record, the sync shell over the versioned-record rules (:mod:`latchkey._core.record`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from latchkey._core.record import RecordCore
from latchkey._run import run

if TYPE_CHECKING:
    from latchkey._store import Store


class Record(RecordCore):
    """A JSON value with a version that increases by one on every write.

    ``get()`` returns ``(None, 0)`` for a record never written. ``set(value, version=v)``
    writes only if the version is still ``v`` and raises :class:`Conflict` otherwise.

    .. versionadded:: 0.1
    """

    store: Store

    def get(self) -> tuple[Any, int]:
        return run(self._get(), self.store.backend)

    def set(self, value: Any, *, version: int) -> int:
        """Write ``value`` if the record is still at ``version`` (0: absent); return the new
        version."""
        return run(self._set(value, version), self.store.backend)

    def delete(self, *, version: int) -> None:
        """Delete the record if it is still at ``version``; raise :class:`Conflict` if not."""
        run(self._delete(version), self.store.backend)

    def update(self, fn: Callable[[Any], Any], *, retries: int = 10) -> Any:
        """Read, apply ``fn``, write back; on a conflict read again (up to ``retries`` more
        times, with a short jittered pause). Returns the value written."""
        return run(self._update(fn, retries), self.store.backend)
