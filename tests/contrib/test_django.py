"""latchkey.contrib.django: Django's own test runner runs tests/contrib/djangoproject (on the
suite's PostgreSQL server and on SQLite), and manage.py runs the command and the checks, in
subprocesses (Django's settings are configured once per process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytest.importorskip("django", reason="latchkey[django] is not installed")

import latchkey
from latchkey import ConfigError
from latchkey._url import StoreURL
from latchkey.contrib.django import database_url
from tests.conftest import ServerPool
from tests.servers import ServerUnavailable, free_port

PROJECT = Path(__file__).parent / "djangoproject"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def pg_database(server_pool: ServerPool) -> dict[str, str]:
    """DATABASES['default'] for the suite's PostgreSQL (a database name of this test's own:
    Django's test runner creates test_<name> beside it)."""
    try:
        url = StoreURL.parse(server_pool.base_url("postgresql"))
    except ServerUnavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(f"postgresql: server required in CI but unavailable: {exc}")
        pytest.skip(f"postgresql: not run: {exc}")
    host, port = url.hosts[0]
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": f"dj_{uuid.uuid4().hex[:12]}",
        "HOST": host,
        "PORT": str(port or 5432),
        "USER": url.username or "",
        "PASSWORD": url.password or "",
    }


@pytest.fixture
def sqlite_database(tmp_path: Path) -> dict[str, object]:
    return {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": str(tmp_path / "app.db"),
        "TEST": {"NAME": str(tmp_path / "test_app.db")},  # a file: latchkey opens its own
    }


def manage(
    database: dict[str, object], *args: str, latchkey_settings: object = None
) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "TEST_DATABASES": json.dumps({"default": database}),
        "PYTHONPATH": os.pathsep.join([str(PROJECT), str(ROOT)]),
        "PYTHONWARNINGS": "error",
        "CLOSED_PORT": str(free_port()),
        "EXPECT_SCHEME": "sqlite" if "sqlite" in str(database["ENGINE"]) else "postgresql",
    }
    env.pop("LATCHKEY_URL", None)
    if latchkey_settings is not None:
        env["TEST_LATCHKEY"] = json.dumps(latchkey_settings)
    return subprocess.run(
        [sys.executable, str(PROJECT / "manage.py"), *args],
        cwd=PROJECT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def _ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    return result.stdout + result.stderr


def test_djangos_test_runner_on_postgresql(pg_database: dict[str, object]) -> None:
    output = _ok(manage(pg_database, "test", "lockapp", "-v", "2", "--noinput"))
    assert "Ran 9 tests" in output and "OK" in output


def test_djangos_test_runner_on_sqlite(sqlite_database: dict[str, object]) -> None:
    output = _ok(manage(sqlite_database, "test", "lockapp", "-v", "2", "--noinput"))
    assert "Ran 9 tests" in output and "OK" in output


def test_manage_py_latchkey_is_latchkeys_cli(sqlite_database: dict[str, object]) -> None:
    store = f"sqlite:///{sqlite_database['NAME']}"
    assert _ok(manage(sqlite_database, "latchkey", "ls", "--json")).strip() == "[]"
    ran = manage(
        sqlite_database,
        "latchkey",
        "--settings",
        "settings",
        "run",
        "job",
        "--",
        sys.executable,
        "-c",
        "import sys; print('ran'); sys.exit(3)",
    )
    assert ran.returncode == 3 and ran.stdout.strip() == "ran", ran.stderr  # the command's
    with latchkey.connect(store) as direct, direct.lock("job", ttl="1m"):
        busy = manage(sqlite_database, "latchkey", "run", "job", "--", "true")
        assert busy.returncode == 75 and "job" in busy.stderr  # held: EX_TEMPFAIL
    bad = manage(sqlite_database, "latchkey", "ls", latchkey_settings={"URL": "nosuch://x"})
    assert bad.returncode == 78 and "nosuch" in bad.stderr


def test_manage_py_check_reports_a_bad_url(sqlite_database: dict[str, object]) -> None:
    result = manage(sqlite_database, "check", latchkey_settings={"URL": "redis://h/0?nope=1"})
    assert result.returncode == 1 and "latchkey.E001" in result.stderr, result.stderr
    assert "nope" in result.stderr


def test_manage_py_check_database_warns_of_an_unreachable_store(
    sqlite_database: dict[str, object],
) -> None:
    url = f"postgresql://u:secret@127.0.0.1:{free_port()}/x"
    plain = _ok(manage(sqlite_database, "check", latchkey_settings={"URL": url}))
    assert "latchkey.W001" not in plain  # no I/O in the default checks
    result = manage(
        sqlite_database, "check", "--database", "default", latchkey_settings={"URL": url}
    )
    output = _ok(result)
    assert "latchkey.W001" in output and "secret" not in output


# -- database_url: DATABASES entries to store URLs (no Django settings needed) ----------------


def test_database_url_for_postgresql_quotes_credentials_and_keeps_ssl_options() -> None:
    url = database_url(
        {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": "app",
            "HOST": "db.internal",
            "PORT": 6432,
            "USER": "app@eu",
            "PASSWORD": "p@ss:/w?rd",
            "OPTIONS": {"sslmode": "require", "isolation_level": 3},
        },
        {"table": "app_locks"},
    )
    assert url == (
        "postgresql://app%40eu:p%40ss%3A%2Fw%3Frd@db.internal:6432/app"
        "?sslmode=require&table=app_locks"
    )
    parsed = StoreURL.parse(url)
    assert (parsed.username, parsed.password) == ("app@eu", "p@ss:/w?rd")
    latchkey.connect(url).close()  # a valid store URL (connects on first use only)


def test_database_url_for_a_socket_directory_and_no_host() -> None:
    pg = {"ENGINE": "django.contrib.gis.db.backends.postgis", "NAME": "app"}
    assert database_url({**pg, "HOST": "/run/postgresql"}) == "postgresql://%2Frun%2Fpostgresql/app"
    assert database_url(pg) == "postgresql:///app"
    assert StoreURL.parse(database_url({**pg, "HOST": "/run/pg"})).hosts == (("/run/pg", None),)


def test_database_url_for_mysql_and_sqlite(tmp_path: Path) -> None:
    mysql = {"ENGINE": "django.db.backends.mysql", "NAME": "shop", "HOST": "10.0.0.5", "USER": "u"}
    assert database_url(mysql) == "mysql://u@10.0.0.5/shop"
    with pytest.raises(ConfigError, match="over TCP only"):
        database_url({**mysql, "HOST": "/var/run/mysqld/mysqld.sock"})
    sqlite = {"ENGINE": "django.db.backends.sqlite3", "NAME": str(tmp_path / "db.sqlite3")}
    assert database_url(sqlite) == f"sqlite:///{tmp_path}/db.sqlite3"


@pytest.mark.parametrize(
    ("settings_dict", "message"),
    [
        ({"ENGINE": "django.db.backends.oracle", "NAME": "x"}, "no latchkey store for ENGINE"),
        ({"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}, "in-memory"),
        (
            {
                "ENGINE": "django.db.backends.sqlite3",
                "NAME": "file:memorydb?mode=memory&cache=shared",
            },
            "in-memory",
        ),
    ],
)
def test_database_url_refuses_what_latchkey_cannot_share(
    settings_dict: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        database_url(settings_dict, alias="default")
