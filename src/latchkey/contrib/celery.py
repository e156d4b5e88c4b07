"""Celery: a task that runs at most once at a time per argument set.

::

    from celery import Celery
    from latchkey.contrib.celery import Singleton

    app = Celery("app", broker="redis://localhost/0")
    app.conf.latchkey_url = "redis://localhost/0"

    @app.task(base=Singleton, lock_keys=["user_id"])
    def recalc(user_id: int, force: bool = False) -> None: ...

When a worker starts the task it takes the lock ``celery:<task name>:<key>``, where the key
is the JSON of the chosen arguments (``lock_keys``; all of them when not set). The lease is
renewed in the background while the task runs and released when the task returns, fails or
calls ``self.retry()`` (a retry runs later as a new attempt, which takes the lock again). A
run that finds the lock held is a *duplicate*: with ``on_busy="skip"`` (the default) it
returns None at once and logs one line at INFO; with ``on_busy="retry"`` it is retried like
``self.retry()`` (the task's ``default_retry_delay`` and ``max_retries``, or
``busy_countdown``). A store that cannot be reached raises
:class:`~latchkey.StoreUnavailable`: the task fails (or is retried, with ``autoretry_for``).

This is a guard on *running*, not on queueing: duplicates still enter the queue, and are
skipped when they run while another holds the lock.

.. versionadded:: 0.2
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import threading
from collections.abc import Sequence
from contextvars import ContextVar
from typing import Any

from celery import Task, signals

from latchkey._durations import Duration
from latchkey._lock import Lock
from latchkey._store import Store, connect
from latchkey.errors import ConfigError, StoreUnavailable

__all__ = ["Singleton", "close_stores", "lock_name", "store_for"]

log = logging.getLogger("latchkey.contrib.celery")

_stores: dict[str | None, Store] = {}
_current_lock: ContextVar[Lock | None] = ContextVar("latchkey_celery_lock", default=None)
_stores_lock = threading.Lock()
_MAX_NAME = 255  # bytes of UTF-8, latchkey's limit for a name


def store_for(url: str | None) -> Store:
    """The store of ``url`` (None: ``LATCHKEY_URL``, else SQLite in the user's state
    directory), opened once per process and shared by its tasks."""
    with _stores_lock:
        store = _stores.get(url)
        if store is None:
            store = _stores[url] = connect(url)
        return store


def close_stores(**_: Any) -> None:
    """Close the stores :func:`store_for` opened (run when a worker or one of its pool's
    processes shuts down)."""
    with _stores_lock:
        stores = list(_stores.values())
        _stores.clear()
    for store in stores:
        store.close()


signals.worker_process_shutdown.connect(close_stores, weak=False)
signals.worker_shutdown.connect(close_stores, weak=False)


def lock_name(task_name: str, arguments: dict[str, Any]) -> str:
    """``celery:<task name>:<JSON of the arguments>``; the same arguments give the same name
    whatever their order. A name longer than latchkey's 255 bytes ends with the SHA-256 of
    the JSON instead."""
    key = json.dumps(arguments, sort_keys=True, separators=(",", ":"), default=repr)
    name = f"celery:{task_name}:{key}"
    if len(name.encode()) <= _MAX_NAME:
        return name
    digest = hashlib.sha256(key.encode()).hexdigest()
    name = f"celery:{task_name}:sha256:{digest}"
    if len(name.encode()) <= _MAX_NAME:
        return name
    return "celery:sha256:" + hashlib.sha256(f"{task_name}\0{key}".encode()).hexdigest()


class Singleton(Task):  # type: ignore[misc]  # Celery has no type hints
    """A Celery task base: at most one run at a time per argument set (see the module).

    Options, given to ``@app.task(base=Singleton, …)`` or set on a subclass:

    - ``lock_keys``: the names of the arguments that make up the key (default: all);
    - ``lock_ttl``: the lease, renewed while the task runs ("1m"): how long the lock of a
      worker that was killed outlives it;
    - ``lock_wait``: how long a duplicate waits for the lock before it counts as busy (0);
    - ``on_busy``: ``"skip"`` (return None, log at INFO) or ``"retry"``;
    - ``busy_countdown``: seconds before a busy run is retried (default: Celery's
      ``default_retry_delay``);
    - ``latchkey_url``: the store (default: the app's ``latchkey_url`` setting, else
      ``LATCHKEY_URL``…).
    """

    abstract = True
    lock_keys: Sequence[str] | None = None
    lock_ttl: Duration = "1m"
    lock_wait: Duration = 0
    on_busy: str = "skip"
    busy_countdown: float | None = None
    latchkey_url: str | None = None

    @property
    def latchkey_store(self) -> Store:
        """The store this task's locks live in."""
        url = self.latchkey_url or self.app.conf.get("latchkey_url")
        return store_for(url)

    @property
    def current_lock(self) -> Lock | None:
        """The lock the running task holds (its ``token`` fences the task's writes); None
        outside a run."""
        return _current_lock.get()

    def lock_name_for(self, args: Sequence[Any], kwargs: dict[str, Any]) -> str:
        """The lock name of a call with these arguments."""
        try:
            bound = inspect.signature(self.run).bind(*args, **kwargs)
        except TypeError as exc:
            raise ConfigError(f"task {self.name}: {exc}") from None
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        if self.lock_keys is not None:
            missing = [k for k in self.lock_keys if k not in arguments]
            if missing:
                raise ConfigError(
                    f"task {self.name}: lock_keys {missing} are not arguments of the task "
                    f"(it takes {sorted(arguments)})"
                )
            arguments = {k: arguments[k] for k in self.lock_keys}
        return lock_name(self.name, arguments)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.on_busy not in ("skip", "retry"):
            raise ConfigError(
                f"task {self.name}: on_busy must be 'skip' or 'retry', got {self.on_busy!r}"
            )
        name = self.lock_name_for(args, kwargs)
        lock = self.latchkey_store.lock(
            name,
            ttl=self.lock_ttl,
            wait=self.lock_wait,
            renew=True,
            metadata={"task": self.name, "task_id": self.request.id},
        )
        if not lock.acquire():
            return self._busy(name)
        held = _current_lock.set(lock)  # not on self.request: a retry serializes that
        try:
            return super().__call__(*args, **kwargs)
        finally:
            _current_lock.reset(held)
            self._release(lock)

    def retry(self, *args: Any, **kwargs: Any) -> Any:
        """Celery's ``retry``, with the lock released first: ``retry`` sends the next attempt
        before it raises, and a worker that picks that attempt up while this one still held
        the lock would skip it as a duplicate of itself."""
        lock = _current_lock.get()
        if lock is not None:
            self._release(lock)
        return super().retry(*args, **kwargs)

    def _release(self, lock: Lock) -> None:
        try:
            lock.release()  # a lease no longer held is left alone (False)
        except StoreUnavailable as exc:  # the lease ends by its TTL
            log.warning("task %s: releasing %r failed: %s", self.name, lock.name, exc)

    def _busy(self, name: str) -> Any:
        holder = _describe_holder(self.latchkey_store, name)
        if self.on_busy == "retry":
            log.info(
                "task %s[%s]: %r is held (%s): retrying later",
                self.name,
                self.request.id,
                name,
                holder,
            )
            raise self.retry(countdown=self.busy_countdown)
        log.info("task %s[%s]: skipped, %r is held (%s)", self.name, self.request.id, name, holder)
        return None


def _describe_holder(store: Store, name: str) -> str:
    """Who holds ``name``, for the log line of a duplicate (best effort: one more read)."""
    try:
        info = store.inspect(name)
    except StoreUnavailable:
        return "holder unknown: store unavailable"
    if info is None:
        return "released since"
    owner = info.owner
    return f"by task {owner.metadata.get('task_id')} in pid {owner.pid} on {owner.host}"
