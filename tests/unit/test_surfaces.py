"""The sync and asyncio APIs match name for name and signature for signature, and the public
names come from one sorted ``__all__``."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

import latchkey

PAIRS = [
    (latchkey.Store, latchkey.AsyncStore),
    (latchkey.Lock, latchkey.AsyncLock),
    (latchkey.Semaphore, latchkey.AsyncSemaphore),
    (latchkey.Claim, latchkey.AsyncClaim),
    (latchkey.Record, latchkey.AsyncRecord),
    (latchkey.Rows, latchkey.AsyncRows),
    (latchkey.TakeBatch, latchkey.AsyncTakeBatch),
    (latchkey.LeaseBatch, latchkey.AsyncLeaseBatch),
]
#: Where the twins differ on purpose: closing (``close`` / ``aclose``) and the context
#: protocol (``__enter__`` / ``__aenter__``); a claim is also awaitable.
RENAMED = {"close": "aclose", "__enter__": "__aenter__", "__exit__": "__aexit__"}
ASYNC_ONLY = {"__await__"}


def _public(cls: type) -> dict[str, Any]:
    names = {n for n in dir(cls) if not n.startswith("_")}
    names |= {n for n in ("__enter__", "__exit__", "__aenter__", "__aexit__") if hasattr(cls, n)}
    return {n: inspect.getattr_static(cls, n) for n in names}


def _signature(member: Any) -> inspect.Signature | None:
    if isinstance(member, property):
        return None
    fn = member.__func__ if isinstance(member, staticmethod | classmethod) else member
    if not callable(fn):
        return None
    sig = inspect.signature(fn)
    return sig.replace(return_annotation=inspect.Signature.empty)


@pytest.mark.parametrize(("sync", "asyn"), PAIRS, ids=[p[0].__name__ for p in PAIRS])
def test_every_public_name_has_its_twin_with_the_same_signature(sync: type, asyn: type) -> None:
    sync_members, async_members = _public(sync), _public(asyn)
    expected = {RENAMED.get(n, n) for n in sync_members}
    assert expected == set(async_members) - ASYNC_ONLY
    for name, member in sync_members.items():
        twin = async_members[RENAMED.get(name, name)]
        assert _signature(member) == _signature(twin), name
        if callable(member) and not isinstance(member, property) and not name.startswith("__"):
            # what reaches the store is awaited in the twin; what does not is not
            reaches_store = inspect.iscoroutinefunction(twin)
            assert reaches_store == (name in _AWAITED.get(sync.__name__, set())), name


_AWAITED = {
    "Store": {
        "is_free", "inspect", "force_release", "purge_expired", "update", "now", "check",
        "init", "close",
    },
    "Lock": {"acquire", "release", "extend"},
    "Semaphore": {"acquire", "release", "extend"},
    "Claim": {"release", "release_all"},
    "Record": {"get", "set", "delete", "update"},
    "Rows": {"status", "notify"},
    "TakeBatch": {"execute"},
    "LeaseBatch": {"done", "execute"},
}  # fmt: skip


def test_all_is_sorted_and_complete() -> None:
    assert latchkey.__all__ == sorted(latchkey.__all__)
    for name in latchkey.__all__:
        assert getattr(latchkey, name) is not None


def test_the_sync_api_does_not_import_asyncio() -> None:
    import subprocess
    import sys

    code = "import sys, latchkey; latchkey.connect('memory://'); print('asyncio' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_metrics_and_tracing_switches_are_public_and_import_nothing_until_used() -> None:
    import subprocess
    import sys

    switches = {"enable_metrics", "disable_metrics", "enable_tracing", "disable_tracing"}
    assert switches <= set(latchkey.__all__)
    code = (
        "import sys, latchkey; s = latchkey.connect('memory://'); s.lock('x').acquire(); "
        "print(sorted(m for m in ('prometheus_client', 'opentelemetry') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
