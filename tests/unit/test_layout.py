"""Issue 12: a store module stays a few hundred lines, none over 400.

Which files count: every module directly in ``src/latchkey/stores/`` is a store module — the
module of a store in the registry (``sqlite.py``, ``mysql.py``, ``redis_cluster.py``…) or a
part of one kept beside it (``redis_lua.py``, ``mongodb_pipelines.py``, ``zookeeper_line.py``,
``etcd_txn.py``…) — except the shared layer that every store, or a family of them, is built on
and that belongs to no one store: :data:`SHARED`, each with its reason. A new module counts
unless it is added there. The I/O layer (``stores/io/``: drivers) is not a store module either.

A store module over the limit moves out what is not the store's own decision (a driver's error
reading, connection settings, statements or helpers several stores share) to where it belongs,
and may keep the server's own language (scripts, pipelines, table definitions) beside it as
data; docs/concepts/architecture.md says where things live.
"""

from __future__ import annotations

from pathlib import Path

import latchkey.stores
from latchkey.stores import BUILTIN

STORES = Path(latchkey.stores.__file__).parent
LIMIT = 400

#: Modules of ``stores/`` that are no store's: the layer the stores are written on.
SHARED = {
    "__init__.py": "the registry of every store (URL scheme → backend classes)",
    "base.py": "the store protocol the core calls: Backend, AsyncBackend, Waiter, Capabilities",
    "primitives.py": "Store and its StoreBackend / AsyncStoreBackend, written once for all",
    "clients.py": "recognising an application's own client (connect(client=…)) for any store",
    "sql.py": "the SQL lease table, written once for SQLite, PostgreSQL and MySQL/MariaDB",
    "rows_sql.py": "row claiming (store.rows), written once for the three SQL stores",
    "sessionlocks.py": "the session locks, written once for postgresql+advisory and mysql+getlock",
}


def lines(path: Path) -> int:
    """As ``wc -l`` counts them."""
    return path.read_bytes().count(b"\n")


def store_modules() -> list[Path]:
    return sorted(path for path in STORES.glob("*.py") if path.name not in SHARED)


def registered_modules() -> set[str]:
    """The file names of the modules the registry loads stores from."""
    targets = (target for row in BUILTIN.values() for target in row[:2] if target)
    return {target.partition(":")[0].rsplit(".", 1)[-1] + ".py" for target in targets}


def test_no_store_module_is_over_400_lines() -> None:
    counted = {path.name: lines(path) for path in store_modules()}
    assert registered_modules() <= counted.keys()  # the registry's stores are all counted
    over = {name: count for name, count in counted.items() if count > LIMIT}
    assert not over, (
        f"store modules over {LIMIT} lines (issue 12): {over}; move what is not the store's "
        "own decision to where it belongs (see this test's docstring)"
    )


def test_the_shared_modules_are_no_stores() -> None:
    """SHARED is no way round the limit: each entry exists, and no store is registered in it."""
    assert all((STORES / name).is_file() for name in SHARED)
    assert not registered_modules() & SHARED.keys()
