"""What more than one bench needs beyond bench/throughput.py's member and drain.

- explain_job_path: EXPLAIN (ANALYZE, BUFFERS) of the job path's statements on the
  tables as they are, each rolled back;
- hot_table_stats: size, live and dead rows of a schema's hot table;
- server: the DSN to run on: --dsn's, or a private throwaway cluster (--private);
- autovacuum_note: what the server's autovacuum does, said plainly (off, it changes
  what a horizon or a soak measures: nothing is vacuumed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import asyncpg
from throughput import Harness

from pgjobd.client import Client
from pgjobd.embedded import Cluster
from pgjobd.queries import for_schema
from pgjobd.statements.job import CompleteRow

T = TypeVar("T")

EXPLAIN_BATCH = 50


@dataclass(frozen=True)
class Explained:
    statement: str
    text: str  # the plan as EXPLAIN prints it
    buffers: int  # shared blocks hit + read by the whole statement
    rows: int  # rows the top node returned


async def explain_job_path(admin: asyncpg.Connection, client: Client, schema: str, *,
                           queue: str = "default") -> list[Explained]:  # fmt: skip
    """Enqueue EXPLAIN_BATCH * 2 jobs, claim EXPLAIN_BATCH of them, and EXPLAIN (ANALYZE,
    BUFFERS) the claim of the next batch, the completion of the claimed batch, the reaper
    and the promotion, each in a transaction rolled back; then complete the batch. The
    rest of the jobs are left for the caller's next drain."""
    q = for_schema(schema)
    harness = Harness("", admin, admin, schema)
    await harness.reset_and_enqueue(client, 2 * EXPLAIN_BATCH, fresh=False)
    lease = timedelta(seconds=30)
    claimed = await q.job_claim(admin, queue, EXPLAIN_BATCH, "bench-explain", lease)
    ids, fences = [r.id for r in claimed], [r.fence for r in claimed]
    term = await q.leader_term_begin(admin, "bench-explain")
    statements: list[tuple[str, tuple[Any, ...]]] = [
        # No claim cursor ($5-$7 NULL): from the queue's head, as a member's first claim.
        ("job_claim", (queue, EXPLAIN_BATCH, "bench-explain", lease, None, None, None)),
        ("job_complete_many", (ids, fences, [None] * len(ids), [True] * len(ids))),
        ("job_reap_expired", (term, timedelta(0), EXPLAIN_BATCH, [queue], [3], 3, "f")),
        ("job_promote_due", (EXPLAIN_BATCH,)),
    ]
    found = []
    for name, args in statements:
        sql = q.sql(name)
        as_json = await _rolled_back(admin, f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {sql}", args)
        plan = json.loads(as_json[0][0])[0]
        rows = await _rolled_back(admin, f"EXPLAIN (ANALYZE, BUFFERS) {sql}", args)
        top = plan["Plan"]
        found.append(Explained(name, "\n".join(r[0] for r in rows),
                               top["Shared Hit Blocks"] + top["Shared Read Blocks"],
                               top["Actual Rows"]))  # fmt: skip
    done = [CompleteRow(i, f, None, True) for i, f in zip(ids, fences, strict=True)]
    await q.job_complete_many(admin, done)
    await admin.execute(f"UPDATE {schema}.leader SET resigned_at = now() WHERE term = $1", term)
    return found


async def _rolled_back(admin: asyncpg.Connection, sql: str, args: tuple[Any, ...]) -> Any:
    """The rows of sql (an EXPLAIN ANALYZE: it runs the statement), in a transaction
    rolled back."""
    transaction = admin.transaction()
    await transaction.start()
    try:
        return await admin.fetch(sql, *args)
    finally:
        await transaction.rollback()


async def hot_table_stats(admin: asyncpg.Connection, schema: str) -> tuple[int, int, int]:
    """(pg_total_relation_size, n_live_tup, n_dead_tup) of schema.job; the counts are
    the statistics collector's, as fresh as its last report."""
    await admin.execute("SELECT pg_stat_clear_snapshot()")
    row = await admin.fetchrow(
        "SELECT pg_total_relation_size(relid), n_live_tup, n_dead_tup FROM pg_stat_user_tables"
        " WHERE schemaname = $1 AND relname = 'job'",
        schema,
    )
    return int(row[0]), int(row[1]), int(row[2])


def add_server_options(parser: argparse.ArgumentParser, default_dsn: str) -> None:
    parser.add_argument("--dsn", default=os.environ.get("PGJOBD_DSN", default_dsn))
    parser.add_argument("--private", action="store_true",
                        help="run on a private throwaway cluster (PGJOBD_PG_BIN picks its "
                        "binaries; autovacuum on, nobody else's snapshots), not --dsn")  # fmt: skip


@contextlib.contextmanager
def server(args: argparse.Namespace) -> Iterator[str]:
    """The DSN to run on: --dsn, or a private throwaway cluster for --private."""
    if not args.private:
        yield args.dsn
        return
    cluster = Cluster.throwaway()
    cluster.init()
    cluster.start()
    try:
        yield cluster.dsn("postgres")
    finally:
        cluster.stop()


def run_on_server(
    args: argparse.Namespace, main: Callable[[argparse.Namespace], Awaitable[T]]
) -> T:
    """main(args) on uvloop, with args.dsn set to the server `server` gives."""
    import uvloop  # noqa: PLC0415 (only a bench's entry point needs it)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner, server(args) as args.dsn:
        return runner.run(main(args))


async def autovacuum_note(admin: asyncpg.Connection) -> str:
    row = await admin.fetchrow(
        "SELECT current_setting('server_version') AS version, current_setting('autovacuum') AS on,"
        " current_setting('autovacuum_naptime') AS naptime"
    )
    note = f"PostgreSQL {row['version']}, autovacuum {row['on']}, naptime {row['naptime']}"
    if row["on"] != "on":
        note += " (OFF: nothing vacuums the hot table; dead rows only grow)"
    return note
