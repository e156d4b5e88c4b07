from __future__ import annotations

import json
from typing import Any

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


def _redis_kwargs(url: str) -> dict[str, object]:
    """The connection settings a Redis URL gives the store's own connections (no I/O)."""
    from latchkey.stores.io.redis import settings
    from latchkey.stores.io.redis_cluster import cluster_settings, node_settings

    backend: object = open_backend(url)
    try:
        store = backend.store  # type: ignore[attr-defined]
        if url.startswith(("redis+cluster", "rediss+cluster")):
            assert node_settings(store).items() >= {"client_name": "w-1"}.items()
            return cluster_settings(store)
        return settings(store)
    finally:
        backend.close()  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("client_name=w-1", {"client_name": "w-1"}),
        ("socket_keepalive=false&socket_read_size=4096",
         {"socket_keepalive": False, "socket_read_size": 4096}),
        ("health_check_interval=30", {"health_check_interval": 30}),
    ],
)  # fmt: skip
def test_redis_py_options_in_a_redis_url_pass_through_typed(
    query: str, expected: dict[str, object]
) -> None:
    kwargs = _redis_kwargs(f"redis://:pw@h:1/3?prefix=a:&{query}")
    assert kwargs.items() >= expected.items()
    # latchkey's own settings stay whatever the URL says
    assert (kwargs["db"], kwargs["decode_responses"], kwargs["protocol"]) == (3, True, 2)
    sentinel = _redis_kwargs(f"redis+sentinel://h:1/mymaster?db=2&{query}")
    assert sentinel.items() >= expected.items()


def test_redis_py_options_reach_the_cluster_client_and_its_listener_connections() -> None:
    kwargs = _redis_kwargs("redis+cluster://h:1?client_name=w-1&socket_keepalive=no")
    assert kwargs["client_name"] == "w-1" and kwargs["socket_keepalive"] is False


def test_redis_tls_options_pass_through_typed_on_rediss_only() -> None:
    import ssl

    kwargs = _redis_kwargs(
        "rediss://h:1/0?ssl_ca_certs=/etc/ssl/ca.pem&ssl_certfile=/etc/ssl/c.pem"
        "&ssl_keyfile=/etc/ssl/c.key&ssl_password=k3y-pw&ssl_check_hostname=no"
        "&ssl_min_version=TLSv1_3&ssl_cert_reqs=optional&ssl_ca_path=/etc/ssl/certs"
        "&ssl_ciphers=ECDHE%2BAESGCM&ssl_include_verify_flags=VERIFY_X509_STRICT"
    )
    assert kwargs["ssl"] is True
    assert kwargs["ssl_ca_certs"] == "/etc/ssl/ca.pem" and kwargs["ssl_ca_path"] == "/etc/ssl/certs"
    assert (kwargs["ssl_certfile"], kwargs["ssl_keyfile"]) == ("/etc/ssl/c.pem", "/etc/ssl/c.key")
    assert kwargs["ssl_password"] == "k3y-pw" and kwargs["ssl_check_hostname"] is False
    assert kwargs["ssl_min_version"] is ssl.TLSVersion.TLSv1_3
    assert kwargs["ssl_cert_reqs"] == "optional" and kwargs["ssl_ciphers"] == "ECDHE+AESGCM"
    assert kwargs["ssl_include_verify_flags"] == [ssl.VerifyFlags.VERIFY_X509_STRICT]
    assert _redis_kwargs("rediss://h:1/0")["ssl_cert_reqs"] == "required"  # the default


def test_tls_schemes_of_sentinel_and_cluster_reach_every_connection() -> None:
    """``rediss+sentinel://``: the sentinels and the master over TLS with the URL's TLS
    options (the sentinels no other redis-py option); ``rediss+cluster://``: the cluster
    client (every node) and the listener connections."""
    from latchkey.stores.io.redis_cluster import node_settings
    from latchkey.stores.io.redis_sentinel import sentinel_settings

    query = "ssl_ca_certs=/ca.pem&ssl_password=k3y-pw&client_name=w-1"
    backend: Any = open_backend(f"rediss+sentinel://h:1/m?{query}")
    try:
        _, to_sentinel, to_master = sentinel_settings(backend.store)
        for kwargs in (to_sentinel, to_master):
            assert kwargs["ssl"] is True and kwargs["ssl_cert_reqs"] == "required"
            assert (kwargs["ssl_ca_certs"], kwargs["ssl_password"]) == ("/ca.pem", "k3y-pw")
        assert "client_name" not in to_sentinel and to_master["client_name"] == "w-1"
        assert "k3y-pw" not in repr(backend)
    finally:
        backend.close()
    plain: Any = open_backend("redis+sentinel://h:1/m")
    try:
        assert all("ssl" not in kwargs for kwargs in sentinel_settings(plain.store)[1:])
    finally:
        plain.close()
    cluster = _redis_kwargs(f"rediss+cluster://h:1?{query}")
    assert cluster["ssl"] is True and cluster["ssl_ca_certs"] == "/ca.pem"
    backend = open_backend(f"rediss+cluster://h:1?{query}")
    try:
        listener = node_settings(backend.store)
        assert listener["ssl"] is True and listener["ssl_password"] == "k3y-pw"
    finally:
        backend.close()
    assert "ssl" not in _redis_kwargs("redis+cluster://h:1?client_name=w-1")
    assert "ssl" not in _redis_kwargs("redis://h:1/0")
    backend = open_backend("rediss://h:1/0?ssl_password=k3y-pw&ssl_min_version=TLSv1_2")
    try:
        assert "k3y-pw" not in repr(backend) and "k3y-pw" not in str(backend.url)
    finally:
        backend.close()


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis://h?decode_responses=true", "decode_responses='true': not accepted: latchkey "
         "reads its replies as text"),
        ("redis://h?protocol=3", "protocol='3': not accepted: .*RESP3"),
        ("redis://h?encoding=latin-1", "encoding='latin-1': not accepted: .*UTF-8"),
        ("redis://h?retry_on_timeout=yes", "retry_on_timeout='yes': not accepted: latchkey "
         "never retries"),
        ("redis://h?socket_timeout=3", "socket_timeout='3': not accepted: latchkey's timeout="),
        ("redis://h?max_connections=3", "max_connections='3': not accepted: .*its own"),
        ("redis://h?db=2", r"db='2': not accepted: the database number is the URL's path"),
        ("redis://h?ssl=true", "use the rediss:// scheme"),
        ("redis://h?password=x", r"option password=\*\*\*: not accepted"),
        ("redis://h?client_name=two%20words", "client_name='two words': must be printable"),
        ("redis://h?health_check_interval=soon", "health_check_interval='soon': must be a whole"),
        ("redis://h?socket_keepalive=maybe", "socket_keepalive='maybe': must be true or false"),
        ("redis://h?ssl_ca_certs=/etc/ssl/ca.pem", "option ssl_ca_certs is for TLS: use rediss://"),
        ("redis+sentinel://h:1/m?ssl_certfile=/c.pem",
         r"ssl_certfile is for TLS: use rediss\+sentinel://"),
        ("redis+cluster://h:1?ssl_ca_certs=/ca.pem", r"ssl_ca_certs is for TLS: use rediss\+cluster://"),
        ("rediss+cluster://h:1?ssl_cert_reqs=maybe", "ssl_cert_reqs='maybe': must be one of"),
        ("rediss+sentinel://h:1/m?ssl_min_version=SSLv3", "must be a TLS version"),
        ("rediss+cluster://h:1?ssl=true", "use the rediss:// scheme"),
        ("redis+cluster://h:1?health_check_interval=5", "not accepted on a cluster"),
        ("rediss://h?ssl_min_version=SSLv3", "ssl_min_version='SSLv3': must be a TLS version"),
        ("rediss://h?ssl_cert_reqs=maybe", "ssl_cert_reqs='maybe': must be one of required"),
        ("rediss://h?ssl_include_verify_flags=NOPE", "'NOPE' is not an ssl.VerifyFlags name"),
        ("rediss://h?ssl_validate_ocsp=true", "OCSP checking is not supported"),
        ("redis://h?nosuch=1", r"unknown URL option 'nosuch' \(known options: prefix, timeout; "
         "also redis-py's client_name, health_check_interval, .*docs/reference/urls.md"),
        ("redis+cluster://h:1?nosuch=1", r"also redis-py's client_name, "
         r"socket_keepalive, socket_read_size, ssl_ca_certs, .*ssl_password"),
    ],
)  # fmt: skip
def test_redis_options_latchkey_cannot_use_are_refused_saying_why(url: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        open_backend(url)
    assert "hunter" not in str(caught.value)


def test_a_refused_secret_option_is_not_shown() -> None:
    with pytest.raises(ConfigError) as caught:
        open_backend("redis://h?ssl_password=hunter2")  # TLS option on redis://
    with pytest.raises(ConfigError) as caught_too:
        open_backend("redis://h?password=hunter2")
    for error in (caught.value, caught_too.value):
        assert "hunter2" not in str(error)


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


def test_a_mysql_host_list_is_read_in_order_with_default_ports() -> None:
    from latchkey.stores.io.mysql_dsn import connect_args, hosts_of

    url = StoreURL.parse("mysql://app:pw@db1,db2:3307,[::1]:3308/app")
    assert hosts_of(url) == (("db1", 3306), ("db2", 3307), ("::1", 3308))
    backend = open_backend("mysql://app:pw@db1,db2:3307/app?timeout=2s")
    assert connect_args(backend, failover=True)["host"] == "db1"  # the first: where it starts
    assert hosts_of(StoreURL.parse("mysql://app@/app")) == (("localhost", 3306),)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("mysql://app:pw@db1,,db2/app", "'db1,,db2' has an empty entry"),
        ("mysql://app:pw@db1,/app", "'db1,' has an empty entry"),
        ("mysql://app:pw@:3307,db2/app", "one without a host"),
        ("mysql://app:pw@db1:3306,db1/app", "db1:3306 is named twice"),
        ("mariadb://app:pw@db1,db2:x/app", "port 'x' is not a number"),
        ("mysql+getlock://app:pw@db1,db2/app", "one host only .* use mysql://"),
    ],
)
def test_a_bad_mysql_host_list_is_a_config_error(url: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        open_backend(url)
    assert "pw" not in str(caught.value)


def test_mysql_hosts_are_tried_from_the_last_writable_one() -> None:
    from latchkey.stores.io.mysql_dsn import Hosts

    hosts = Hosts((("a", 1), ("b", 2), ("c", 3)))
    assert hosts.order() == [0, 1, 2]
    hosts.found(1)  # b was writable: a failover to b
    assert hosts.order() == [1, 2, 0]
    hosts.missed([1, 2, 0], 1)  # b did not answer in time, and nothing else was tried
    assert hosts.order() == [2, 0, 1]
    hosts.missed([2, 0, 1], 3)  # each tried and refused: the same order again
    assert hosts.order() == [2, 0, 1]
    message = hosts.none_writable(["c:3: read-only (@@read_only = 1)"])
    assert message == (
        "no writable server among 3 hosts: c:3: read-only (@@read_only = 1); "
        "2 more not tried (out of time)"
    )
