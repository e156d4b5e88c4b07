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


def _op(history: History, worker: int, inv: float, ret: float, result: Any, wait: float) -> None:
    args = {"ttl": 1.0, "wait": wait, "lid": f"{worker}:{len(history.ops) + 1}"}
    history.ops.append(Op(len(history.ops) + 1, worker, "acquire", "a", args, inv, ret, result))


def _waiter_kept(*outages: Fault) -> Any:
    """Worker 1 holds ``a`` from t=0 (TTL 1 s: free from 1.01), is SIGKILLed at t=0.5; worker
    2 asks at 1.5 with a long wait and is granted ``a`` at 8.0: 6.5 s after it could first
    be, over the bound (4 s) — unless ``outages`` held every grant up meanwhile."""
    history = History(faults=list(outages), kills=[(1, 0.5)])
    _op(history, 1, 0.0, 0.01, ("granted", 1), 0)
    _op(history, 2, 1.5, 8.0, ("granted", 2), 30)
    return check(history, timeout=2.0, semaphores={}, records=[], record_values={},
                 kill_bound=4.0)  # fmt: skip


def test_kill_to_grant_counts_the_wait_when_the_store_was_up() -> None:
    report = _waiter_kept()
    assert [v.split(":")[0] for v in report.violations] == ["kill-to-grant"]


def test_kill_to_grant_does_not_count_a_server_outage_meanwhile() -> None:
    report = _waiter_kept(Fault("restart", 2.0, 5.0))  # the server restarting for 3 s
    assert report.violations == []
    assert report.kill_to_grant == [pytest.approx(8.0 - 1.5 - 3.0)]


def test_kill_to_grant_counts_overlapping_outages_once() -> None:
    report = _waiter_kept(Fault("restart", 2.0, 4.0), Fault("failover", 3.0, 5.0))
    assert report.kill_to_grant == [pytest.approx(8.0 - 1.5 - 3.0)]


def test_a_latency_fault_is_no_outage() -> None:
    report = _waiter_kept(Fault("latency", 2.0, 5.0))
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


def test_a_lease_that_could_end_before_the_kill_is_not_the_kills() -> None:
    """Worker 1 abandoned its lease of ``a`` at t=0 (TTL 1 s); others took ``a`` since; it is
    killed at 25 and the next grant comes at once. Measured from when that old lease could
    end (1.01) and the first ask after it, this read as a 24-second wait: a chaos run of the
    PostgreSQL pair reported five such (13 to 22 s, "its lease could end -47.14s after the
    kill")."""
    history = History(kills=[(1, 25.0)])
    _op(history, 1, 0.0, 0.01, ("granted", 1), 0)
    _op(history, 2, 2.0, 2.01, ("granted", 2), 0)  # later leases of others, released
    release = Op(4, 2, "release", "a", {"lid": "2:2", "token": 2}, 2.5, 2.51, ("ok", True))
    history.ops.append(release)
    _op(history, 3, 25.1, 25.11, ("granted", 3), 0)
    report = check(history, timeout=2.0, semaphores={}, records=[], record_values={},
                   kill_bound=4.0)  # fmt: skip
    assert report.violations == []


def test_only_a_server_fault_renews_a_lease_it_found_live() -> None:
    """The merge of the two kill-to-grant rules: a server fault that began while the killed
    holder's lease may still have been live may renew it (its end + TTL: etcd's new leader
    does); a network latency fault renews nothing, even one that began then."""

    def kept(fault: Fault) -> list[str]:
        # Worker 1 holds ``a`` (free from 1.01) and is killed at 0.5; the fault begins at 0.8
        # and ends at 2.0; worker 2 asks at 1.5 and is granted at 6.5.
        history = History(faults=[fault], kills=[(1, 0.5)])
        _op(history, 1, 0.0, 0.01, ("granted", 1), 0)
        _op(history, 2, 1.5, 6.5, ("granted", 2), 30)
        report = check(history, timeout=2.0, semaphores={}, records=[], record_values={},
                       kill_bound=4.0)  # fmt: skip
        return [v.split(":")[0] for v in report.violations]

    assert kept(Fault("restart", 0.8, 2.0)) == []  # from 3.0: 3.5 s, within 4 s
    assert kept(Fault("latency", 0.8, 2.0)) == ["kill-to-grant"]  # from 1.5: 5.0 s
