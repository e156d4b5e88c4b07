from __future__ import annotations

import json

import pytest

import latchkey
from latchkey import ConfigError, InvalidName
from latchkey._names import validate_name
from latchkey._owner import Owner, check_metadata, new_owner_token
from latchkey._url import StoreURL, identifier, key_prefix, read_options
from latchkey.stores import open_backend


def test_names() -> None:
    assert validate_name("x" * 255) == "x" * 255
    assert validate_name("nul\x00 ok") == "nul\x00 ok"
    for bad in ["", "x" * 256, "é" * 128, "\udcff"]:
        with pytest.raises(InvalidName):
            validate_name(bad)
    with pytest.raises(InvalidName, match="must be a str"):
        validate_name(b"bytes")


def test_url_parts_and_redaction() -> None:
    url = StoreURL.parse("postgresql://app:p%40ss@db.example:5433/app?table=locks")
    assert (url.username, url.password, url.host, url.port, url.path) == (
        "app",
        "p@ss",
        "db.example",
        5433,
        "/app",
    )
    assert "p@ss" not in str(url) and "p%40ss" not in repr(url) and "***" in str(url)
    assert url.scrub("auth failed for p@ss and p%40ss") == "auth failed for *** and ***"
    multi = StoreURL.parse("memcached://a:1,b:2,[::1]:3")
    assert multi.hosts == (("a", 1), ("b", 2), ("::1", 3))
    assert StoreURL.parse("sqlite:////abs/x.db").path == "//abs/x.db"


@pytest.mark.parametrize(
    ("url", "hosts", "path", "query"),
    [
        ("rediss://h?ssl_ca_certs=/etc/ssl/ca.pem", (("h", None),), "",
         {"ssl_ca_certs": "/etc/ssl/ca.pem"}),
        ("rediss://h:6380/2?ssl_ca_certs=/etc/ssl/ca.pem&prefix=a:", (("h", 6380),), "/2",
         {"ssl_ca_certs": "/etc/ssl/ca.pem", "prefix": "a:"}),
        ("postgresql://u@/db?host=/var/run/postgresql", (), "/db",
         {"host": "/var/run/postgresql"}),
        ("memory://?x=/a/b&y=c/", (), "", {"x": "/a/b", "y": "c/"}),
        ("redis://h?a=%2Fetc%2Fx", (("h", None),), "", {"a": "/etc/x"}),
        ("sqlite:////abs/x.db?table=t", (), "//abs/x.db", {"table": "t"}),
        ("memory://ns", (("ns", None),), "", {}),
    ],
)  # fmt: skip
def test_a_query_value_with_slashes_is_read_whole(
    url: str, hosts: tuple[tuple[str, int | None], ...], path: str, query: dict[str, str]
) -> None:
    parsed = StoreURL.parse(url)
    assert (parsed.hosts, parsed.path, dict(parsed.query)) == (hosts, path, query)


def test_the_repr_of_a_url_shows_the_query_keys_never_their_values() -> None:
    url = StoreURL.parse(
        "redis://u:pw-Zq8@h:1/0?client_name=tok-Jx5&ssl_password=sec-Wp2&prefix=app:"
    )
    shown = repr(url)
    for value in ("pw-Zq8", "tok-Jx5", "sec-Wp2", "app:"):
        assert value not in shown
    assert "client_name" in shown and "ssl_password" in shown and "prefix" in shown
    assert "'h', 1" in shown and "'/0'" in shown
    # a value whose option name says it is a secret is masked in str() too
    token = StoreURL.parse("redis://h?auth_token=tok-Jx5&x=1")
    assert "tok-Jx5" not in str(token) and "x=1" in str(token)


@pytest.mark.parametrize(
    "bad",
    ["no-scheme", "://x", "9ab://x", "redis://h:99999", "redis://h:port", "sqlite:///x.db?a=1&a=2"],
)
def test_bad_urls(bad: str) -> None:
    with pytest.raises(ConfigError):
        StoreURL.parse(bad)


def test_bad_url_messages_mask_passwords() -> None:
    with pytest.raises(ConfigError) as caught:
        StoreURL.parse("redis://:hunter2@h:notaport")
    assert "hunter2" not in str(caught.value)
    with pytest.raises(ConfigError) as caught:
        latchkey.connect("nosuch://u:hunter2@h/")
    assert "hunter2" not in str(caught.value)


def test_options() -> None:
    from latchkey._url import Option

    spec = {"table": Option(identifier, "latchkey_locks")}
    url = StoreURL.parse("sqlite:///x.db?table=my_locks&timeout=2s")
    assert read_options(url, spec) == {"table": "my_locks", "timeout": 2.0, "driver": {}}
    with pytest.raises(ConfigError, match="unknown URL option 'tabel'"):
        read_options(StoreURL.parse("sqlite:///x.db?tabel=x"), spec)
    for hostile in ["locks; DROP TABLE x", "a-b", "1abc", "x" * 64, ""]:
        with pytest.raises(ConfigError, match="table"):
            read_options(StoreURL.parse(f"sqlite:///x.db?table={hostile}"), spec)
    assert key_prefix("app:locks.v1-") == "app:locks.v1-"
    with pytest.raises(ValueError):
        key_prefix("bad prefix")


def test_driver_options_pass_through_and_unknown_ones_name_where_to_look() -> None:
    from latchkey._url import DriverOptions, Option, known_to

    def check(key: str, text: str) -> str:
        if key == "connect_timeout" and not text.isdigit():
            raise ValueError("must be a whole number of seconds")
        return known_to(lambda: {"connect_timeout", "application_name", "sslpassword"})(key, text)

    driver = DriverOptions(check, "any libpq parameter (see its docs)")
    spec = {"table": Option(identifier, "latchkey_locks")}
    url = StoreURL.parse("postgresql://h/db?connect_timeout=5&application_name=worker&table=t")
    config = read_options(url, spec, driver)
    assert config["table"] == "t"
    assert config["driver"] == {"connect_timeout": "5", "application_name": "worker"}
    with pytest.raises(ConfigError, match=r"unknown URL option 'bogus' \(known options: table, "
                       r"timeout; also any libpq parameter \(see its docs\)\)"):  # fmt: skip
        read_options(StoreURL.parse("postgresql://h/db?bogus=1"), spec, driver)
    with pytest.raises(ConfigError, match="connect_timeout='soon': must be a whole number"):
        read_options(StoreURL.parse("postgresql://h/db?connect_timeout=soon"), spec, driver)
    # a secret in the query string is masked wherever the URL is shown
    secret = StoreURL.parse("postgresql://u:pw1@h/db?sslpassword=hunter2&application_name=w")
    assert "hunter2" not in secret.redacted() and "pw1" not in secret.redacted()
    assert "application_name=w" in secret.redacted()
    assert secret.scrub("bad sslpassword hunter2") == "bad sslpassword ***"


def test_libpq_and_pymongo_options_come_from_the_drivers_themselves() -> None:
    from latchkey.stores.io.psycopg import connection_params

    backend = open_backend(
        "postgresql://u@h/db?connect_timeout=9&application_name=worker"
        "&target_session_attrs=read-write&options=-c%20search_path%3Dapp"
    )
    try:
        params = connection_params(backend.url, backend.config, "latchkey")
    finally:
        backend.close()
    assert params["connect_timeout"] == "9" and params["application_name"] == "worker"
    assert params["target_session_attrs"] == "read-write"
    assert params["options"].endswith(" -c search_path=app")  # after ours (statement_timeout…)
    assert "statement_timeout" in params["options"]
    for bad in ("replication=database", "dbname=other", "nonsense=1"):
        with pytest.raises(ConfigError, match="unknown URL option"):
            open_backend(f"postgresql://u@h/db?{bad}")


def test_owner_round_trip_and_tokens() -> None:
    owner = Owner.current({"job": "nightly"})
    again = Owner.from_json(owner.to_json())
    assert again == owner and str(owner) == f"{owner.pid}@{owner.host}"
    assert owner.started > 0
    assert Owner.from_json("not json") == Owner() and str(Owner()) == "unknown"
    tokens = {new_owner_token() for _ in range(1000)}
    assert len(tokens) == 1000 and all(len(t) == 32 for t in tokens)
    with pytest.raises(ConfigError, match="metadata"):
        check_metadata({"x": object()})
    assert json.loads(owner.to_json())["metadata"] == {"job": "nightly"}


def test_public_surface() -> None:
    assert latchkey.__all__ == sorted(latchkey.__all__)
    for name in latchkey.__all__:
        assert hasattr(latchkey, name)


def test_errors_subclass_the_builtins() -> None:
    e = latchkey.errors
    assert issubclass(e.LockTimeout, TimeoutError)
    assert issubclass(e.StoreUnavailable, ConnectionError)
    assert issubclass(e.ConfigError, ValueError) and issubclass(e.InvalidName, ValueError)
    assert issubclass(e.Unsupported, NotImplementedError)
    for name in e.__all__:
        assert issubclass(getattr(e, name), e.LatchkeyError)
