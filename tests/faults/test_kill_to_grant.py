"""The checker's kill-to-grant rule on histories written by hand: a name is measured from when
it could first be granted again (its lease may have ended, and another worker asked), so a
name nobody asked for is not a violation and a waiter kept waiting is."""

from __future__ import annotations

from tests.faults.checker import check
from tests.faults.history import History, Op

TTL = 1.0
BOUND = 4.0


def _grant(id_: int, worker: int, inv: float, ret: float, token: int, **args: object) -> Op:
    args = {"ttl": TTL, "wait": 0, "lid": f"{worker}:{id_}", **args}
    return Op(id_, worker, "acquire", "hot", args, inv, ret, ("granted", token))


def _busy(id_: int, worker: int, inv: float, ret: float, wait: float = 0) -> Op:
    args = {"ttl": TTL, "wait": wait, "lid": f"{worker}:{id_}"}
    return Op(id_, worker, "acquire", "hot", args, inv, ret, ("busy",))


def _violations(*ops: Op, killed_at: float = 10.0) -> list[str]:
    history = History(ops=list(ops), kills=[(1, killed_at)])
    report = check(history, timeout=2.0, semaphores={}, records=[], record_values={},
                   kill_bound=BOUND)  # fmt: skip
    return [v for v in report.violations if v.startswith("kill-to-grant")]


def test_a_name_nobody_asked_for_is_not_held_against_the_store() -> None:
    held = _grant(1, 1, 9.4, 9.5, 1)  # may live until 10.5
    early_try = _busy(2, 2, 10.2, 10.3)  # answered busy while the lease may still live
    late = _grant(3, 2, 30.0, 30.1, 2)  # the next ask, 20 s later, granted at once
    assert _violations(held, early_try, late) == []


def test_a_waiter_kept_past_the_bound_is_a_violation() -> None:
    held = _grant(1, 1, 9.0, 9.1, 1)
    waiting = _grant(2, 2, 10.2, 17.0, 2, wait=30)  # asked before the lease could end
    (found,) = _violations(held, waiting)
    assert "granted 7.00s after its holder was killed" in found


def test_busy_answers_after_the_lease_could_end_count_as_asking() -> None:
    held = _grant(1, 1, 9.0, 9.1, 1)
    refused = _busy(2, 2, 11.0, 11.1)  # asked once the lease had surely run out: refused
    late = _grant(3, 3, 16.0, 16.1, 2)
    (found,) = _violations(held, refused, late)
    assert "after it could first be" in found


def test_a_renewed_lease_may_last_a_ttl_past_the_kill() -> None:
    held = _grant(1, 1, 5.0, 5.1, 1, renew=True)  # granted long before the kill, renewed
    waiting = _grant(2, 2, 10.5, 14.9, 2, wait=30)  # lease could end at 11.0: 3.9 s later
    assert _violations(held, waiting) == []
    plain = _grant(1, 1, 5.0, 5.1, 1)  # not renewed: it ran out at 6.1, before the kill
    assert len(_violations(plain, waiting)) == 1
