"""System checks: ``latchkey.E001`` (the settings give no usable store) always, and
``latchkey.W001`` (the store cannot be reached) with the database checks (``manage.py check
--database default``, ``migrate``), as Django runs checks that do I/O."""

from __future__ import annotations

from typing import Any

from django.core.checks import CheckMessage, Error, Warning

from latchkey._store import connect
from latchkey.errors import ConfigError, StoreUnavailable


def check_settings(app_configs: Any = None, **_: Any) -> list[CheckMessage]:
    """latchkey.E001: the store URL from the settings, or one of its options, is wrong."""
    from latchkey.contrib.django import store_url

    try:
        connect(store_url()).close()  # validates the URL and options; connects on first use
    except ConfigError as exc:
        return [
            Error(
                f"latchkey: {exc}",
                hint="Set LATCHKEY_URL, or LATCHKEY = {'URL': …} or {'DATABASE': alias}.",
                id="latchkey.E001",
            )
        ]
    return []


def check_store(app_configs: Any = None, databases: Any = None, **_: Any) -> list[CheckMessage]:
    """latchkey.W001: the store does not answer (run with the database checks only)."""
    from latchkey.contrib.django import get_store

    if not databases:
        return []
    try:
        store = get_store()
    except ConfigError:
        return []  # E001 says it
    try:
        store.is_free("latchkey:django-check")
    except StoreUnavailable as exc:
        return [
            Warning(
                f"latchkey: the store {store.url} cannot be reached: {exc}",
                hint="Locks will fail with StoreUnavailable until it answers.",
                id="latchkey.W001",
            )
        ]
    return []
