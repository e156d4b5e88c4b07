"""Run by Django's test runner (``manage.py test lockapp``) from tests/contrib/test_django.py,
on PostgreSQL and on SQLite: the store is the test database, reached on a connection of its
own; the management command and the system checks."""

import asyncio
import io
import json
import os
import uuid

from django.core import checks
from django.core.management import CommandError, call_command
from django.db import connection, transaction
from django.test import TestCase, override_settings

import latchkey
from latchkey.contrib.django import (
    close_async_store,
    get_async_store,
    get_store,
    store_url,
)


class StoreTests(TestCase):
    def test_the_store_is_the_test_database(self) -> None:
        name = connection.settings_dict["NAME"]
        assert "test" in os.path.basename(name), name  # the test runner's database
        url = store_url()
        assert url.startswith(os.environ["EXPECT_SCHEME"] + "://"), url
        assert url.split("?")[0].endswith(os.path.basename(name)), (url, name)
        assert get_store() is get_store()  # one store per process

    def test_a_lock_taken_in_a_rolled_back_transaction_stays_held_and_is_seen_at_once(
        self,
    ) -> None:
        store, name = get_store(), f"django:{uuid.uuid4().hex}"
        lock = store.lock(name, ttl="1m")
        try:
            with transaction.atomic():
                assert lock.acquire()
                with latchkey.connect(store_url()) as other:  # another process, say
                    assert not other.is_free(name)
                raise RuntimeError("roll back")
        except RuntimeError:
            pass
        assert not store.is_free(name)  # latchkey's own connection: not rolled back
        assert lock.release()

    def test_the_management_command_runs_latchkeys_cli_on_the_store(self) -> None:
        name = f"django:{uuid.uuid4().hex}"
        with get_store().lock(name, ttl="1m", metadata={"job": "import"}):
            out = io.StringIO()
            call_command("latchkey", "ls", "--json", "--prefix", name, stdout=out)
            (held,) = json.loads(out.getvalue())
            assert held["name"] == name
            out = io.StringIO()
            call_command("latchkey", "show", name, stdout=out)
            assert name in out.getvalue() and '"job": "import"' in out.getvalue()
            err = io.StringIO()
            try:
                call_command("latchkey", "release", name, stderr=err)  # no --force
                raise AssertionError("release without --force succeeded")
            except CommandError as exc:
                assert exc.returncode == 78
            assert "--force" in err.getvalue()
            assert not get_store().is_free(name)
            call_command("latchkey", "release", name, "--force", stdout=io.StringIO())
            assert get_store().is_free(name)

    def test_checks_pass_and_name_a_bad_url(self) -> None:
        ours = [m for m in checks.run_checks(databases=["default"]) if m.id.startswith("latch")]
        assert ours == [], ours
        with override_settings(LATCHKEY={"URL": "nosuch://x"}):
            (error,) = [m for m in checks.run_checks() if m.id.startswith("latch")]
            assert error.id == "latchkey.E001" and "nosuch" in error.msg, error

    def test_an_unreachable_store_is_a_warning_of_the_database_checks(self) -> None:
        port = os.environ["CLOSED_PORT"]
        with override_settings(LATCHKEY_URL=f"postgresql://u:secret@127.0.0.1:{port}/x"):
            assert [m.id for m in checks.run_checks() if m.id.startswith("latch")] == []
            (warning,) = [
                m for m in checks.run_checks(databases=["default"]) if m.id.startswith("latch")
            ]
            assert warning.id == "latchkey.W001", warning
            assert "secret" not in warning.msg and "***" in warning.msg, warning.msg
        assert get_store().is_free("x")  # the settings' store again, after the override

    def test_a_database_alias_with_store_options(self) -> None:
        table = f"locks_{uuid.uuid4().hex[:8]}"
        with override_settings(LATCHKEY={"DATABASE": "default", "OPTIONS": {"table": table}}):
            assert f"table={table}" in store_url()
            with get_store().lock("x", ttl="1m"):
                pass
            # latchkey created its table in the very database Django uses
            assert table in connection.introspection.table_names()


class AsyncStoreTests(TestCase):
    def test_one_async_store_per_event_loop_from_the_same_settings(self) -> None:
        name = f"django:{uuid.uuid4().hex}"

        async def main() -> latchkey.AsyncStore:
            store = get_async_store()
            assert store is get_async_store()  # one per loop
            assert store.url == get_store().url
            async with store.lock(name, ttl="1m") as lock:
                assert lock.token is not None
                assert not get_store().is_free(name)  # the same database as the sync store
            assert await store.is_free(name)
            await close_async_store()
            assert store.backend.latchkey_closed  # closed, not left to the garbage collector
            return store

        first = asyncio.run(main())
        second = asyncio.run(main())
        assert first is not second  # another loop: another store

    def test_a_settings_change_opens_another_store_and_closes_the_old_one(self) -> None:
        table = f"locks_{uuid.uuid4().hex[:8]}"

        async def main() -> None:
            before = get_async_store()
            assert await before.is_free("x")
            with override_settings(LATCHKEY={"DATABASE": "default", "OPTIONS": {"table": table}}):
                inside = get_async_store()
                assert inside is not before and f"table={table}" in inside.url
                async with inside.lock("x", ttl="1m") as lock:
                    assert lock.token is not None
            after = get_async_store()
            assert after is not inside and after.url == before.url
            await close_async_store()  # also waits for the replaced stores' closes
            assert before.backend.latchkey_closed and inside.backend.latchkey_closed

        asyncio.run(main())

    def test_outside_an_event_loop_it_is_a_config_error(self) -> None:
        try:
            get_async_store()
            raise AssertionError("get_async_store() worked without a running loop")
        except latchkey.ConfigError as exc:
            assert "running event loop" in str(exc)
