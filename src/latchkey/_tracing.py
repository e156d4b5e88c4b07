"""OpenTelemetry spans of lease operations (the ``otel`` extra): one span per acquire, release,
extend and claim. Imported only by :func:`latchkey.enable_tracing`, so that nobody who leaves
tracing off imports ``opentelemetry``.

A span is current while its operation runs, so the spans of an instrumented store driver
(psycopg, redis-py…) nest under it. Attributes: ``latchkey.name`` (a span may name the lock:
one span per operation, not one time series per name), ``latchkey.kind``, ``latchkey.store``
(the URL scheme), ``latchkey.token`` (the fencing token, when there is one) and
``latchkey.outcome`` (the same words as the metrics' ``outcome`` label).
"""

from __future__ import annotations

from typing import Any

from opentelemetry import context, trace
from opentelemetry.trace import Span, Status, StatusCode, TracerProvider

#: Outcomes that are failures of the operation (the span's status is ERROR). Busy, timeout,
#: expired and lost are answers, not failures of the call.
FAILED = frozenset({"unavailable", "error"})


#: Span names by operation, made once.
NAMES = {op: f"latchkey.{op}" for op in ("acquire", "release", "extend", "claim")}


class Tracing:
    """Starts and ends latchkey's spans on one tracer."""

    def __init__(self, tracer_provider: TracerProvider | None, version: str) -> None:
        self.tracer = trace.get_tracer("latchkey", version, tracer_provider=tracer_provider)

    def start(self, operation: str, attributes: dict[str, Any]) -> tuple[Span, object]:
        """Start the span ``latchkey.<operation>`` with its attributes known at the start
        (given to ``start_span``: a sampler sees them, and they are set in one call) and make
        it current; return it and the token that :meth:`end` needs to restore the context."""
        span = self.tracer.start_span(NAMES[operation], attributes=attributes)
        return span, context.attach(trace.set_span_in_context(span))

    def end(
        self,
        started: tuple[Span, object],
        outcome: str,
        token: int | None,
        error: BaseException | None,
    ) -> None:
        """End the span, with the outcome and the fencing token (when there is one) set in
        one call: the SDK takes a lock and checks the attributes on each call."""
        span, context_token = started
        context.detach(context_token)  # type: ignore[arg-type]
        if span.is_recording():
            if token is None:
                span.set_attribute("latchkey.outcome", outcome)
            else:
                span.set_attributes({"latchkey.outcome": outcome, "latchkey.token": token})
            if error is not None and outcome in FAILED:
                span.record_exception(error)
                span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}"))
        span.end()
