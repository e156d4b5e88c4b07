"""What the rules ask the shells to do: the operations a core generator yields.

A core operation (``latchkey._core.lease``, ``.claim``, ``.record``, ``.store``) is a generator.
It yields an :data:`Op` whenever it needs something done outside pure computation — a store
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
BACKGROUND = 5
"""Run the core generator ``target`` to its end without waiting for it (on a daemon thread, or
as a task of the loop) and ignore how it ends: a give-back that must not hold the caller up."""


#: One request from the rules to a runner: ``(kind, target, method, args)``, plain data (a
#: tuple: one is built for every store call, and a tuple is the cheapest thing to build).
Op = tuple[int, Any, str, tuple[Any, ...]]


#: What a core generator is: it yields Ops, receives their answers, returns a T.
Steps = Generator[Op, Any, T]


def call(method: str, *args: Any) -> Op:
    """The store primitive ``method`` (see :class:`latchkey.stores.base.Backend`)."""
    return (CALL, None, method, args)


def on(target: Any, method: str, *args: Any) -> Op:
    """``method`` on an object the store returned (a waiter)."""
    return (CALL, target, method, args)


def sleep(seconds: float) -> Op:
    return (SLEEP, None, "", (seconds,))


def user(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Op:
    if kwargs:
        return (USER, lambda: fn(*args, **kwargs), "", ())
    return (USER, fn, "", args)


def background(steps: Steps[Any]) -> Op:
    return (BACKGROUND, steps, "", ())


def renew(lease: Any) -> Op:
    return (RENEW, lease, "", ())


def unrenew(lease: Any) -> Op:
    return (UNRENEW, lease, "", ())
