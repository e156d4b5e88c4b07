"""What the rules ask the shells to do: the operations a core generator yields.

A core operation (``latchkey._core.lease``, ``.claim``, ``.record``, ``.store``) is a generator.
It yields an :class:`Op` whenever it needs something done outside pure computation — a store
primitive called, a pause, the caller's own function run, a renewer started or stopped — and
receives the answer (or has the exception thrown in). It never performs I/O itself, so the same
generator is driven by the sync runner (:func:`latchkey._run.run`) and by the asyncio runner
(:func:`latchkey._async._run.arun`). Only how each operation is carried out differs.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any, TypeVar

T = TypeVar("T")

#: Op kinds.
CALL = 0
"""``target.method(*args)`` on the store's backend (target None) or on a waiter it returned.
Async runners await the result."""
SLEEP = 1
"""Pause ``args[0]`` seconds."""
USER = 2
"""Call the application's function ``target(*args)``; async runners await it if it returns an
awaitable (``store.update(fn)`` and the decorators accept sync and async functions)."""
RENEW = 3
"""Start the background renewer of the lease ``target`` (a thread, or a task in the loop)."""
UNRENEW = 4
"""Stop the renewer of the lease ``target``, if it has one, and wait until it has stopped."""


class Op:
    """One request from the rules to a runner. Plain data; see the kinds above."""

    __slots__ = ("args", "kind", "method", "target")

    def __init__(self, kind: int, target: Any = None, method: str = "", args: tuple[Any, ...] = ()):
        self.kind = kind
        self.target = target
        self.method = method
        self.args = args

    def __repr__(self) -> str:
        return f"<Op {self.kind} {self.method or self.target!r} {self.args!r}>"


#: What a core generator is: it yields Ops, receives their answers, returns a T.
Steps = Generator[Op, Any, T]


def call(method: str, *args: Any) -> Op:
    """The store primitive ``method`` (see :class:`latchkey.stores.base.Backend`)."""
    return Op(CALL, None, method, args)


def on(target: Any, method: str, *args: Any) -> Op:
    """``method`` on an object the store returned (a waiter)."""
    return Op(CALL, target, method, args)


def sleep(seconds: float) -> Op:
    return Op(SLEEP, None, "", (seconds,))


def user(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Op:
    if kwargs:
        return Op(USER, lambda: fn(*args, **kwargs))
    return Op(USER, fn, "", args)
