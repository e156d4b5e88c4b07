"""Metrics and traces of lease operations, written once for both APIs; off until enabled.

:data:`hooks` is None while both are off, and then each operation pays one ``is None`` check
(``LeaseCore._acquire`` and its siblings return their plain generator). Once
:func:`enable_metrics` or :func:`enable_tracing` is called, an :class:`Observer` wraps the
core generators of acquire, release, extend and claims: it drives the wrapped generator
(``yield from``) and records how it ended. The same wrapper serves the sync and the asyncio
runner, since both drive the same generators. The runners time each store primitive they
carry out (the round trip) while :data:`timer` is set: one more ``is None`` check per run
(``enable_metrics(round_trips=False)`` leaves it None).

Prometheus and OpenTelemetry are imported only when enabled (``latchkey._metrics``,
``latchkey._tracing``).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from latchkey._core.ops import Steps
from latchkey._durations import parse_wait
from latchkey.errors import ConfigError, LockLost, StoreUnavailable

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider
    from prometheus_client import CollectorRegistry

    from latchkey._core.claim import ClaimCore
    from latchkey._core.lease import LeaseCore
    from latchkey._metrics import Bound, Metrics
    from latchkey._tracing import Tracing

__all__ = ["disable_metrics", "disable_tracing", "enable_metrics", "enable_tracing", "hooks"]

#: The observer of every lease operation, or None when metrics and tracing are both off.
hooks: Observer | None = None
#: What a runner calls after each store primitive it carried out, ``(backend, method,
#: seconds)``, while metrics are on (the store round trip); None while they are off. A runner
#: reads it once per operation it runs.
timer: Callable[[Any, str, float], None] | None = None

_perf = time.perf_counter
_guard = threading.Lock()
_metrics: Metrics | None = None
_round_trips = True
_tracing: Tracing | None = None
#: Metrics already registered in a registry, so that enabling twice registers nothing twice.
_registered: weakref.WeakKeyDictionary[Any, Metrics] = weakref.WeakKeyDictionary()


def enable_metrics(registry: CollectorRegistry | None = None, *, round_trips: bool = True) -> None:
    """Record Prometheus metrics of acquisitions, releases, extensions, lost leases, wait and
    hold times, store round trips and leases held, in ``registry`` (default: the
    ``prometheus_client`` global ``REGISTRY``). Needs the ``prometheus`` extra
    (``pip install 'latchkey[prometheus]'``). Calling it again is harmless: the metrics of a
    registry are registered once and reused (the last call's ``round_trips`` applies).

    ``round_trips=False``: do not time each store call (``latchkey_store_round_trip_seconds``
    stays registered, and empty), which saves about a quarter of what metrics cost.

    .. versionadded:: 0.2
    """
    global _metrics, _round_trips
    try:
        import prometheus_client

        from latchkey._metrics import Metrics
    except ImportError as exc:
        raise ConfigError(
            "enable_metrics needs prometheus-client: pip install 'latchkey[prometheus]'"
        ) from exc
    target = prometheus_client.REGISTRY if registry is None else registry
    with _guard:
        metrics = _registered.get(target)
        if metrics is None:
            try:
                metrics = _registered[target] = Metrics(target)
            except ValueError as exc:  # names taken in that registry by something else
                raise ConfigError(
                    f"enable_metrics: cannot register latchkey's metrics: {exc}"
                ) from exc
        _metrics, _round_trips = metrics, bool(round_trips)
        _install()


def disable_metrics() -> None:
    """Stop recording metrics. They stay registered (and keep their values) in their registry,
    and :func:`enable_metrics` with the same registry takes them up again.

    .. versionadded:: 0.2
    """
    global _metrics
    with _guard:
        _metrics = None
        _install()


def enable_tracing(tracer_provider: TracerProvider | None = None) -> None:
    """Make an OpenTelemetry span for each acquire, release, extend and claim, from
    ``tracer_provider`` (default: the global one, as ``opentelemetry.trace`` finds it when a
    span starts). Needs the ``otel`` extra (``pip install 'latchkey[otel]'``).

    .. versionadded:: 0.2
    """
    global _tracing
    try:
        import opentelemetry.trace  # noqa: F401  # the extra, before our module that uses it

        from latchkey import __version__
        from latchkey._tracing import Tracing
    except ImportError as exc:
        raise ConfigError(
            "enable_tracing needs opentelemetry-api: pip install 'latchkey[otel]'"
        ) from exc
    with _guard:
        _tracing = Tracing(tracer_provider, __version__)
        _install()


def disable_tracing() -> None:
    """Stop making spans.

    .. versionadded:: 0.2
    """
    global _tracing
    with _guard:
        _tracing = None
        _install()


def _install() -> None:
    global hooks, timer
    hooks = None if _metrics is None and _tracing is None else Observer(_metrics, _tracing)
    timer = None if _metrics is None or not _round_trips else _metrics.timed


class Observer:
    """Wraps the core generators of lease operations to record metrics and spans.

    One small generator per operation (:meth:`_watch`, delegating with ``yield from``): the
    wrapper is on the path of every operation while enabled, so it builds no closures and
    looks up its labels once. Store round trips are timed by the runners (see
    :func:`round_trips`).
    """

    __slots__ = ("metrics", "tracing")

    def __init__(self, metrics: Metrics | None, tracing: Tracing | None) -> None:
        self.metrics = metrics
        self.tracing = tracing

    def acquire(self, lease: LeaseCore, steps: Steps[bool], wait: Any) -> Steps[bool]:
        """``wait``: the wait this acquire was given (seconds, a duration, or None)."""
        return self._watch("acquire", lease, lease.kind, steps, wait)

    def release(self, lease: LeaseCore, steps: Steps[bool]) -> Steps[bool]:
        return self._watch("release", lease, lease.kind, steps, lease.token)

    def extend(self, lease: LeaseCore, steps: Steps[None]) -> Steps[None]:
        return self._watch("extend", lease, lease.kind, steps, None)

    def lost(self, lease: LeaseCore) -> None:
        """The lease is known lost (called once per lease, by ``LeaseCore._lose``)."""
        if self.metrics is not None:
            self.metrics.bound(lease._backend.url.scheme, lease.kind).lost()

    def claim(self, claim: ClaimCore, steps: Steps[None]) -> Steps[None]:
        return self._watch("claim", claim, "claim", steps, None)

    def claim_release(self, claim: ClaimCore, names: list[str], steps: Steps[Any]) -> Steps[Any]:
        """Release ``names`` of a claim: ``steps`` answers True/False for one name (release),
        the number of live leases for several (release_many)."""
        return self._watch("release", claim, "claim", steps, names)

    def _watch(
        self, operation: str, subject: Any, kind: str, steps: Steps[Any], extra: Any
    ) -> Steps[Any]:
        """Drive ``steps``; when it ends, say how (:func:`_outcome_of` its value, or of its
        error) to the metrics (:func:`_record`) and on the span. ``extra``: an acquire's
        wait, a release's token, the names a claim releases."""
        metrics, tracing = self.metrics, self.tracing
        store = subject.store.backend.url.scheme
        span = None
        if tracing is not None:
            span = tracing.start(operation, _attributes(operation, subject, kind, store, extra))
        # Only an acquire's (or a claim's) time is observed: the wait.
        started = _perf() if metrics is not None and operation in _WAITS else 0.0
        outcome, value, error = "error", None, None
        try:
            value = yield from steps
            outcome = _outcome_of(operation, subject, kind, value, extra)
            return value
        except BaseException as exc:
            outcome, error = _failure(exc), exc
            raise
        finally:
            if metrics is not None:
                bound = metrics.bound(store, kind)
                _record(bound, operation, subject, kind, outcome, value, extra, started)
            if span is not None and tracing is not None:
                tracing.end(span, outcome, getattr(subject, "token", None), error)


_WAITS = frozenset({"acquire", "claim"})


def _failure(error: BaseException) -> str:
    if isinstance(error, StoreUnavailable):
        return "unavailable"
    if isinstance(error, LockLost):
        return "lost"
    return "error" if isinstance(error, Exception) else "cancelled"


def _outcome_of(operation: str, subject: Any, kind: str, value: Any, extra: Any) -> str:
    if operation == "acquire":
        if value:
            return "granted"
        return "busy" if parse_wait(extra) == 0 else "timeout"
    if operation == "release":
        return "released" if value or kind == "claim" else "expired"
    if operation == "extend":
        return "extended"
    return "granted" if subject.acquired else "busy"  # a claim


def _attributes(operation: str, subject: Any, kind: str, store: str, extra: Any) -> Any:
    attributes: dict[str, Any] = {"latchkey.kind": kind, "latchkey.store": store}
    if kind != "claim":
        attributes["latchkey.name"] = subject.name
        if subject.limit > 1:
            attributes["latchkey.limit"] = subject.limit
        if operation == "release" and extra is not None:
            attributes["latchkey.token"] = extra
    elif operation == "claim":
        attributes["latchkey.names"] = len(subject._names)
    else:
        attributes["latchkey.names"] = len(extra)
        if len(extra) == 1:
            attributes["latchkey.name"] = extra[0]
    return attributes


def _record(
    bound: Bound,
    operation: str,
    subject: Any,
    kind: str,
    outcome: str,
    value: Any,
    extra: Any,
    started: float,
) -> None:
    if operation == "acquire":
        now = _perf()
        bound.acquired(outcome, now - started)
        if outcome == "granted":
            subject._observed = (bound, now)
    elif operation == "extend":
        bound.extended(outcome)
    elif kind != "claim":
        bound.release(outcome)
    elif operation == "release":  # of names of a claim: how many were still live
        if outcome != "released":
            bound.release(outcome, len(extra))
            return
        live = int(value)
        if live:
            bound.release("released", live)
        if len(extra) > live:
            bound.release("expired", len(extra) - live)
    elif outcome not in ("granted", "busy"):  # a claim that failed: failed for every name
        bound.acquired(outcome, _perf() - started, len(subject._names))
    else:
        now = _perf()
        if subject.acquired:
            bound.acquired("granted", now - started, len(subject.acquired))
            subject._observed = (bound, now)
        if subject.busy:
            bound.acquired("busy", now - started, len(subject.busy))


def ended(held: tuple[Bound, float], count: int = 1) -> None:
    """``count`` leases (of a lease or a claim) are no longer held: the gauge goes down and
    the hold time is observed, in the metrics that counted them up."""
    bound, since = held
    bound.ended(_perf() - since, count)
