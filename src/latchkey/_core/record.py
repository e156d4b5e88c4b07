"""Versioned records (seed 003's optimistic lock): read a value and its version, write only if
nobody wrote in between; the read-modify-write loop with jittered retries. The rules for
:class:`latchkey.Record` and :class:`latchkey.AsyncRecord`."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

from latchkey._core.ops import Steps, call, sleep, user
from latchkey.errors import Conflict, InvalidValue


def encode(value: Any, name: str) -> str:
    try:
        return json.dumps(value, allow_nan=False, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise InvalidValue(f"record {name!r}: value is not JSON ({exc})") from None


def check_retries(retries: object) -> int:
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise InvalidValue(f"retries must be an int ≥ 0, got {retries!r}")
    return retries


class RecordCore:
    """A JSON value with a version that increases by one on every write. Not public: see
    :class:`latchkey.Record`."""

    def __init__(self, store: Any, name: str) -> None:
        #: The Store (or AsyncStore) that made this record.
        self.store = store
        self.name = name

    def _get(self) -> Steps[tuple[Any, int]]:
        text, version = yield call("record_get", self.name)
        return (None if text is None else json.loads(text)), version

    def _set(self, value: Any, version: int) -> Steps[int]:
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise InvalidValue(f"record {self.name!r}: version must be an int ≥ 0, got {version!r}")
        new = yield call("record_set", self.name, encode(value, self.name), version)
        if new is None:
            raise Conflict(f"record {self.name!r} changed since version {version}")
        return new  # type: ignore[no-any-return]

    def _delete(self, version: int) -> Steps[None]:
        if not (yield call("record_delete", self.name, version)):
            raise Conflict(f"record {self.name!r} changed since version {version}")

    def _update(self, fn: Callable[[Any], Any], retries: int) -> Steps[Any]:
        check_retries(retries)
        for attempt in range(retries + 1):
            value, version = yield from self._get()
            new = yield user(fn, value)
            try:
                yield from self._set(new, version)
                return new
            except Conflict:
                if attempt == retries:
                    raise Conflict(
                        f"record {self.name!r} kept changing: gave up after {retries + 1} tries"
                    ) from None
                yield sleep(random.uniform(0, 0.002 * 2 ** min(attempt, 6)))
        raise AssertionError("unreachable")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"
