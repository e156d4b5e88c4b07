"""Subjects of the consensus and cluster stores (issue 16): etcd, ZooKeeper, Redis Cluster and
Redis behind Sentinel — latchkey, and the raw client doing the same round trips.

Imported by :mod:`peers` (which every scenario process imports), so that the rows register
in :data:`subjects.REGISTRY` like the others. Servers: ``env["etcd"]``, ``env["zookeeper"]``,
``env["redis_cluster"]``, ``env["redis_sentinel"]`` (store URLs of tests/servers).

Raw subjects, per store (what latchkey sends, read from the store modules):

- etcd, A: latchkey's three requests — lease grant, its acquire transaction (create the
  holder key if the owner holds none, then slot 0 if free: a nested transaction, two puts on
  the lease), lease revoke — posted with one ``httpx.Client``; and the minimal lock (a
  one-key create-if-absent transaction), as bench/etcd_raw.py. B: the minimal lock whose
  waiter, when the key is taken, opens a watch on it from the next revision and tries again
  on its DELETE event (push: the revoke deletes the key).
- ZooKeeper, A: latchkey's two requests on kazoo — create an ephemeral sequential node with
  its data + list the parent's children (pipelined); delete the node with a version check (a
  lease sure to be live: no clock read) — one round trip each. B: kazoo's own ``Lock``
  recipe (a watch on the node ahead).
- Redis Cluster and Sentinel, A: latchkey's own ACQUIRE and RELEASE scripts (cluster: the
  SPUBLISH variant), by EVALSHA with the same keys and arguments, through redis-py's
  ``RedisCluster`` / ``Sentinel.master_for`` client. B: the BLPOP hand-off of
  ``redis/raw-blpop`` on the same clients (keys sharing one hash tag on the cluster).
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from typing import Any
from urllib.parse import urlsplit

from subjects import (
    TTL,
    Handle,
    LatchkeySubject,
    RawRedis,
    RawRedisHandle,
    Spec,
    register,
    token,
)

LATCHKEY_URLS = {
    "etcd": lambda env: env["etcd"] + "?prefix=bench:",
    "zookeeper": lambda env: env["zookeeper"] + "?prefix=bench",
    "redis+cluster": lambda env: env["redis_cluster"] + "?prefix=bench:",
    "redis+sentinel": lambda env: env["redis_sentinel"] + "?prefix=bench:",
}
for _store, _url in LATCHKEY_URLS.items():
    register(
        Spec(
            f"{_store}/latchkey",
            _store,
            "latchkey",
            "latchkey",
            lambda env, _url=_url: LatchkeySubject(_url(env)),  # type: ignore[misc]
            frozenset({"A", "B", "C", "D", "claim"}),
        )
    )


def _hostport(url: str) -> tuple[str, int]:
    u = urlsplit(url)
    return u.hostname or "127.0.0.1", int(u.port or 0)


def _owner_info() -> str:
    from latchkey._owner import Owner

    return Owner.current().to_json()


# -- etcd -------------------------------------------------------------------------------------


class RawEtcdHandle:
    def __init__(self, subject: RawEtcd, name: str) -> None:
        self.s, self.name, self.owner = subject, name, token()
        self.lease = 0

    def acquire(self, timeout: float) -> bool:
        s, deadline = self.s, time.monotonic() + timeout
        self.lease = next(s.leases)
        s.post("/v3/lease/grant", {"ID": str(self.lease), "TTL": str(TTL)})
        while True:
            reply = s.post("/v3/kv/txn", s.body(self.name, self.owner, self.lease))
            if reply.get("succeeded"):
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                s.post("/v3/lease/revoke", {"ID": str(self.lease)})
                return False
            s.wait_deleted(self.name, int(reply["header"]["revision"]) + 1, left)

    def release(self) -> None:
        self.s.post("/v3/lease/revoke", {"ID": str(self.lease)})


class RawEtcd:
    """httpx posting to etcd's JSON gateway. ``same``: latchkey's acquire transaction (two
    keys, nested); else the minimal one-key create-if-absent."""

    def __init__(self, url: str, same: bool) -> None:
        import httpx

        host, port = _hostport(url)
        self.base, self.same = f"http://{host}:{port}", same
        self.client = httpx.Client(timeout=10)
        self.leases = itertools.count(uuid.uuid4().int >> 66)  # 62 bits, fresh per subject
        self.info = _owner_info()

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        reply = self.client.post(self.base + path, json=body)
        data: dict[str, Any] = reply.json()
        if reply.status_code != 200:
            raise RuntimeError(f"etcd: {data}")
        return data

    def body(self, name: str, owner: str, lease: int) -> dict[str, Any]:
        from latchkey.stores.etcd_txn import compare, end_of, get, lease_seconds, put, txn

        if not self.same:
            key = ("raw:" + name).encode()
            return {"compare": [compare(key, "CREATE", 0)],
                    "success": [put(key, owner.encode(), lease)],
                    "failure": [get(key)]}  # fmt: skip
        hexname = name.encode().hex()
        slot, holder = f"rs/{hexname}/0".encode(), f"ro/{hexname}/{owner}".encode()
        holders = f"ro/{hexname}/".encode()
        now = time.time_ns() // 1_000_000
        meta = {"slot": 0, "info": self.info, "acq": now, "exp": now + TTL * 1000,
                "ttl": lease_seconds(TTL), "shared": False}  # fmt: skip
        value = json.dumps(meta, separators=(",", ":")).encode()
        inner = txn([compare(slot, "CREATE", 0)],
                    [put(slot, owner.encode(), lease), put(holder, value, lease)],
                    [get(holders, end_of(holders))])  # fmt: skip
        return {"compare": [compare(holder, "CREATE", 0)], "success": [inner],
                "failure": [get(holder)]}  # fmt: skip

    def wait_deleted(self, name: str, revision: int, timeout: float) -> None:
        """Watch the minimal lock's key from ``revision`` until a DELETE event (or timeout)."""
        import httpx

        from latchkey.stores.io.etcd import b64

        create = {"key": b64(("raw:" + name).encode()), "start_revision": str(revision),
                  "filters": ["NOPUT"]}  # fmt: skip
        try:
            with self.client.stream(
                "POST", self.base + "/v3/watch", json={"create_request": create},
                timeout=httpx.Timeout(10, read=min(timeout, 1.0)),
            ) as stream:  # fmt: skip
                for line in stream.iter_lines():
                    result = json.loads(line).get("result") or {}
                    if any(e.get("type") == "DELETE" for e in result.get("events") or ()):
                        return
        except httpx.ReadTimeout:
            return  # try again (at most a second late: never, in the bench's hand-offs)

    def make(self, name: str) -> Handle:
        return RawEtcdHandle(self, name)

    def close(self) -> None:
        self.client.close()


register(Spec("etcd/raw-same", "etcd",
              "raw httpx: latchkey's grant, acquire transaction and revoke, sent bare", "raw",
              lambda env: RawEtcd(env["etcd"], same=True), frozenset("A")))  # fmt: skip
register(Spec("etcd/raw", "etcd",
              "raw httpx: grant, one-key create-if-absent txn, revoke; waiter watches the key",
              "raw", lambda env: RawEtcd(env["etcd"], same=False), frozenset("AB")))  # fmt: skip


# -- ZooKeeper ----------------------------------------------------------------------------------


class RawZKHandle:
    def __init__(self, subject: RawZK, name: str) -> None:
        self.s, self.parent = subject, f"/rawbench/{name.encode().hex()}"
        self.path = ""

    def acquire(self, timeout: float) -> bool:
        zk, data = self.s.zk, self.s.data
        deadline = time.monotonic() + timeout
        while True:  # one round trip: create + list, pipelined
            created = zk.create_async(f"{self.parent}/{self.s.owner}-", data, ephemeral=True,
                                      sequence=True, include_data=True)  # fmt: skip
            children = zk.get_children_async(self.parent)
            self.path = created.get(timeout=10)[0]
            mine = self.path.rsplit("/", 1)[1]
            if min(children.get(timeout=10), key=lambda c: c[-10:]) == mine:
                return True
            zk.delete(self.path)  # uncontended only: the A scenario never waits
            if time.monotonic() >= deadline:
                return False

    def release(self) -> None:
        # one round trip: the node is sure to be live (made just now), so latchkey deletes it
        # with a version check only (stores/zookeeper.py, release_many)
        self.s.zk.delete(self.path, version=0)


class RawZK:
    """kazoo, latchkey's two pipelined batches per pair."""

    def __init__(self, url: str) -> None:
        from kazoo.client import KazooClient

        host, port = _hostport(url)
        self.zk = KazooClient(hosts=f"{host}:{port}", timeout=10)
        self.zk.start(timeout=30)
        self.owner = token()
        self.data = json.dumps({"t": TTL * 1000, "n": 1, "i": _owner_info()}).encode()
        self.made: set[str] = set()

    def make(self, name: str) -> Handle:
        handle = RawZKHandle(self, name)
        if handle.parent not in self.made:
            self.zk.ensure_path(handle.parent)
            self.made.add(handle.parent)
        return handle

    def close(self) -> None:
        self.zk.stop()
        self.zk.close()


class KazooLockHandle:
    def __init__(self, lock: Any) -> None:
        self.lock = lock

    def acquire(self, timeout: float) -> bool:
        return bool(self.lock.acquire(timeout=timeout))

    def release(self) -> None:
        self.lock.release()


class KazooLock(RawZK):
    """kazoo's own Lock recipe: waits on a watch of the node ahead."""

    def make(self, name: str) -> Handle:
        return KazooLockHandle(self.zk.Lock(f"/rawlock/{name.encode().hex()}", self.owner))


register(Spec("zookeeper/raw", "zookeeper",
              "raw kazoo: latchkey's requests (create seq. ephemeral + children; versioned delete)",
              "raw", lambda env: RawZK(env["zookeeper"]), frozenset("A")))  # fmt: skip
register(Spec("zookeeper/kazoo-lock", "zookeeper", "raw kazoo Lock recipe", "raw",
              lambda env: KazooLock(env["zookeeper"]), frozenset("AB")))  # fmt: skip


# -- Redis Cluster and Sentinel ---------------------------------------------------------------


def cluster_client(url: str) -> Any:
    from redis.cluster import ClusterNode, RedisCluster

    host, port = _hostport(url)
    return RedisCluster(startup_nodes=[ClusterNode(host, port)], decode_responses=True)


def sentinel_client(url: str) -> Any:
    import redis
    from redis.sentinel import Sentinel

    u = urlsplit(url)
    sentinel = Sentinel([(u.hostname or "127.0.0.1", int(u.port or 26379))], socket_timeout=10)
    client = sentinel.master_for(u.path.strip("/"), redis_class=redis.Redis,
                                 decode_responses=True)  # fmt: skip
    client.bench_sentinel = sentinel
    return client


def close_client(client: Any) -> None:
    client.close()
    sentinel = getattr(client, "bench_sentinel", None)
    for s in sentinel.sentinels if sentinel is not None else ():
        s.close()


class SameScriptsHandle:
    def __init__(self, subject: SameScripts, name: str) -> None:
        self.s, self.key, self.owner = subject, f"rawbench:{{{name.encode().hex()}}}", token()

    def acquire(self, timeout: float) -> bool:
        s = self.s
        reply = s.r.execute_command("EVALSHA", s.acquire_sha, 1, self.key, self.owner, s.info,
                                    TTL * 1000)  # fmt: skip
        return isinstance(reply, str)  # a grant; a busy name answers a list

    def release(self) -> None:
        self.s.r.execute_command("EVALSHA", self.s.release_sha, 1, self.key, self.owner)


class SameScripts:
    """latchkey's ACQUIRE and RELEASE scripts by EVALSHA (loaded once), same keys and args."""

    def __init__(self, client: Any, cluster: bool) -> None:
        from latchkey.stores.redis_cluster import S_RELEASE
        from latchkey.stores.redis_lua import ACQUIRE, RELEASE

        self.r, self.info = client, _owner_info()
        release = S_RELEASE if cluster else RELEASE
        self.acquire_sha, self.release_sha = ACQUIRE.sha, release.sha
        for lua in (ACQUIRE, release):  # the cluster client loads it on every master
            client.script_load(lua.text)

    def make(self, name: str) -> Handle:
        return SameScriptsHandle(self, name)

    def close(self) -> None:
        close_client(self.r)


class TaggedHandle(RawRedisHandle):
    """``redis/raw-blpop``'s handle with the key and its signal list in one hash slot."""

    def __init__(self, subject: RawRedis, name: str) -> None:
        super().__init__(subject, name)
        self.key = f"raw:{{{name.encode().hex()}}}"


class RawRedisOn(RawRedis):
    """``redis/raw-blpop`` (SET NX; waiter BLPOPs a signal list the release pushes) over the
    cluster or Sentinel client."""

    def __init__(self, client: Any) -> None:
        from subjects import REDIS_CAD, REDIS_CAD_SIGNAL

        self.r, self.signal = client, True
        self.cad = client.register_script(REDIS_CAD)
        self.cad_signal = client.register_script(REDIS_CAD_SIGNAL)

    def make(self, name: str) -> Handle:
        return TaggedHandle(self, name)

    def close(self) -> None:
        close_client(self.r)


for _store, _env, _client, _cluster in (
    ("redis+cluster", "redis_cluster", cluster_client, True),
    ("redis+sentinel", "redis_sentinel", sentinel_client, False),
):
    register(Spec(f"{_store}/raw", _store, "raw EVALSHA of latchkey's ACQUIRE / RELEASE scripts",
                  "raw", lambda env, e=_env, c=_client, k=_cluster: SameScripts(c(env[e]), k),
                  frozenset("AD")))  # fmt: skip
    register(Spec(f"{_store}/raw-blpop", _store,
                  "raw BLPOP hand-off (SET NX; release = CAD + LPUSH)", "raw",
                  lambda env, e=_env, c=_client: RawRedisOn(c(env[e])),
                  frozenset("BC")))  # fmt: skip
