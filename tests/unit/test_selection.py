"""``LATCHKEY_TEST_STORES`` selects rows: a module limited to other rows (``STORE_ROWS``) is
deselected, not a collection crash (its tests got pytest's empty parameter set)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_module_of_other_rows_is_deselected_when_one_row_is_selected() -> None:
    env = {**os.environ, "LATCHKEY_TEST_STORES": "zookeeper"}
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist",
           "--co", "-q", "tests/contract/test_observe.py"]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    ids = [line for line in done.stdout.splitlines() if "::" in line]
    assert ids and not [i for i in ids if "sqlite" in i or "redis" in i]  # its rows' tests
    assert "deselected" in done.stdout
