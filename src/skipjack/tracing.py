"""OpenTelemetry tracing (the optional extra ``skipjack[otel]``, which installs
``opentelemetry-api``; without it skipjack imports no OpenTelemetry code and pays nothing).

Add the hook to the app, in the processes that enqueue and in the workers::

    from skipjack.tracing import TracingHook
    app.add_hook(TracingHook())

Then every ``enqueue``/``enqueue_many`` call is a ``send`` span (kind PRODUCER), current while
the jobs are written, whose W3C trace context (``traceparent``, ``tracestate``, through the
globally configured propagator) is stored with each job as metadata. Each attempt on a worker
is a ``process`` span (kind CONSUMER), a child of that context, so an enqueue and the runs
it caused form one trace across processes, and linked to it as well. The run span is current
while the handler runs (spans the handler makes are its children); an exception the handler
raised is recorded on it and sets its status to ERROR (a ``skipjack.Snooze`` does not).

Attributes follow OpenTelemetry's semantic conventions for messaging where they fit:
``messaging.system`` ("skipjack"), ``messaging.operation.type`` ("send", "process"),
``messaging.operation.name`` ("enqueue", "run"), ``messaging.destination.name`` (the queue),
``messaging.message.id`` (the job id), ``messaging.batch.message_count`` (jobs of a bulk
enqueue); and ``skipjack.task``, ``skipjack.attempt``, ``skipjack.max_attempts``.
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Any

try:
    from opentelemetry import context as otel_context
    from opentelemetry import propagate, trace
    from opentelemetry.trace import Link, SpanKind, Status, StatusCode
except ModuleNotFoundError as missing:  # pragma: no cover - depends on the installation
    missing.msg += ": skipjack.tracing needs opentelemetry-api (pip install 'skipjack[otel]')"
    raise

from .context import Job, current_job
from .errors import Snooze
from .hooks import EnqueueCall, Hook

SYSTEM = "skipjack"


class TracingHook(Hook):
    """Spans for enqueues and attempts (see ``skipjack.tracing``).

    Args:
        tracer_provider: the OpenTelemetry ``TracerProvider`` to use (default: the global
            one, which the application or ``opentelemetry-instrument`` configures).
    """

    def __init__(self, tracer_provider: trace.TracerProvider | None = None) -> None:
        self._tracer = trace.get_tracer("skipjack", tracer_provider=tracer_provider)

    def enqueue(self, call: EnqueueCall) -> _EnqueueSpan:
        return _EnqueueSpan(self._tracer, call)

    def run(self, job: Job) -> _RunSpan:
        return _RunSpan(self._tracer, job)


class _EnqueueSpan:
    """The ``send`` span of one enqueue call; its context goes into the call's metadata."""

    def __init__(self, tracer: trace.Tracer, call: EnqueueCall) -> None:
        self._tracer = tracer
        self._call = call
        self._span: trace.Span | None = None
        self._token: Any = None

    def __enter__(self) -> None:
        span = self._tracer.start_span("send", kind=SpanKind.PRODUCER, attributes={
            "messaging.system": SYSTEM, "messaging.operation.type": "send",
            "messaging.operation.name": "enqueue"})
        ctx = trace.set_span_in_context(span)
        propagate.inject(self._call.metadata, context=ctx)
        self._span, self._token = span, otel_context.attach(ctx)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        span, call = self._span, self._call
        if span is None:
            return
        otel_context.detach(self._token)
        queues = {spec.queue for spec in call.jobs}
        if len(queues) == 1:
            queue = queues.pop()
            span.update_name(f"send {queue}")
            span.set_attribute("messaging.destination.name", queue)
        tasks = {spec.task for spec in call.jobs}
        if len(tasks) == 1:
            span.set_attribute("skipjack.task", tasks.pop())
        if len(call.jobs) != 1:
            span.set_attribute("messaging.batch.message_count", len(call.jobs))
        elif call.ids:
            span.set_attribute("messaging.message.id", str(call.ids[0]))
        if exc is not None:
            _failed(span, exc)
        span.end()


def _failed(span: trace.Span, exc: BaseException) -> None:
    """Record ``exc`` on ``span`` and set its status to ERROR."""
    span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))


class _RunSpan:
    """The ``process`` span of one attempt, a child of (and linked to) its enqueue's."""

    def __init__(self, tracer: trace.Tracer, job: Job) -> None:
        self._tracer = tracer
        self._job = job
        self._span: trace.Span | None = None
        self._token: Any = None

    def __enter__(self) -> None:
        job = self._job
        carrier = {k: v for k, v in (job.metadata or {}).items() if isinstance(v, str)}
        parent = propagate.extract(carrier)
        sent = trace.get_current_span(parent).get_span_context()
        span = self._tracer.start_span(
            f"process {job.queue}", context=parent, kind=SpanKind.CONSUMER,
            links=[Link(sent)] if sent.is_valid else None,
            attributes={"messaging.system": SYSTEM, "messaging.operation.type": "process",
                        "messaging.operation.name": "run",
                        "messaging.destination.name": job.queue,
                        "messaging.message.id": str(job.id), "skipjack.task": job.task,
                        "skipjack.attempt": job.attempt,
                        "skipjack.max_attempts": job.max_attempts})
        self._span = span
        self._token = otel_context.attach(trace.set_span_in_context(span, parent))

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        span = self._span
        if span is None:
            return
        otel_context.detach(self._token)
        if isinstance(exc, asyncio.CancelledError):  # the worker took the job from it
            cause = _cancel_cause()
            span.set_attribute("skipjack.cancelled", cause)
            if cause == "timed out":
                _failed(span, TimeoutError(_job_timeout()))
        elif exc is not None and not isinstance(exc, Snooze):
            _failed(span, exc)
        span.end()


def _cancel_cause() -> str:
    """Why the worker took the running job from its handler (see skipjack.context)."""
    try:
        return current_job().cause or "shutdown"
    except LookupError:
        return "shutdown"


def _job_timeout() -> str:
    """The reason the worker gave, e.g. "timed out after 0.5s"."""
    try:
        return current_job().reason or "timed out"
    except LookupError:
        return "timed out"
