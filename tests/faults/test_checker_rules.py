"""The checker's timing rules on hand-made histories (no server): what the chaos runs of the
PostgreSQL and MariaDB pairs taught it (docs/reliability.md, "Three-minute runs").

- kill-to-grant does not count the time a server fault held every grant up: a holder killed
  just before a restart of the server cannot have its name back before the server is.
- slow-call allows a store its own bound for one call (PostgreSQL: the timeout + the second
  latchkey's watchdog leaves the server's ``statement_timeout``), not just the timeout.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.faults.checker import check
from tests.faults.history import Fault, History, Op


def _grant(history: History, worker: int, name: str, token: int, inv: float) -> None:
    args = {"ttl": 1.0, "wait": 0, "lid": f"{worker}:{token}"}
    op = Op(len(history.ops) + 1, worker, "acquire", name, args, inv, inv + 0.01)
    op.result = ("granted", token)
    history.ops.append(op)


def _kill_then_grant_after(outage: tuple[float, float] | None, kind: str = "restart") -> Any:
    """Worker 1 holds ``a`` from t=0 (TTL 1 s), is SIGKILLed at t=0.5; worker 2 is granted
    ``a`` at t=8 — 7.5 s later, over TTL + 4 s — with ``outage`` in between or not."""
    history = History()
    _grant(history, 1, "a", 1, 0.0)
    history.kills.append((1, 0.5))
    if outage is not None:
        history.faults.append(Fault(kind, outage[0], outage[1]))
    _grant(history, 2, "a", 2, 8.0)
    return check(history, timeout=2.0, semaphores={}, records=[], record_values={},
                 kill_bound=4.0)  # fmt: skip


def test_kill_to_grant_counts_the_wait_when_the_store_was_up() -> None:
    report = _kill_then_grant_after(None)
    assert [v.split(":")[0] for v in report.violations] == ["kill-to-grant"]


def test_kill_to_grant_does_not_count_a_server_outage_meanwhile() -> None:
    report = _kill_then_grant_after((2.0, 5.0))  # the server restarting for 3 s
    assert report.violations == []
    # granted at 8.01 (its return), killed at 0.5: beyond the TTL, the outage aside
    assert report.kill_to_grant == [pytest.approx(8.01 - 0.5 - 3.0 - 1.0)]


def test_kill_to_grant_counts_overlapping_outages_once() -> None:
    history = History()
    _grant(history, 1, "a", 1, 0.0)
    history.kills.append((1, 0.5))
    history.faults += [Fault("restart", 2.0, 4.0), Fault("failover", 3.0, 5.0)]
    _grant(history, 2, "a", 2, 8.0)
    report = check(history, timeout=2.0, semaphores={}, records=[], record_values={},
                   kill_bound=4.0)  # fmt: skip
    assert report.kill_to_grant == [pytest.approx(8.01 - 0.5 - 3.0 - 1.0)]


def test_a_latency_fault_is_no_outage() -> None:
    report = _kill_then_grant_after((2.0, 5.0), kind="latency")
    assert [v.split(":")[0] for v in report.violations] == ["kill-to-grant"]


def _one_call(took: float, call_bound: float | None) -> Any:
    history = History()
    op = Op(1, 1, "release", "a", {"lid": "1:1", "token": 1}, 0.0, took)
    op.result = ("error", "StoreUnavailable", "release failed: TimeoutError: no answer within 3s")
    history.ops.append(op)
    return check(history, timeout=2.0, semaphores={}, records=[], record_values={},
                 call_bound=call_bound)  # fmt: skip


def test_slow_call_is_measured_against_the_stores_own_bound() -> None:
    slow = _one_call(3.2, None)  # the timeout (2 s) + 1 s: over
    assert [v.split(":")[0] for v in slow.violations] == ["slow-call"]
    assert "no answer within 3s" in slow.violations[0]  # says how the call ended
    assert _one_call(3.2, 3.0).violations == []  # PostgreSQL's: timeout + 1 s, + 1 s
    assert [v.split(":")[0] for v in _one_call(4.1, 3.0).violations] == ["slow-call"]
