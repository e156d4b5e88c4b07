"""Shared fixtures: the table of stores, disposable servers, one namespace per test.

Environment:
- ``LATCHKEY_TEST_STORES=sqlite,redis`` runs the store-parametrized tests on those rows only.
- ``LATCHKEY_TEST_<SERVER>_URL`` uses an existing server instead of starting one.
- ``CI=true``: a server that cannot be started fails the run instead of skipping, except for
  rows marked ``required_in_ci=False`` (none today).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import latchkey
from tests import asyncmode, leaks, servers

servers.load_all()

_selected = {s.strip() for s in os.environ.get("LATCHKEY_TEST_STORES", "").split(",") if s.strip()}
_unknown = _selected - {row.id for row in servers.ROWS}
if _unknown:
    raise pytest.UsageError(f"LATCHKEY_TEST_STORES names unknown stores: {sorted(_unknown)}")
ROWS = [row for row in servers.ROWS if not _selected or row.id in _selected]


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    leaks.install()  # after pytest's own unraisable hook: see tests/leaks.py


class ServerPool:
    """Starts each server kind once, on first use; stops what it started at the end."""

    def __init__(self) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="latchkey-test-"))
        self.running: dict[str, servers.RunningServer] = {}
        self.external: dict[str, str] = {}
        self.failed: dict[str, str] = {}

    def base_url(self, name: str) -> str:
        kind = servers.SERVERS[name]
        if url := os.environ.get(kind.env_var):
            self.external[name] = url
            return url
        if name in self.failed:
            raise servers.ServerUnavailable(self.failed[name])
        if name not in self.running:
            try:
                workdir = self.workdir / name
                workdir.mkdir(parents=True, exist_ok=True)
                self.running[name] = kind.start(workdir)
            except servers.ServerUnavailable as exc:
                self.failed[name] = str(exc)
                raise
        return self.running[name].url

    def stop_all(self) -> None:
        for server in self.running.values():
            server.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def server_pool() -> Iterator[ServerPool]:
    pool = ServerPool()
    try:
        yield pool
    finally:
        pool.stop_all()


#: The APIs the contract suite runs in: the sync one, and the asyncio one through
#: tests/asyncmode.py. ``LATCHKEY_TEST_APIS=sync`` limits them.
APIS = [a for a in os.environ.get("LATCHKEY_TEST_APIS", "sync,async").split(",") if a]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "store_row" in metafunc.fixturenames:
        # A module may name the rows it runs on (``STORE_ROWS = {"sqlite", "redis"}``): for
        # tests of the core that need a real store or two, not every store.
        only = getattr(metafunc.module, "STORE_ROWS", None)
        rows = [row for row in ROWS if only is None or row.id in only]
        metafunc.parametrize("store_row", rows, ids=[row.id for row in rows])
    if "api" in metafunc.fixturenames:
        metafunc.parametrize("api", APIS)


#: Store-specific modules and the server kind they use (for --dist loadgroup, below).
MODULE_SERVER = {
    "test_postgresql_specific": "postgresql",
    "test_mysql_specific": "mysql",
    "test_redis_specific": "redis",
    "test_redis_cluster_specific": "redis_cluster",
    "test_redis_tls": "redis_tls",  # servers of its own, on one worker
    "test_memcached_specific": "memcached",
    "test_mongodb_specific": "mongodb",
    "test_etcd_specific": "etcd",
    "test_zookeeper_specific": "zookeeper",
    "test_fastapi": "redis",
    "test_celery": "redis",
    "test_celery_green": "postgresql",  # and redis: a server start cheaper than PostgreSQL's
    "test_django": "postgresql",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``-n N --dist loadgroup``, as scripts/test runs the suite) every
    test of one server kind runs on one worker, so each worker starts only the servers of its
    groups, once; tests without a server spread over every worker.

    A module whose ``STORE_ROWS`` names none of the selected rows gets no ``store_row`` value
    (pytest's empty parameter set): its tests are deselected, as the selection asked."""
    kept, dropped = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        row = callspec.params.get("store_row") if callspec is not None else None
        if "store_row" in getattr(item, "fixturenames", ()) and not isinstance(
            row, servers.StoreRow
        ):
            dropped.append(item)
            continue
        kept.append(item)
        group = row.server if row is not None else MODULE_SERVER.get(item.path.stem)
        if item.path.parent.name == "failover":  # clusters of their own: one at a time
            group = "failover"
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


_RERUNS: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Remembers each test that failed once and was run again (scripts/test passes
    ``--reruns 1``: pytest-rerunfailures), with the first line of its failure."""
    if report.outcome == "rerun":  # type: ignore[comparison-overlap]
        lines = [line for line in report.longreprtext.splitlines() if line.startswith("E ")]
        why = lines[0][1:].strip() if lines else report.longreprtext.strip()[-200:]
        _RERUNS.append(f"{report.nodeid} ({report.when}): {why[:600]}{_where(report)}")


def _where(report: pytest.TestReport) -> str:
    """Where the failure was raised: the deepest frames of latchkey's source (or else the
    test's), so that a flake seen only in CI's summary can be looked into."""
    chain = getattr(report.longrepr, "chain", None) or []
    entries = []
    for traceback, _crash, _description in chain:
        entries.extend(getattr(traceback, "reprentries", []))
    places = []
    for entry in entries:
        loc = getattr(entry, "reprfileloc", None)
        if loc is not None:
            places.append(f"{loc.path}:{loc.lineno}")
    ours = [p for p in places if "latchkey/" in p and "/tests/" not in p] or places
    return f" [at {', '.join(ours[-3:])}]" if ours else ""


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Every rerun, said plainly at the end: a test that passed only on its second run is a
    flake to look into, not a pass to forget."""
    if _RERUNS:
        terminalreporter.section("failed once, then passed on the rerun (look into these)")
        for line in _RERUNS:
            terminalreporter.write_line(line)


def _unavailable(row: servers.StoreRow, reason: str) -> None:
    if os.environ.get("CI") and row.required_in_ci:
        pytest.fail(f"{row.id}: server required in CI but unavailable: {reason}")
    pytest.skip(f"{row.id}: not run: {reason}")


@pytest.fixture
def base_url(store_row: servers.StoreRow, server_pool: ServerPool) -> str:
    """The row's store URL without per-test isolation (embedded stores: '')."""
    if store_row.server is None:
        return ""
    try:
        return store_row.base_url(server_pool.base_url(store_row.server))
    except servers.ServerUnavailable as exc:
        _unavailable(store_row, str(exc))
        raise AssertionError("unreachable") from exc


@pytest.fixture
def store_url(store_row: servers.StoreRow, base_url: str, tmp_path: Path) -> str:
    """A URL for this test alone: a fresh table, prefix, collection or file."""
    return store_row.isolate(base_url, uuid.uuid4().hex[:12], tmp_path)


@pytest.fixture
def connect(api: str) -> Iterator[Callable[[str], latchkey.Store]]:
    """``latchkey.connect`` in this test's API: the sync one, or the asyncio one seen through
    a sync facade (tests/asyncmode.py), so that one test body checks both.

    Every store it made is closed again when the test ends, also when the test failed before
    its own ``close()``: a failed attempt's open sockets were found by the garbage collector
    in whichever test ran next on that worker, which then failed on the ResourceWarning (the
    reruns of ``test_a_frozen_server_is_unavailable_within_the_timeout``)."""
    made: list[latchkey.Store] = []

    def connect(url: str) -> latchkey.Store:
        if api == "sync":
            store = latchkey.connect(url)
        else:
            try:
                store = asyncmode.connect(url)
            except latchkey.Unsupported as exc:
                pytest.skip(f"async: not run: {exc}")
        made.append(store)
        return store

    yield connect
    for store in made:
        with contextlib.suppress(Exception):  # closed already, or the test broke the server
            store.close()


@pytest.fixture
def store(
    store_url: str, connect: Callable[[str], latchkey.Store], request: pytest.FixtureRequest
) -> Iterator[latchkey.Store]:
    s = connect(store_url)
    needed = [c for marker in request.node.iter_markers("requires") for c in marker.args]
    missing = [c for c in needed if not getattr(s.capabilities, c)]
    if missing:
        s.close()
        pytest.skip(f"{s.scheme} store declares no {', '.join(missing)} (capabilities)")
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def running_server(
    store_row: servers.StoreRow, server_pool: ServerPool, base_url: str
) -> servers.RunningServer:
    """The server behind this row, for fault tests that stop and restart it."""
    if store_row.server is None:
        pytest.skip(f"{store_row.id}: embedded store, no server to stop")
    if store_row.server in server_pool.external:
        pytest.skip(f"{store_row.id}: uses an existing server (env var); will not stop it")
    return server_pool.running[store_row.server]


@pytest.fixture
def name() -> str:
    """A lock name no other test uses."""
    return f"test:{uuid.uuid4().hex[:12]}"
