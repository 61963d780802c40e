"""The client's two earlier COPY paths, kept for bench/enqueue.py's A/B against today's.

- `OldCopyClient`: the path before issue 11 (the parent of commit 4b6ec1e): one round
  trip for the transaction's now(), the ids and the kinds' declared defaults; the
  defaults resolved in Python (a second home for them); COPY straight into the job
  table; one NOTIFY statement. Brought up to today's columns (group_key, expires_at,
  trace_context) and to max_depth: its first round trip also asks queue_admit_needed,
  and when that says so, one more round trip admits the batch (never in the bench,
  whose queues have no limits).
- `StagedCopyClient`: the path issue 11 put in its place (commit 4b6ec1e, main until
  issue 17): COPY into a per-session temporary table, then one INSERT … SELECT through
  job_defaults into the job table.

Both override only `Client._copy_in_transaction`, so the checks, the encoding and the
transaction around it are today's. Not used by pgjobd itself.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import asyncpg

from pgjobd.client import RUN_AT_BEFORE, Client, _Checked
from pgjobd.config import DEFAULT_QUEUE
from pgjobd.errors import EnqueueError

COLUMNS = ("id", "state", "queue", "kind", "priority", "run_at", "args", "max_attempts",
           "tenant", "group_key", "expires_at", "trace_context")  # fmt: skip
DEFAULT_MAX_ATTEMPTS = 20

OLD_PREPARE = """
SELECT now() AS now,
       ARRAY(SELECT nextval('{schema}.job_id_seq') FROM generate_series(1, $1)) AS ids,
       ARRAY(SELECT k.name FROM {schema}.kind AS k WHERE k.name = ANY($2)) AS kinds,
       ARRAY(SELECT k.queue FROM {schema}.kind AS k WHERE k.name = ANY($2)) AS queues,
       ARRAY(SELECT k.priority FROM {schema}.kind AS k WHERE k.name = ANY($2)) AS priorities,
       ARRAY(SELECT k.max_attempts FROM {schema}.kind AS k WHERE k.name = ANY($2))
           AS max_attempts,
       {schema}.queue_admit_needed(false) AS admit_needed"""
OLD_ADMIT = "SELECT {schema}.queue_admit($1, $2, $3)"
OLD_NOTIFY = "SELECT pg_notify('{schema}.job_ready', q) FROM unnest($1::text[]) AS q"

STAGE_CREATE = """
CREATE TEMP TABLE IF NOT EXISTS pgjobd_enqueue_stage (
    ord integer NOT NULL, kind text, args text, queue text, priority integer,
    run_at timestamptz, delay interval, tenant text, max_attempts integer, group_key text,
    expires_at timestamptz, ttl interval, trace_context text
) ON COMMIT DELETE ROWS"""
STAGE_COLUMNS = ("ord", "kind", "args", "queue", "priority", "run_at", "delay", "tenant",
                 "max_attempts", "group_key", "expires_at", "ttl", "trace_context")  # fmt: skip
STAGED_INSERT = """
WITH staged AS (
    DELETE FROM pg_temp.pgjobd_enqueue_stage RETURNING *
), resolved AS (
    SELECT o.*, nextval('{schema}.job_id_seq') AS id
    FROM (
        SELECT s.ord, s.kind, s.args, s.tenant, s.group_key,
               coalesce(s.expires_at, now() + s.ttl) AS expires_at, s.trace_context, d.*
        FROM staged AS s
        LEFT JOIN {schema}.kind AS k ON k.name = s.kind
        CROSS JOIN LATERAL {schema}.job_defaults(
            k.queue, k.priority, k.max_attempts, s.queue, s.priority, s.run_at, s.delay,
            s.max_attempts) AS d
        ORDER BY s.ord
    ) AS o
), admitted AS (
    SELECT {schema}.queue_admit(a.queues, a.counts, a.grouped)
    FROM (SELECT array_agg(g.queue) AS queues, array_agg(g.n) AS counts,
                 array_agg(g.grouped) AS grouped, bool_or(g.grouped) AS any_grouped
          FROM (SELECT r.queue, count(*)::integer AS n,
                       bool_or(r.group_key IS NOT NULL) AS grouped
                FROM resolved AS r GROUP BY r.queue) AS g) AS a
    WHERE {schema}.queue_admit_needed(a.any_grouped)
), inserted AS (
    INSERT INTO {schema}.job (id, state, queue, kind, priority, run_at, args, max_attempts,
                              tenant, group_key, expires_at, trace_context)
    SELECT r.id, r.state, r.queue, r.kind, r.priority, r.run_at, r.args::jsonb,
           r.max_attempts, r.tenant, r.group_key, r.expires_at, r.trace_context::jsonb
    FROM resolved AS r
    WHERE (SELECT count(*) FROM admitted) >= 0
), woken AS (
    SELECT pg_notify('{schema}.job_ready', q.queue)
    FROM (SELECT DISTINCT r.queue FROM resolved AS r WHERE r.state = 'available') AS q
)
SELECT r.id FROM resolved AS r
WHERE (SELECT count(*) FROM woken) >= 0
ORDER BY r.ord"""


class OldCopyClient(Client):
    async def _copy_in_transaction(
        self, conn: asyncpg.Connection, jobs: Sequence[_Checked], trace_json: str | None
    ) -> list[int]:
        kinds = sorted({j.kind for j in jobs})
        prep = await conn.fetchrow(OLD_PREPARE.format(schema=self.schema), len(jobs), kinds)
        now: datetime = prep["now"]
        declared = {
            kind: (queue, priority, attempts)
            for kind, queue, priority, attempts in zip(
                prep["kinds"], prep["queues"], prep["priorities"], prep["max_attempts"],
                strict=True,
            )
        }  # fmt: skip
        ids: list[int] = prep["ids"]
        records: list[tuple[Any, ...]] = []
        ready_queues = set()
        for job_id, (kind, args_json, job) in zip(ids, jobs, strict=True):
            kind_queue, kind_priority, kind_attempts = declared.get(kind, (None, None, None))
            queue = job.queue or kind_queue or DEFAULT_QUEUE
            run_at = job.run_at or (now + job.delay if job.delay else now)
            if run_at >= RUN_AT_BEFORE:
                raise EnqueueError(f"job {len(records) + 1}: the delay is too long")
            if run_at <= now:
                state = "available"
                ready_queues.add(queue)
            else:
                state = "scheduled"
            priority = job.priority if job.priority is not None else (kind_priority or 0)
            attempts = job.max_attempts or kind_attempts or DEFAULT_MAX_ATTEMPTS
            expires_at = job.expires_at or (now + job.ttl if job.ttl else None)
            records.append((job_id, state, queue, kind, priority, run_at, args_json, attempts,
                            job.tenant, job.group, expires_at, trace_json))  # fmt: skip
        if prep["admit_needed"]:
            counts = Counter((r[2], r[9] is not None) for r in records)
            queues = sorted({queue for queue, _ in counts})
            await conn.execute(OLD_ADMIT.format(schema=self.schema), queues,
                               [sum(n for (q, _), n in counts.items() if q == queue)
                                for queue in queues],
                               [(queue, True) in counts for queue in queues])  # fmt: skip
        try:
            await conn.copy_records_to_table(
                "job", schema_name=self.schema, columns=COLUMNS, records=records
            )
        except asyncpg.CheckViolationError as e:
            raise EnqueueError(f"the database rejected a job: {e}") from None
        if ready_queues:
            await conn.execute(OLD_NOTIFY.format(schema=self.schema), sorted(ready_queues))
        return ids


class StagedCopyClient(Client):
    async def _copy_in_transaction(
        self, conn: asyncpg.Connection, jobs: Sequence[_Checked], trace_json: str | None
    ) -> list[int]:
        await conn.execute(STAGE_CREATE)
        records = [
            (ord_, kind, args_json, o.queue, o.priority, o.run_at, o.delay, o.tenant,
             o.max_attempts, o.group, o.expires_at, o.ttl, trace_json)
            for ord_, (kind, args_json, o) in enumerate(jobs, start=1)
        ]  # fmt: skip
        await conn.copy_records_to_table(
            "pgjobd_enqueue_stage", schema_name="pg_temp", columns=STAGE_COLUMNS,
            records=records,
        )  # fmt: skip
        try:
            rows = await conn.fetch(STAGED_INSERT.format(schema=self.schema))
        except asyncpg.CheckViolationError as e:
            raise EnqueueError(f"the database rejected a job: {e}") from None
        return [row[0] for row in rows]
