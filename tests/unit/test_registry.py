"""The table of stores: unknown schemes, missing drivers, third-party entry points."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import latchkey
from latchkey import ConfigError
from latchkey.stores import BUILTIN, backend_class


def test_unknown_scheme_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown store URL scheme 'bogus'.*sqlite"):
        latchkey.connect("bogus://x")


def test_missing_driver_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "lk_fake_store.py").write_text("import lk_driver_that_is_not_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(BUILTIN, "fakedb", ("lk_fake_store:Backend", None, "fakedb"))
    with pytest.raises(ConfigError) as caught:
        latchkey.connect("fakedb://u:hunter2@h/")
    message = str(caught.value)
    assert (
        "pip install 'latchkey[fakedb]'" in message and "lk_driver_that_is_not_installed" in message
    )
    assert "hunter2" not in message
    sys.modules.pop("lk_fake_store", None)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_missing_driver_of_a_store_written_once_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """The store's module imports no driver (its drivers are modules of their own, loaded when
    a backend is made): the missing one is still named with the extra, not a traceback."""
    (tmp_path / "lk_fake_io.py").write_text("import lk_driver_that_is_not_installed\n")
    (tmp_path / "lk_fake_once.py").write_text(
        "from latchkey.stores.primitives import AsyncStoreBackend, Store, StoreBackend\n"
        "class Fake(Store):\n"
        "    scheme = 'fakeonce'\n"
        "    sync_driver = 'lk_fake_io:Driver'\n"
        "    async_driver = 'lk_fake_io:AsyncDriver'\n"
        "class FakeBackend(StoreBackend):\n"
        "    store_class = Fake\n"
        "class AsyncFakeBackend(AsyncStoreBackend):\n"
        "    store_class = Fake\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    row = ("lk_fake_once:FakeBackend", "lk_fake_once:AsyncFakeBackend", "fakeonce")
    monkeypatch.setitem(BUILTIN, "fakeonce", row)
    connect = latchkey.connect if mode == "sync" else latchkey.connect_async
    with pytest.raises(ConfigError, match=r"needs the lk_driver_that_is_not_installed driver: "
                       r"pip install 'latchkey\[fakeonce\]'"):  # fmt: skip
        connect("fakeonce://h/")
    for module in ("lk_fake_once", "lk_fake_io"):
        sys.modules.pop(module, None)


def test_a_class_that_is_not_a_backend_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "lk_not_a_store.py").write_text("class Backend:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(BUILTIN, "notastore", ("lk_not_a_store:Backend", None, None))
    with pytest.raises(ConfigError, match="not a latchkey Backend"):
        backend_class("notastore")
    sys.modules.pop("lk_not_a_store", None)


def test_every_builtin_scheme_loads() -> None:
    for scheme in BUILTIN:
        cls = backend_class(scheme)
        assert cls.capabilities is not None and cls.scheme
