"""``manage.py latchkey …``: latchkey's command line on the store from the settings.

``manage.py latchkey ls``, ``show NAME``, ``run NAME -- CMD``, ``release NAME --force``,
``purge``, ``check``, ``rows TABLE``, ``init``: the arguments and exit statuses of the
``latchkey`` command (see its reference), with ``--url`` defaulting to the settings' store.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Sequence
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from latchkey.cli import EX_CONFIG, main
from latchkey.errors import ConfigError

#: Options ManagementUtility has read already; latchkey's parser does not know them.
_DJANGO_OPTIONS = ("--settings", "--pythonpath")


class Command(BaseCommand):  # type: ignore[misc]  # Django has no type hints
    help = (
        "latchkey's command line (ls, show, run, release, purge, check, rows, init) on the "
        "store from the settings; `manage.py latchkey --help` for latchkey's own help"
    )
    requires_system_checks: list[str] = []  # an operator's tool: it reports its own errors

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("args", nargs=argparse.REMAINDER, help="latchkey's arguments")

    def run_from_argv(self, argv: list[str]) -> None:
        """``manage.py latchkey …``: everything after the command name goes to latchkey's
        own parser (Django's would reject its options); exit with its status."""
        sys.exit(run(_without_django_options(argv[2:])))

    def handle(self, *args: str, **options: Any) -> None:
        """``call_command("latchkey", "ls", "--json", stdout=out)``: a non-zero status
        raises CommandError with that ``returncode``."""
        with (
            contextlib.redirect_stdout(_Stream(self.stdout)),
            contextlib.redirect_stderr(_Stream(self.stderr)),
        ):
            status = run(list(args))
        if status:
            raise CommandError(f"latchkey exited with status {status}", returncode=status)


def run(args: Sequence[str]) -> int:
    """Run latchkey's CLI with ``--url`` from the settings (a ``--url`` in ``args`` wins)."""
    from latchkey.contrib.django import store_url

    try:
        url = store_url()
    except ConfigError as exc:
        print(f"latchkey: {exc}", file=sys.stderr)
        return EX_CONFIG
    return main(["--url", url, *args])


def _without_django_options(words: list[str]) -> list[str]:
    kept: list[str] = []
    skip = False
    for i, word in enumerate(words):
        if skip:
            skip = False
        elif word == "--":
            return kept + words[i:]
        elif word in _DJANGO_OPTIONS:
            skip = True
        elif not word.startswith(tuple(f"{o}=" for o in _DJANGO_OPTIONS)):
            kept.append(word)
    return kept


class _Stream:
    """print() into a Django OutputWrapper, which would add a newline to every write."""

    def __init__(self, out: Any) -> None:
        self._out = out

    def write(self, text: str) -> int:
        self._out.write(text, ending="")
        return len(text)

    def flush(self) -> None:
        self._out.flush()
