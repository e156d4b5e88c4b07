"""A store over the application's own pymongo client or Database whatever the client's own
settings: latchkey's collections are read tz-aware and written majority-acknowledged even
through a client made with ``w=0`` and ``tz_aware=False``; a Database names the database
latchkey uses; the client's password never shows."""

from __future__ import annotations

import os
import uuid

import pytest

import latchkey
from tests.conftest import ServerPool
from tests.servers import ServerUnavailable

pytestmark = pytest.mark.xdist_group("mongodb")


@pytest.fixture
def base(server_pool: ServerPool) -> str:
    try:
        return server_pool.base_url("mongodb")
    except ServerUnavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(f"mongodb: server required in CI but unavailable: {exc}")
        pytest.skip(f"mongodb: not run: {exc}")


def test_a_database_with_the_applications_settings_keeps_latchkeys(base: str) -> None:
    import pymongo

    client: pymongo.MongoClient[dict[str, object]] = pymongo.MongoClient(base, w=0, tz_aware=False)
    collection = f"t_{uuid.uuid4().hex[:12]}"
    try:
        db = client["latchkey_own"]
        store = latchkey.connect(client=db, collection=collection, timeout="20s")
        assert "/latchkey_own?" in store.url
        lock = store.lock("n", ttl="30s", wait=0)
        assert lock.acquire()  # acknowledged writes: w=0 would leave nothing to read
        info = store.inspect("n")
        assert info is not None and info.holder.token == lock.token
        expires = info.holder.expires_at
        assert expires is not None and expires.tzinfo is not None
        assert store.now().tzinfo is not None
        assert lock.release()
        store.close()
        assert collection in db.list_collection_names()  # in the Database given
        assert client.write_concern.document == {"w": 0}  # the client's own, unchanged
        assert client.codec_options.tz_aware is False
        assert client.admin.command("ping")["ok"]
    finally:
        client.drop_database("latchkey_own")
        client.close()


def test_the_clients_password_is_never_shown() -> None:
    import pymongo

    password = "pw-in-mongo-Kq7"
    client: pymongo.MongoClient[dict[str, object]] = pymongo.MongoClient(
        f"mongodb://app:{password}@127.0.0.1:1/appdb", connect=False
    )
    try:
        store = latchkey.connect(client=client)
        for shown in (repr(store), store.url, repr(store.backend)):
            assert password not in shown
        assert store.url.startswith("mongodb://app:***@127.0.0.1:1/appdb ")
        assert store.backend.store.database == "appdb"  # the client's default database
        store.close()
    finally:
        client.close()
