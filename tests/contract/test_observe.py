"""Metrics and traces (``latchkey.enable_metrics``, ``latchkey.enable_tracing``) on real stores,
in the sync and the asyncio API, recorded by the real libraries: prometheus_client into a
registry of the test's own, OpenTelemetry's SDK into an in-memory exporter.

The instrumentation is the core's (one wrapper around the rules' generators), so two stores
show it: SQLite (polling, embedded) and Redis (a server, push wake-ups).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from prometheus_client import CollectorRegistry

import latchkey
from latchkey import LockLost, StoreUnavailable, _observe
from tests import servers

STORE_ROWS = {"sqlite", "redis"}


@pytest.fixture
def registry() -> Iterator[CollectorRegistry]:
    reg = CollectorRegistry()
    latchkey.enable_metrics(reg)
    try:
        yield reg
    finally:
        latchkey.disable_metrics()


@pytest.fixture
def provider() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    latchkey.enable_tracing(tracer_provider)
    try:
        yield tracer_provider, exporter
    finally:
        latchkey.disable_tracing()
        tracer_provider.shutdown()


def value(reg: CollectorRegistry, metric: str, **labels: str) -> float:
    """A sample's value; 0 when the labelled series does not exist yet."""
    return reg.get_sample_value(metric, labels) or 0.0


def ours(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    """The finished spans about lock ``name``, in the order they ended."""
    return [
        s
        for s in exporter.get_finished_spans()
        if s.attributes is not None and s.attributes.get("latchkey.name") == name
    ]


def test_acquisitions_are_counted_by_outcome(
    store_url: str,
    store_row: servers.StoreRow,
    connect: Callable[[str], latchkey.Store],
    registry: CollectorRegistry,
    name: str,
) -> None:
    labels = {"store": store_row.id, "kind": "lock"}
    store, other = connect(store_url), connect(store_url)
    try:
        holder = store.lock(name, ttl="30s")
        assert holder.acquire()
        assert other.lock(name, ttl="30s", wait=0).acquire() is False
        assert other.lock(name, ttl="30s", wait="200ms").acquire() is False
        assert holder.release() is True
        assert holder.release() is False  # not held: a no-op, not counted
    finally:
        store.close()
        other.close()
    count = "latchkey_acquisitions_total"
    assert value(registry, count, **labels, outcome="granted") == 1
    assert value(registry, count, **labels, outcome="busy") == 1
    assert value(registry, count, **labels, outcome="timeout") == 1
    assert value(registry, "latchkey_releases_total", **labels, outcome="released") == 1
    wait = "latchkey_acquire_wait_seconds"
    assert value(registry, f"{wait}_count", **labels, outcome="timeout") == 1
    assert value(registry, f"{wait}_sum", **labels, outcome="timeout") >= 0.2
    # every acquire reached the store at least once (the timeout more often); one release
    trips = "latchkey_store_round_trip_seconds_count"
    assert value(registry, trips, store=store_row.id, operation="acquire") >= 3
    assert value(registry, trips, store=store_row.id, operation="release") == 1


def test_round_trips_off_leaves_the_other_metrics_on(
    store_url: str,
    store_row: servers.StoreRow,
    connect: Callable[[str], latchkey.Store],
    registry: CollectorRegistry,
    name: str,
) -> None:
    latchkey.enable_metrics(registry, round_trips=False)
    labels = {"store": store_row.id, "kind": "lock"}
    store = connect(store_url)
    try:
        with store.lock(name, ttl="30s"):
            assert value(registry, "latchkey_leases_held", **labels) == 1
    finally:
        store.close()
    assert value(registry, "latchkey_acquisitions_total", **labels, outcome="granted") == 1
    assert value(registry, "latchkey_releases_total", **labels, outcome="released") == 1
    assert value(registry, "latchkey_hold_seconds_count", **labels) == 1
    assert value(registry, "latchkey_leases_held", **labels) == 0
    trips = "latchkey_store_round_trip_seconds_count"
    assert value(registry, trips, store=store_row.id, operation="acquire") == 0
    assert value(registry, trips, store=store_row.id, operation="release") == 0


def test_leases_held_goes_up_and_back_down(
    store_url: str,
    store_row: servers.StoreRow,
    connect: Callable[[str], latchkey.Store],
    registry: CollectorRegistry,
    name: str,
) -> None:
    store = connect(store_url)
    lock_labels = {"store": store_row.id, "kind": "lock"}
    slot_labels = {"store": store_row.id, "kind": "semaphore"}
    try:
        with store.lock(name, ttl="30s"):
            assert value(registry, "latchkey_leases_held", **lock_labels) == 1
            with store.semaphore(f"{name}:s", limit=3, ttl="30s"):
                assert value(registry, "latchkey_leases_held", **slot_labels) == 1
            assert value(registry, "latchkey_leases_held", **slot_labels) == 0
        assert value(registry, "latchkey_leases_held", **lock_labels) == 0
    finally:
        store.close()
    assert value(registry, "latchkey_hold_seconds_count", **lock_labels) == 1
    assert value(registry, "latchkey_hold_seconds_count", **slot_labels) == 1
    assert value(registry, "latchkey_acquisitions_total", **slot_labels, outcome="granted") == 1


def test_a_lost_lease_is_counted_once(
    store_url: str,
    store_row: servers.StoreRow,
    connect: Callable[[str], latchkey.Store],
    registry: CollectorRegistry,
    name: str,
) -> None:
    labels = {"store": store_row.id, "kind": "lock"}
    store = connect(store_url)
    try:
        lock = store.lock(name, ttl="30s")
        assert lock.acquire()
        assert store.force_release(name)
        with pytest.raises(LockLost):
            lock.extend()
        with pytest.raises(LockLost):
            lock.extend()
        assert value(registry, "latchkey_leases_held", **labels) == 0
        assert lock.release() is False
    finally:
        store.close()
    assert value(registry, "latchkey_leases_lost_total", **labels) == 1
    assert value(registry, "latchkey_extends_total", **labels, outcome="lost") == 2
    assert value(registry, "latchkey_releases_total", **labels, outcome="expired") == 1
    assert value(registry, "latchkey_hold_seconds_count", **labels) == 1
    assert value(registry, "latchkey_leases_held", **labels) == 0


def test_a_claim_counts_each_name(
    store_url: str,
    store_row: servers.StoreRow,
    connect: Callable[[str], latchkey.Store],
    registry: CollectorRegistry,
    name: str,
) -> None:
    labels = {"store": store_row.id, "kind": "claim"}
    store = connect(store_url)  # both rows' stores have batch claims
    names = [f"{name}:{i}" for i in range(3)]
    try:
        with store.lock(names[1], ttl="30s"), store.claim(names, ttl="30s") as claim:
            assert claim.acquired == [names[0], names[2]]
            assert value(registry, "latchkey_leases_held", **labels) == 2
            assert claim.release(names[0])
            assert value(registry, "latchkey_leases_held", **labels) == 1
    finally:
        store.close()
    count = "latchkey_acquisitions_total"
    assert value(registry, count, **labels, outcome="granted") == 2
    assert value(registry, count, **labels, outcome="busy") == 1
    assert value(registry, "latchkey_releases_total", **labels, outcome="released") == 2
    assert value(registry, "latchkey_leases_held", **labels) == 0
    assert value(registry, "latchkey_hold_seconds_count", **labels) == 2


def test_an_unreachable_store_counts_unavailable(
    connect: Callable[[str], latchkey.Store],
    registry: CollectorRegistry,
    provider: tuple[TracerProvider, InMemorySpanExporter],
    name: str,
) -> None:
    store = connect(f"redis://127.0.0.1:{servers.free_port()}/0?timeout=2s")
    try:
        with pytest.raises(StoreUnavailable):
            store.lock(name, ttl="10s", wait=0).acquire()
    finally:
        store.close()
    labels = {"store": "redis", "kind": "lock", "outcome": "unavailable"}
    assert value(registry, "latchkey_acquisitions_total", **labels) == 1
    assert value(registry, "latchkey_acquire_wait_seconds_count", **labels) == 1
    [span] = ours(provider[1], name)
    assert span.attributes is not None and span.attributes["latchkey.outcome"] == "unavailable"
    assert span.status.status_code is StatusCode.ERROR
    assert any(event.name == "exception" for event in span.events)


def test_spans_carry_name_token_and_outcome(
    store_url: str,
    store_row: servers.StoreRow,
    connect: Callable[[str], latchkey.Store],
    provider: tuple[TracerProvider, InMemorySpanExporter],
    name: str,
) -> None:
    exporter = provider[1]
    store = connect(store_url)
    try:
        lock = store.lock(name, ttl="30s")
        assert lock.acquire()
        token = lock.token
        assert store.lock(name, ttl="30s", wait=0).acquire() is False
        lock.extend("1m")
        assert lock.release()
    finally:
        store.close()
    spans = ours(exporter, name)
    assert [s.name for s in spans] == [
        "latchkey.acquire", "latchkey.acquire", "latchkey.extend", "latchkey.release",
    ]  # fmt: skip
    outcomes = [s.attributes["latchkey.outcome"] for s in spans if s.attributes is not None]
    assert outcomes == ["granted", "busy", "extended", "released"]
    for span in spans:
        assert span.attributes is not None
        assert span.attributes["latchkey.store"] == store_row.id
        assert span.attributes["latchkey.kind"] == "lock"
        assert span.status.status_code is StatusCode.UNSET
    assert isinstance(token, int)
    tokens = [s.attributes.get("latchkey.token") for s in spans if s.attributes is not None]
    assert tokens == [token, None, token, token]


def test_the_span_is_current_while_the_operation_runs(
    store_url: str,
    provider: tuple[TracerProvider, InMemorySpanExporter],
    name: str,
) -> None:
    """A span started inside an operation (by an instrumented driver, say) is its child, and
    the operation's span is a child of the caller's: in a thread and in an asyncio task."""
    tracer_provider, exporter = provider
    tracer = tracer_provider.get_tracer("test")

    def on_lost(lock: latchkey.Lock) -> None:  # runs inside the extend that finds the loss
        tracer.start_span("inside").end()

    store = latchkey.connect(store_url)
    try:
        with tracer.start_as_current_span("outer") as outer:
            lock = store.lock(name, ttl="30s", on_lost=on_lost)
            assert lock.acquire()
            store.force_release(name)
            with pytest.raises(LockLost):
                lock.extend()
    finally:
        store.close()

    async def in_a_task() -> None:
        async with latchkey.connect_async(store_url) as astore:
            with tracer.start_as_current_span("outer-async"):
                async with astore.lock(f"{name}:a", ttl="30s"):
                    pass

    asyncio.run(in_a_task())
    assert trace.get_current_span() is trace.INVALID_SPAN  # nothing left attached
    finished = {s.name: s for s in exporter.get_finished_spans()}
    extend, inside = finished["latchkey.extend"], finished["inside"]
    assert inside.parent is not None and inside.parent.span_id == extend.context.span_id
    assert extend.parent is not None and extend.parent.span_id == outer.get_span_context().span_id
    [acquire] = ours(exporter, f"{name}:a")[:1]
    assert acquire.parent is not None
    assert acquire.parent.span_id == finished["outer-async"].context.span_id


def test_nothing_is_recorded_when_off(
    store_url: str,
    connect: Callable[[str], latchkey.Store],
    name: str,
) -> None:
    reg, exporter = CollectorRegistry(), InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    latchkey.enable_metrics(reg)
    latchkey.enable_tracing(tracer_provider)
    latchkey.disable_metrics()
    latchkey.disable_tracing()
    assert _observe.hooks is None
    store = connect(store_url)
    try:
        with store.lock(name, ttl="30s") as lock:
            lock.extend()
            assert store.lock(name, wait=0).acquire() is False
        with store.claim([f"{name}:c"], ttl="30s"):
            pass
    finally:
        store.close()
        tracer_provider.shutdown()
    recorded = [
        (sample.name, sample.value)
        for metric in reg.collect()
        for sample in metric.samples
        if not sample.name.endswith("_created") and sample.value
    ]
    assert recorded == []
    assert exporter.get_finished_spans() == ()
