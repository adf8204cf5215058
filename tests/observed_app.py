"""Tasks of the observability tests (``observed_app:app``), with a known mix of outcomes.

When OBSERVED_SPANS names a file, the process traces with the OpenTelemetry SDK: every span
it ends is written to that file as one JSON object per line (name, kind, trace and span ids,
parent, links, attributes, events), so a test can read the spans of a worker process.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Sequence

from skipjack import App, Backoff, current_job

app = App(schema=os.environ.get("SKIPJACK_SCHEMA", "skipjack"))

if os.environ.get("OBSERVED_SPANS"):
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

    from skipjack.tracing import TracingHook

    class FileExporter(SpanExporter):
        """Appends each span to OBSERVED_SPANS as it ends."""

        def __init__(self, path: str) -> None:
            self._path = path
            self._lock = threading.Lock()

        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            with self._lock, open(self._path, "a") as out:
                for span in spans:
                    ctx, parent = span.get_span_context(), span.parent
                    out.write(json.dumps({
                        "name": span.name, "kind": span.kind.name,
                        "trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}",
                        "parent_id": f"{parent.span_id:016x}" if parent else None,
                        "links": [f"{link.context.span_id:016x}" for link in span.links],
                        "attributes": dict(span.attributes or {}),
                        "events": [e.name for e in span.events],
                        "status": span.status.status_code.name}) + "\n")
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(FileExporter(os.environ["OBSERVED_SPANS"])))
    app.add_hook(TracingHook(provider))


@app.task(name="ok")
def ok(n: int = 0) -> int:
    return n


@app.task(name="flaky", backoff=Backoff(base=0.01, cap=0.02))
def flaky() -> None:
    """Fails its first attempt, succeeds the second."""
    if current_job().job.attempt == 1:
        raise ValueError("first attempt fails")


@app.task(name="doomed", max_attempts=1)
def doomed() -> None:
    raise RuntimeError("always fails")


@app.task(name="block_loop")
async def block_loop(seconds: float) -> None:
    """Blocks the worker's event loop (what a health check must notice)."""
    time.sleep(seconds)
