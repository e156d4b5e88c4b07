"""Prometheus metrics of lease operations (the ``prometheus`` extra): the metric definitions and
the recording calls :mod:`latchkey._observe` makes. Imported only by
:func:`latchkey.enable_metrics`, so that nobody who leaves metrics off imports
``prometheus_client``.

Labels are bounded by construction: ``store`` is the URL scheme, ``kind`` one of ``lock``,
``semaphore``, ``claim``, ``outcome`` one of a few words, ``operation`` a store primitive's name.
A lock's name is never a label (one time series per name would grow without bound); spans
carry it instead.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

#: Bucket bounds (seconds). Waits and holds span milliseconds to an hour; a store round trip
#: is tens of microseconds on a local Redis and can be seconds on a struggling server.
WAIT_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    300.0, float("inf"),
)  # fmt: skip
HOLD_BUCKETS = (
    0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 600.0, 1800.0, 3600.0,
    float("inf"),
)  # fmt: skip
ROUND_TRIP_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, float("inf"),
)  # fmt: skip

#: Every metric: (name as exposed, type, labels, help). The docs page lists the same table
#: (tests/unit/test_observe.py checks that they agree).
METRICS = [
    ("latchkey_acquisitions_total", "counter", ("store", "kind", "outcome"),
     "Acquire attempts by outcome: granted, busy, timeout, unavailable, cancelled, error "
     "(a claim counts once per name)."),
    ("latchkey_releases_total", "counter", ("store", "kind", "outcome"),
     "Releases by outcome: released, expired (the lease had already ended), unavailable, "
     "cancelled, error."),
    ("latchkey_extends_total", "counter", ("store", "kind", "outcome"),
     "Extensions (renewals included) by outcome: extended, lost, unavailable, cancelled, error."),
    ("latchkey_leases_lost_total", "counter", ("store", "kind"),
     "Leases found lost while held (a renewal or extend found them gone or too late)."),
    ("latchkey_acquire_wait_seconds", "histogram", ("store", "kind", "outcome"),
     "Time an acquire took, waiting included, by outcome."),
    ("latchkey_hold_seconds", "histogram", ("store", "kind"),
     "Time from grant to release, or to the loss of the lease."),
    ("latchkey_store_round_trip_seconds", "histogram", ("store", "operation"),
     "Duration of each store call made by acquire, release, extend and claims."),
    ("latchkey_leases_held", "gauge", ("store", "kind"),
     "Leases this process holds now (granted, not yet released or lost)."),
]  # fmt: skip


def _strip_total(name: str) -> str:
    return name[: -len("_total")] if name.endswith("_total") else name


class Metrics:
    """The latchkey metrics registered in one Prometheus registry, and the calls that record.

    Recording goes through :class:`Bound` (the children of one store and kind, looked up
    once): ``labels()`` takes a lock and builds a key every time, which would cost more than
    the rest of the recording.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        made: dict[str, Any] = {}
        kinds = {"counter": Counter, "gauge": Gauge}
        buckets = {
            "latchkey_acquire_wait_seconds": WAIT_BUCKETS,
            "latchkey_hold_seconds": HOLD_BUCKETS,
            "latchkey_store_round_trip_seconds": ROUND_TRIP_BUCKETS,
        }
        try:
            for name, kind, labels, text in METRICS:
                if kind == "histogram":
                    made[name] = Histogram(
                        name, text, labels, registry=registry, buckets=buckets[name]
                    )
                else:
                    made[name] = kinds[kind](_strip_total(name), text, labels, registry=registry)
        except ValueError:
            for metric in made.values():  # leave the registry as it was
                registry.unregister(metric)
            raise
        self._acquisitions = made["latchkey_acquisitions_total"]
        self._releases = made["latchkey_releases_total"]
        self._extends = made["latchkey_extends_total"]
        self._lost = made["latchkey_leases_lost_total"]
        self._wait = made["latchkey_acquire_wait_seconds"]
        self._hold = made["latchkey_hold_seconds"]
        self._round_trip = made["latchkey_store_round_trip_seconds"]
        self._held = made["latchkey_leases_held"]
        self._bound: dict[tuple[str, str], Bound] = {}
        self._trips: dict[tuple[str, str], Any] = {}

    def bound(self, store: str, kind: str) -> Bound:
        """The recorder of ``store`` (a URL scheme) and ``kind``, made on first use. Two
        threads may make one each the first time: harmless, ``labels()`` gives both the same
        children."""
        bound = self._bound.get((store, kind))
        if bound is None:
            bound = self._bound[store, kind] = Bound(self, store, kind)
        return bound

    def timed(self, backend: Any, method: str, seconds: float) -> None:
        """A runner carried out the store primitive ``method`` of ``backend`` in ``seconds``
        (the runners call it directly: :data:`latchkey._observe.timer`)."""
        key = (backend.url.scheme, method)
        child = self._trips.get(key)
        if child is None:
            child = self._trips[key] = self._round_trip.labels(*key)
        child.observe(seconds)


class Bound:
    """The labelled children of one store and kind, and the recording calls on them. The
    children of a granted acquire and of a release (the common case) are attributes; those of
    the other outcomes are made on first use."""

    __slots__ = ("_metrics", "_outcomes", "granted", "held", "hold", "kind", "released", "store")

    def __init__(self, metrics: Metrics, store: str, kind: str) -> None:
        self._metrics, self.store, self.kind = metrics, store, kind
        self._outcomes: dict[tuple[Any, str], Any] = {}
        #: (acquisitions counter, wait histogram) of outcome="granted".
        self.granted = self._of_acquire("granted")
        self.held = metrics._held.labels(store, kind)
        self.hold = metrics._hold.labels(store, kind)
        self.released = self._of(metrics._releases, "released")

    def _of(self, metric: Any, outcome: str) -> Any:
        child = self._outcomes.get((metric, outcome))
        if child is None:
            child = self._outcomes[metric, outcome] = metric.labels(self.store, self.kind, outcome)
        return child

    def _of_acquire(self, outcome: str) -> tuple[Any, Any]:
        metrics = self._metrics
        return self._of(metrics._acquisitions, outcome), self._of(metrics._wait, outcome)

    def acquired(self, outcome: str, waited: float, count: int = 1) -> None:
        """An acquire ended with ``outcome`` after ``waited`` seconds, for ``count`` names (a
        claim's). The wait is observed once per acquire."""
        counter, wait = self.granted if outcome == "granted" else self._of_acquire(outcome)
        counter.inc(count)
        wait.observe(waited)
        if outcome == "granted":
            self.held.inc(count)

    def release(self, outcome: str, count: int = 1) -> None:
        if outcome == "released":
            self.released.inc(count)
        else:
            self._of(self._metrics._releases, outcome).inc(count)

    def extended(self, outcome: str) -> None:
        self._of(self._metrics._extends, outcome).inc()

    def lost(self) -> None:
        self._metrics._lost.labels(self.store, self.kind).inc()

    def ended(self, held_for: float, count: int = 1) -> None:
        """``count`` leases granted ``held_for`` seconds ago are no longer held."""
        self.held.dec(count)
        hold = self.hold
        for _ in range(count):
            hold.observe(held_for)
