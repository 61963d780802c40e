"""OpenTelemetry across the real process boundary: an application process enqueues in
a span (the SDK's in-memory exporter records its spans), a real member's worker process
continues each job's trace in a `pgjobd.run <kind>` span (recorded by the SDK's
in-memory exporter there, and written out for the test). Also: the SQL function's
trace_context argument, and a process without OpenTelemetry importing none of it."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import pytest

from .conftest import MemberProcess, wait_all_final

pytestmark = pytest.mark.anyio
StartMember = Callable[..., Awaitable[MemberProcess]]

SPAN_JSON = """
def span_json(span):
    parent = span.parent
    return {
        "name": span.name,
        "trace_id": format(span.context.trace_id, "032x"),
        "span_id": format(span.context.span_id, "016x"),
        "parent": format(parent.span_id, "016x") if parent is not None else None,
        "attributes": dict(span.attributes or {}),
        "status": span.status.status_code.name,
        "kind": span.kind.name,
    }
"""

# The worker's side: a handler module sets the SDK up, as an application's would.
HANDLER = (
    """
import json
import os

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pgjobd import job
"""
    + SPAN_JSON
    + """

class WrittenOut(InMemorySpanExporter):
    '''The SDK's in-memory exporter; each span is also written to $SPANS_FILE.'''

    def export(self, spans):
        result = super().export(spans)
        with open(os.environ["SPANS_FILE"], "a") as f:
            for span in spans:
                f.write(json.dumps(span_json(span)) + "\\n")
        return result


provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(WrittenOut()))
trace.set_tracer_provider(provider)


@job(max_attempts=1)
async def traced(args: dict) -> int:
    with trace.get_tracer("handler").start_as_current_span("handler work"):
        if args["n"] == 3:
            raise ValueError("three")
    return args["n"]
"""
)

APPLICATION = (
    """
import asyncio
import json
import sys

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pgjobd import Client
"""
    + SPAN_JSON
    + """

exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)


async def main(dsn, schema):
    async with await Client.connect(dsn, schema=schema) as client:
        with trace.get_tracer("app").start_as_current_span("web request"):
            one = await client.enqueue("traced", {"n": 1})
            many = await client.enqueue_many([("traced", {"n": 2}), ("traced", {"n": 3})])
            keyed = await client.enqueue_many([("traced", {"n": 6})], unique_key="k6")
        plain = await client.enqueue("traced", {"n": 4})
    spans = [span_json(s) for s in exporter.get_finished_spans()]
    print(json.dumps({"ids": [one, *many, *keyed, plain], "spans": spans}))


asyncio.run(main(sys.argv[1], sys.argv[2]))
"""
)


def by_name(spans: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [s for s in spans if s["name"] == name]


async def test_a_trace_continues_from_the_enqueue_into_the_worker(
    schema: str, dsn: str, conn: asyncpg.Connection, start_member: StartMember,
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    handlers = tmp_path / "handlers"
    handlers.mkdir()
    (handlers / "traced.py").write_text(HANDLER)
    spans_file = tmp_path / "worker-spans.jsonl"
    monkeypatch.setenv("SPANS_FILE", str(spans_file))
    app = tmp_path / "app.py"
    app.write_text(APPLICATION)
    await start_member(handlers=handlers)  # declares the kind: max_attempts=1

    done = await anyio.run_process([sys.executable, str(app), dsn, schema], check=False)
    assert done.returncode == 0, done.stderr.decode()
    report = json.loads(done.stdout)
    one, two, three, six, plain = report["ids"]
    app_spans = report["spans"]
    [request] = by_name(app_spans, "web request")
    enqueues = by_name(app_spans, "pgjobd.enqueue")
    assert len(enqueues) == 4 and {s["kind"] for s in enqueues} == {"PRODUCER"}
    single, batch, keyed, root = enqueues  # in the order they ended
    assert single["parent"] == batch["parent"] == keyed["parent"] == request["span_id"]
    assert batch["attributes"] == {"pgjobd.job.kind": "traced", "pgjobd.job.count": 2}
    assert root["parent"] is None and root["trace_id"] != request["trace_id"]

    sql_trace = "0af7651916cd43dd8448eb211c80319c"
    sql_parent = "b7ad6b7169203331"
    from_sql = await conn.fetchval(
        f"SELECT {schema}.enqueue('traced', '{{\"n\": 5}}', trace_context => $1::jsonb)",
        json.dumps({"traceparent": f"00-{sql_trace}-{sql_parent}-01"}),
    )
    untraced = await conn.fetchval(f"SELECT {schema}.enqueue('traced', '{{\"n\": 7}}')")

    await wait_all_final(conn, schema, 7)
    worker_spans = [json.loads(line) for line in spans_file.read_text().splitlines()]
    run_spans = by_name(worker_spans, "pgjobd.run traced")
    runs = {s["attributes"]["pgjobd.job.id"]: s for s in run_spans}
    assert len(run_spans) == len(runs) == 7  # one attempt each
    assert set(runs) == {one, two, three, six, plain, from_sql, untraced}

    expected_parents = {
        one: single, two: batch, three: batch, six: keyed, plain: root,
    }  # fmt: skip
    for job_id, enqueue in expected_parents.items():
        run = runs[job_id]
        assert (run["trace_id"], run["parent"]) == (enqueue["trace_id"], enqueue["span_id"])
        assert run["kind"] == "CONSUMER"
    assert (runs[from_sql]["trace_id"], runs[from_sql]["parent"]) == (sql_trace, sql_parent)
    assert runs[untraced]["parent"] is None  # no context stored: a trace of its own

    assert runs[one]["attributes"] == {
        "pgjobd.job.id": one, "pgjobd.job.kind": "traced", "pgjobd.job.queue": "default",
        "pgjobd.job.attempt": 1, "pgjobd.job.outcome": "completed",
    }  # fmt: skip
    assert runs[one]["status"] == "UNSET"
    assert runs[three]["attributes"]["pgjobd.job.outcome"] == "failed"
    assert runs[three]["status"] == "ERROR"
    # The handler's own spans are children of its run span.
    work = {s["parent"]: s for s in by_name(worker_spans, "handler work")}
    assert set(work) == {run["span_id"] for run in runs.values()}
    assert all(work[run["span_id"]]["trace_id"] == run["trace_id"] for run in runs.values())


async def test_the_sql_functions_refuse_a_trace_context_that_is_not_an_object(
    schema: str, conn: asyncpg.Connection
) -> None:
    with pytest.raises(asyncpg.PostgresError, match="trace_context must be a JSON object") as e:
        await conn.fetchval(f"SELECT {schema}.enqueue('k', '{{}}', trace_context => '[1]')")
    assert e.value.sqlstate == "PJ004"
    big = json.dumps({"traceparent": "x" * 5000})
    with pytest.raises(asyncpg.PostgresError, match="job 2 of 2: trace_context") as e:
        await conn.fetch(
            f"SELECT * FROM {schema}.enqueue_many(ARRAY['k', 'k'], ARRAY['{{}}', '{{}}']::jsonb[],"
            " trace_contexts => ARRAY[NULL, $1]::jsonb[])", big,
        )  # fmt: skip
    assert await conn.fetchval(f"SELECT count(*) FROM {schema}.job") == 0


WITHOUT_OTEL = """
import asyncio
import sys


class NotInstalled:
    '''As if the otel extra were not installed.'''

    def find_spec(self, name, path=None, target=None):
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None


sys.meta_path.insert(0, NotInstalled())

from pgjobd import Client, job
from pgjobd.handler_loader import Registry
from pgjobd.testing import drain


@job
async def hello(args: dict) -> str:
    return "hi"


async def main(dsn, schema):
    async with await Client.connect(dsn, schema=schema) as client:
        await client.enqueue(hello, {})
        await client.enqueue_many([("hello", {}), ("hello", {})])
        outcomes = await drain(client, Registry.from_functions([hello]))
    assert [o.state for o in outcomes] == ["completed"] * 3, outcomes
    loaded = sorted(m for m in sys.modules if m.startswith("opentelemetry"))
    assert loaded == [], loaded
    print("ok")


asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


async def test_without_opentelemetry_nothing_imports_it(
    schema: str, dsn: str, tmp_path: Path
) -> None:
    script = tmp_path / "without_otel.py"
    script.write_text(WITHOUT_OTEL)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = await anyio.run_process([sys.executable, str(script), dsn, schema], check=False, env=env)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode().strip() == "ok"
