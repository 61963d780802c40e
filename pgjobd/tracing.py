"""OpenTelemetry traces, when the application uses OpenTelemetry (the `otel` extra).

pgjobd never imports OpenTelemetry itself: it traces in a process only once something
else there has imported `opentelemetry.trace` (the application setting up its tracer
provider; in a worker process, a handler module or a middleware doing so). Without
that there is no provider to record spans and no current trace to carry, so nothing is
lost, and processes that do not trace pay nothing, not even the import.

- Enqueue (pgjobd.client): a `pgjobd.enqueue` span (kind PRODUCER) around the write;
  its W3C trace context (traceparent, tracestate) is stored with the job.
- Run (pgjobd.execution, in the worker): a `pgjobd.run <kind>` span (kind CONSUMER)
  that continues the stored context, with the job's id, kind, queue, attempt and the
  attempt's outcome as attributes; the handler runs inside it, so its own spans are
  children of it.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from typing import Any

TRACER_NAME = "pgjobd"
# Attributes of the spans (the job's fields, and what became of the attempt).
JOB_ID = "pgjobd.job.id"
JOB_KIND = "pgjobd.job.kind"
JOB_QUEUE = "pgjobd.job.queue"
JOB_ATTEMPT = "pgjobd.job.attempt"
JOB_OUTCOME = "pgjobd.job.outcome"
JOB_COUNT = "pgjobd.job.count"
# Outcomes that are not an error of the attempt.
_FINE = frozenset({"completed", "snoozed", "given_back"})


def in_use() -> bool:
    """Whether OpenTelemetry's API has been imported in this process."""
    return "opentelemetry.trace" in sys.modules


@contextmanager
def enqueue_span(kind: str, queue: str | None, count: int = 1) -> Iterator[dict[str, str] | None]:
    """Around an enqueue: yields the trace context to store with the job(s), or None
    (OpenTelemetry not in use, or no valid span to continue)."""
    if not in_use():
        yield None
        return
    from opentelemetry import propagate, trace  # noqa: PLC0415

    tracer = trace.get_tracer(TRACER_NAME)
    attributes: dict[str, Any] = {JOB_KIND: kind, JOB_COUNT: count}
    if queue is not None:
        attributes[JOB_QUEUE] = queue
    with tracer.start_as_current_span(
        "pgjobd.enqueue", kind=trace.SpanKind.PRODUCER, attributes=attributes
    ):
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        yield carrier or None


@asynccontextmanager
async def run_span(
    kind: str,
    job_id: int,
    queue: str,
    attempt: int,
    trace_context: Mapping[str, str] | None,
) -> AsyncIterator[Any]:
    """Around one attempt: yields a setter for its outcome (call it with the outcome's
    kind), or a no-op when OpenTelemetry is not in use."""
    if not in_use():
        yield _ignore
        return
    from opentelemetry import propagate, trace  # noqa: PLC0415

    parent = propagate.extract(dict(trace_context)) if trace_context else None
    tracer = trace.get_tracer(TRACER_NAME)
    attributes: dict[str, Any] = {
        JOB_ID: job_id, JOB_KIND: kind, JOB_QUEUE: queue, JOB_ATTEMPT: attempt,
    }  # fmt: skip
    with tracer.start_as_current_span(
        f"pgjobd.run {kind}", context=parent, kind=trace.SpanKind.CONSUMER,
        attributes=attributes, record_exception=False, set_status_on_exception=False,
    ) as span:  # fmt: skip

        def outcome(value: str, error: str | None = None) -> None:
            span.set_attribute(JOB_OUTCOME, value)
            if value not in _FINE:
                span.set_status(trace.Status(trace.StatusCode.ERROR, error))

        yield outcome


def _ignore(value: str, error: str | None = None) -> None:
    pass
