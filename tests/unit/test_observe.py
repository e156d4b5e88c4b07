"""Metrics and tracing without I/O: enabling and disabling, the missing extra, the wrapper's
delegation of a core generator, and the docs listing every metric. The recorded values on real
stores are tested in tests/contract/test_observe.py."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry, Counter

import latchkey
from latchkey import ConfigError, _observe
from latchkey._core.ops import Steps, call, on, sleep
from latchkey._metrics import METRICS
from latchkey._run import run

DOCS = Path(__file__).resolve().parents[2] / "docs" / "howto" / "metrics-and-tracing.md"


@pytest.fixture(autouse=True)
def _off() -> Iterator[None]:
    yield
    latchkey.disable_metrics()
    latchkey.disable_tracing()


def test_off_until_enabled_and_off_again() -> None:
    assert _observe.hooks is None
    latchkey.enable_metrics(CollectorRegistry())
    latchkey.enable_tracing(TracerProvider())
    latchkey.disable_metrics()
    assert _observe.hooks is not None and _observe.hooks.metrics is None
    latchkey.disable_tracing()
    assert _observe.hooks is None


def test_enabling_twice_registers_once() -> None:
    reg, other = CollectorRegistry(), CollectorRegistry()
    latchkey.enable_metrics(reg)
    first = _observe.hooks.metrics if _observe.hooks else None
    latchkey.enable_metrics(reg)  # prometheus_client would raise on a duplicate
    latchkey.enable_metrics(other)
    latchkey.enable_metrics(reg)
    assert _observe.hooks is not None and _observe.hooks.metrics is first
    names = {m.name for m in reg.collect()}
    assert "latchkey_acquisitions" in names and "latchkey_leases_held" in names


def test_a_registry_with_a_name_taken_is_a_config_error_and_left_as_it_was() -> None:
    reg = CollectorRegistry()
    Counter("latchkey_leases_lost", "someone else's", registry=reg)
    before = {m.name for m in reg.collect()}
    with pytest.raises(ConfigError, match="latchkey_leases_lost"):
        latchkey.enable_metrics(reg)
    assert {m.name for m in reg.collect()} == before
    assert _observe.hooks is None


@pytest.mark.parametrize(
    ("enable", "module", "extra"),
    [
        (latchkey.enable_metrics, "prometheus_client", "latchkey[prometheus]"),
        (latchkey.enable_tracing, "opentelemetry", "latchkey[otel]"),
    ],
)
def test_without_the_extra_a_config_error_says_what_to_install(
    enable: Any, module: str, extra: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # what `import` sees when it is absent
    with pytest.raises(ConfigError, match=re.escape(extra)):
        enable()
    assert _observe.hooks is None


class Backend:
    """A store's backend as the runner sees it, without a store: answers from a list."""

    class url:  # stands for a StoreURL: only its scheme is read
        scheme = "fake"

    def __init__(self) -> None:
        self.answers: list[Any] = ["granted", ConnectionError("cut"), True]

    def _answer(self, *args: Any) -> Any:
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    acquire = extend = release = _answer


class Waiter:
    def wait(self, seconds: float) -> bool:
        return True


def test_the_runner_times_store_primitives_only_while_metrics_are_on() -> None:
    reg = CollectorRegistry()
    seen: list[Any] = []

    def rule() -> Steps[str]:
        seen.append((yield call("acquire", "n")))
        seen.append((yield on(Waiter(), "wait", 1.0)))
        try:
            yield call("extend", "n")
        except ConnectionError as exc:
            seen.append(exc)
        yield sleep(0)
        seen.append((yield call("release", "n")))
        return "done"

    assert run(rule(), Backend()) == "done"  # type: ignore[arg-type]
    latchkey.enable_metrics(reg)
    seen.clear()
    assert run(rule(), Backend()) == "done"  # type: ignore[arg-type]
    assert seen[0] == "granted" and seen[1] is True and isinstance(seen[2], ConnectionError)
    trips = "latchkey_store_round_trip_seconds_count"
    counts = {"acquire": 1.0, "extend": 1.0, "release": 1.0, "wait": None}
    for operation, count in counts.items():  # a failed call is timed too; a waiter's is not
        assert reg.get_sample_value(trips, {"store": "fake", "operation": operation}) == count
    latchkey.enable_metrics(reg, round_trips=False)  # the same metrics, round trips untimed
    assert _observe.timer is None and _observe.hooks is not None
    assert run(rule(), Backend()) == "done"  # type: ignore[arg-type]
    for operation, count in counts.items():
        assert reg.get_sample_value(trips, {"store": "fake", "operation": operation}) == count
    latchkey.enable_metrics(reg)
    assert run(rule(), Backend()) == "done"  # type: ignore[arg-type]
    assert reg.get_sample_value(trips, {"store": "fake", "operation": "acquire"}) == 2.0


def test_the_docs_list_every_metric() -> None:
    text = DOCS.read_text()
    listed = set(re.findall(r"^\| `(latchkey_[a-z_]+)` \|", text, flags=re.MULTILINE))
    assert listed == {name for name, *_ in METRICS}
    for name, kind, labels, _ in METRICS:
        row = re.search(rf"^\| `{name}` \| (\w+) \| ([^|]+) \|", text, flags=re.MULTILINE)
        assert row is not None and row.group(1) == kind, name
        assert row.group(2).replace("`", "").split(", ") == list(labels), name
