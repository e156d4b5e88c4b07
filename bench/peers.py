"""The libraries people use today, measured the same way as latchkey (bench/.venv only).

Each peer is used as its documentation shows, with a 30 s lease where it has one, one lock
object per use, and its own default wait strategy (polling interval, signal list…). A peer whose
package did not install is listed with ``available() == False`` and skipped with a note.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import consensus  # noqa: F401  (the consensus and cluster stores' subjects register too)
from subjects import TTL, Handle, Spec, register


def available(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


class CallHandle:
    """A handle over any lock with ``acquire(...)``/``release()``; ``how`` maps a timeout to
    the library's acquire arguments."""

    def __init__(self, lock: Any, how: Any) -> None:
        self.lock, self.how = lock, how

    def acquire(self, timeout: float) -> bool:
        args, kwargs = self.how(timeout)
        try:
            return bool(self.lock.acquire(*args, **kwargs))
        except Exception as exc:
            if "Timeout" in type(exc).__name__:  # filelock, sherlock, portalocker raise on timeout
                return False
            raise

    def release(self) -> None:
        self.lock.release()


class _Peer:
    def close(self) -> None:
        pass


# -- Redis peers --------------------------------------------------------------------------------


class RedisPyLock(_Peer):
    def __init__(self, url: str) -> None:
        import redis

        self.r = redis.Redis.from_url(url)

    def make(self, name: str) -> Handle:
        lock = self.r.lock("redispy:" + name, timeout=TTL)  # polls every 0.1 s (its default)
        return CallHandle(lock, lambda t: ((), {"blocking": True, "blocking_timeout": t}))


class PythonRedisLock(_Peer):
    def __init__(self, url: str) -> None:
        import redis

        self.r = redis.Redis.from_url(url)

    def make(self, name: str) -> Handle:
        import redis_lock

        lock = redis_lock.Lock(self.r, "prl:" + name, expire=TTL)
        return CallHandle(lock, lambda t: ((), {"blocking": True, "timeout": min(t, TTL - 1)}))


class PotteryRedlock(_Peer):
    def __init__(self, url: str) -> None:
        import redis

        self.r = redis.Redis.from_url(url)

    def make(self, name: str) -> Handle:
        from pottery import Redlock

        lock = Redlock(key="pottery:" + name, masters={self.r}, auto_release_time=TTL)
        return CallHandle(lock, lambda t: ((), {"blocking": True, "timeout": t}))


class SherlockRedis(_Peer):
    def __init__(self, url: str) -> None:
        import redis

        self.r = redis.Redis.from_url(url)

    def make(self, name: str) -> Handle:
        import sherlock

        lock = sherlock.RedisLock("sherlock:" + name, client=self.r, expire=TTL, timeout=10)
        return CallHandle(lock, lambda t: ((), {"blocking": True}))


class SherlockMC(_Peer):
    def __init__(self, url: str) -> None:
        import pylibmc

        self.mc = pylibmc.Client([url.split("://", 1)[1]], binary=True)

    def make(self, name: str) -> Handle:
        import sherlock

        lock = sherlock.MCLock("sherlock:" + name, client=self.mc, expire=TTL, timeout=10)
        return CallHandle(lock, lambda t: ((), {"blocking": True}))


class Tooz(_Peer):
    """One tooz coordinator per process (as tooz users do); ``get_lock`` per use."""

    def __init__(self, url: str) -> None:
        from tooz import coordination

        self.coord = coordination.get_coordinator(url, f"bench-{os.getpid()}".encode())
        self.coord.start()

    def make(self, name: str) -> Handle:
        lock = self.coord.get_lock(("tooz:" + name).encode())
        return CallHandle(lock, lambda t: ((), {"blocking": t}))

    def close(self) -> None:
        self.coord.stop()


class Pals(_Peer):
    def __init__(self, url: str) -> None:
        import pals

        self.locker = pals.Locker("bench", url)

    def make(self, name: str) -> Handle:
        lock = self.locker.lock("pals:" + name)
        return CallHandle(
            lock, lambda t: ((), {"blocking": True, "acquire_timeout": int(t * 1000)})
        )


class FileLockPeer(_Peer):
    def __init__(self, directory: str) -> None:
        self.dir = directory
        os.makedirs(directory, exist_ok=True)

    def make(self, name: str) -> Handle:
        import filelock

        lock = filelock.FileLock(os.path.join(self.dir, name.replace(":", "_") + ".lock"))
        return CallHandle(lock, lambda t: ((), {"timeout": t}))


class PortalockerPeer(_Peer):
    def __init__(self, directory: str) -> None:
        self.dir = directory
        os.makedirs(directory, exist_ok=True)

    def make(self, name: str) -> Handle:
        import portalocker

        path = os.path.join(self.dir, name.replace(":", "_") + ".lock")
        lock = portalocker.Lock(path, timeout=10, fail_when_locked=False)
        return CallHandle(lock, lambda t: ((), {}))


def _tooz_mysql(env: dict[str, str]) -> str:
    return env["mysql"].replace("mysql://", "mysql://", 1)


PEERS = [
    # key, store, label, module needed, builder
    ("redis/redis-py", "redis", "redis-py Lock", "redis",
     lambda env: RedisPyLock(env["redis"])),
    ("redis/python-redis-lock", "redis", "python-redis-lock", "redis_lock",
     lambda env: PythonRedisLock(env["redis"])),
    ("redis/pottery", "redis", "pottery Redlock (1 master)", "pottery",
     lambda env: PotteryRedlock(env["redis"])),
    ("redis/sherlock", "redis", "sherlock RedisLock", "sherlock",
     lambda env: SherlockRedis(env["redis"])),
    ("redis/tooz", "redis", "tooz redis", "tooz",
     lambda env: Tooz(env["redis"].rsplit("/", 1)[0])),
    ("postgresql/pals", "postgresql", "pals (advisory, SQLAlchemy pool)", "pals",
     lambda env: Pals(env["postgresql"])),
    ("postgresql/tooz", "postgresql", "tooz postgresql (advisory)", "psycopg2",
     lambda env: Tooz(env["postgresql"])),
    ("mysql/tooz", "mysql", "tooz mysql (GET_LOCK)", "tooz",
     lambda env: Tooz(_tooz_mysql(env))),
    ("memcached/sherlock", "memcached", "sherlock MCLock", "pylibmc",
     lambda env: SherlockMC(env["memcached"])),
    ("memcached/tooz", "memcached", "tooz memcached", "tooz",
     lambda env: Tooz(env["memcached"])),
    ("etcd/tooz", "etcd", "tooz etcd3gw", "etcd3gw",
     lambda env: Tooz(env["etcd"].replace("etcd://", "etcd3+http://", 1))),
    ("zookeeper/tooz", "zookeeper", "tooz zookeeper (kazoo Lock)", "kazoo",
     lambda env: Tooz(env["zookeeper"])),
    ("local/tooz-file", "local", "tooz file", "tooz",
     lambda env: Tooz(f"file://{env['tmp']}/tooz")),
    ("local/filelock", "local", "filelock", "filelock",
     lambda env: FileLockPeer(f"{env['tmp']}/filelock")),
    ("local/portalocker", "local", "portalocker", "portalocker",
     lambda env: PortalockerPeer(f"{env['tmp']}/portalocker")),
]  # fmt: skip

MISSING: dict[str, str] = {}
for _key, _store, _label, _module, _build in PEERS:
    if (_module != "tooz" and not available(_module)) or (not available("tooz") and "tooz" in _key):
        MISSING[_key] = f"{_label}: package not installed in bench/.venv ({_module})"
        continue
    register(Spec(_key, _store, _label, "peer", _build))
