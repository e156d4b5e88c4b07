"""Django's test runner, closing latchkey's connections before the test databases go.

latchkey reaches the test database on connections of its own; PostgreSQL refuses to drop a
database while they are open ("is being accessed by other users"). Set::

    TEST_RUNNER = "latchkey.contrib.django.testing.DiscoverRunner"

(or call :func:`latchkey.contrib.django.close_store` before the databases are torn down in a
runner of your own, or in a session fixture of pytest-django).
"""

from __future__ import annotations

from typing import Any

from django.test.runner import DiscoverRunner as _DiscoverRunner

from latchkey.contrib.django import close_store


class DiscoverRunner(_DiscoverRunner):  # type: ignore[misc]  # Django has no type hints
    """Django's ``DiscoverRunner`` that closes the latchkey store before tearing down the
    test databases."""

    def teardown_databases(self, old_config: Any, **kwargs: Any) -> None:
        close_store()
        super().teardown_databases(old_config, **kwargs)
