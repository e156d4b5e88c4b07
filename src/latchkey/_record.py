"""Versioned records (seed 003's optimistic lock): read a value and its version, write only if
nobody wrote in between."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from latchkey.errors import Conflict, InvalidValue

if TYPE_CHECKING:
    from latchkey._store import Store


def encode(value: Any, name: str) -> str:
    try:
        return json.dumps(value, allow_nan=False, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise InvalidValue(f"record {name!r}: value is not JSON ({exc})") from None


class Record:
    """A JSON value with a version that increases by one on every write.

    ``get()`` returns ``(None, 0)`` for a record never written. ``set(value, version=v)``
    writes only if the version is still ``v`` and raises :class:`Conflict` otherwise.

    .. versionadded:: 0.1
    """

    def __init__(self, store: Store, name: str) -> None:
        self.store = store
        self.name = name

    def get(self) -> tuple[Any, int]:
        text, version = self.store.backend.record_get(self.name)
        return (None if text is None else json.loads(text)), version

    def set(self, value: Any, *, version: int) -> int:
        """Write ``value`` if the record is still at ``version`` (0: absent); return the new
        version."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise InvalidValue(f"record {self.name!r}: version must be an int ≥ 0, got {version!r}")
        new = self.store.backend.record_set(self.name, encode(value, self.name), version)
        if new is None:
            raise Conflict(f"record {self.name!r} changed since version {version}")
        return new

    def delete(self, *, version: int) -> None:
        """Delete the record if it is still at ``version``; raise :class:`Conflict` if not."""
        if not self.store.backend.record_delete(self.name, version):
            raise Conflict(f"record {self.name!r} changed since version {version}")

    def update(self, fn: Callable[[Any], Any], *, retries: int = 10) -> Any:
        """Read, apply ``fn``, write back; on a conflict read again (up to ``retries`` more
        times, with a short jittered pause). Returns the value written."""
        if retries < 0:
            raise InvalidValue(f"retries must be ≥ 0, got {retries!r}")
        for attempt in range(retries + 1):
            value, version = self.get()
            new = fn(value)
            try:
                self.set(new, version=version)
                return new
            except Conflict:
                if attempt == retries:
                    raise Conflict(
                        f"record {self.name!r} kept changing: gave up after {retries + 1} tries"
                    ) from None
                time.sleep(random.uniform(0, 0.002 * 2 ** min(attempt, 6)))
        raise AssertionError("unreachable")

    def __repr__(self) -> str:
        return f"<Record {self.name!r}>"
