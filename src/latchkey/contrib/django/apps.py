"""The Django app of latchkey: registers the system checks and follows setting changes."""

from __future__ import annotations

from typing import Any

from django.apps import AppConfig


class LatchkeyConfig(AppConfig):  # type: ignore[misc]  # Django has no type hints
    name = "latchkey.contrib.django"
    label = "latchkey"
    verbose_name = "latchkey"

    def ready(self) -> None:
        from django.core.checks import Tags, register
        from django.test.signals import setting_changed

        from latchkey.contrib.django import checks

        register(checks.check_settings)
        register(checks.check_store, Tags.database)
        setting_changed.connect(_setting_changed, weak=False)


def _setting_changed(setting: str = "", **_: Any) -> None:
    if setting in ("LATCHKEY", "LATCHKEY_URL", "DATABASES"):
        from latchkey.contrib.django import close_store

        close_store()
