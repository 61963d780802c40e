"""Jobs in every state, with hostile strings, for the web console's tests.

Jobs are enqueued through the SQL function `enqueue` and moved on by the statements'
own SQL functions (job_move) or plain updates of what a member sets when it claims.
"""

from __future__ import annotations

from dataclasses import dataclass

import asyncpg

from pgjobd import fingerprint as fingerprints

HOSTILE = '<script>alert("x")</script><img src=x onerror=alert(1)>'
KIND = "hostile.kind"
TENANT = f"tenant {HOSTILE}"
ERROR_CLASS = "ValueError"
ERROR_MESSAGE = f"bad input {HOSTILE}"
# Reasons a job dies for without a failed attempt, so without a fingerprint.
NO_ATTEMPT = ("expired", "dependency_failed")
FINGERPRINT = fingerprints.fingerprint(ERROR_CLASS, ERROR_MESSAGE, "h:handle")
TRACEBACK = f'Traceback (most recent call last):\n  File "h.py", line 1\nValueError: {HOSTILE}'


@dataclass(frozen=True)
class Population:
    ids: dict[str, int]  # state -> a job in it

    def __getitem__(self, state: str) -> int:
        return self.ids[state]


async def enqueue_one(
    conn: asyncpg.Connection, schema: str, *, kind: str = KIND, queue: str = "default",
    args: str = '{"html": "' + HOSTILE.replace('"', '\\"') + '"}', tenant: str | None = TENANT,
    delay: str | None = None,
) -> int:  # fmt: skip
    job_id: int = await conn.fetchval(
        f"SELECT {schema}.enqueue($1, $2::jsonb, queue => $3, tenant => $4, "
        "run_at => now() + coalesce($5::text::interval, '0s'))",
        kind, args, queue, tenant, delay,
    )  # fmt: skip
    return job_id


async def finish(
    conn: asyncpg.Connection, schema: str, job_id: int, reason: str | None,
    error: str | None = None, result: str | None = None, fingerprint: str | None = None,
) -> None:  # fmt: skip
    """Ends a live job as job_fail_many or job_complete_many would (job_move), with
    its last attempt's error fingerprint: by default, for a job that died of an error
    ("Class: message"), the fingerprint the failure path would give it."""
    if fingerprint is None and error and reason not in (None, "cancelled", *NO_ATTEMPT):
        error_class, _, message = error.partition(": ")
        fingerprint = fingerprints.fingerprint(error_class, message, "h:handle")
    await conn.execute(
        f"""SELECT count(*) FROM {schema}.job_move(ARRAY[$1::bigint], NULL, ARRAY[$2::text],
                ARRAY[$3::text], ARRAY[$4::jsonb], NULL, ARRAY[$5::text])""",
        job_id, reason, error, result, fingerprint,
    )  # fmt: skip


async def fail_attempt(conn: asyncpg.Connection, schema: str, job_id: int, attempt: int) -> None:
    await conn.execute(
        f"""INSERT INTO {schema}.job_attempt (job_id, duration_s, attempt, queue, kind,
                member, outcome, error_class, error_message, traceback, fingerprint)
            SELECT id, 0.25, $2, queue, kind, $3, 'failed', $4, $5, $6, $7
            FROM {schema}.job WHERE id = $1""",
        job_id, attempt, f"member {HOSTILE}", ERROR_CLASS, ERROR_MESSAGE, TRACEBACK, FINGERPRINT,
    )  # fmt: skip
    await conn.execute(
        f"UPDATE {schema}.job SET attempt = $2, last_error = $3 WHERE id = $1",
        job_id, attempt, f"{ERROR_CLASS}: {ERROR_MESSAGE}",
    )  # fmt: skip


async def populate(conn: asyncpg.Connection, schema: str, queue: str = "default") -> Population:
    """One job in each of the seven states, all with hostile args and tenant."""
    ids = {}

    async def enqueue(conn: asyncpg.Connection, schema: str, delay: str | None = None) -> int:
        return await enqueue_one(conn, schema, queue=queue, delay=delay)

    ids["completed"] = await enqueue(conn, schema)
    await finish(conn, schema, ids["completed"], None, result='{"out": "' + "<b>done</b>" + '"}')
    ids["dead"] = await enqueue(conn, schema)
    await fail_attempt(conn, schema, ids["dead"], 1)
    await fail_attempt(conn, schema, ids["dead"], 2)
    await finish(
        conn, schema, ids["dead"], "attempts_exhausted", f"{ERROR_CLASS}: {ERROR_MESSAGE}",
        fingerprint=FINGERPRINT,
    )  # fmt: skip
    ids["cancelled"] = await enqueue(conn, schema)
    await finish(conn, schema, ids["cancelled"], "cancelled")
    ids["scheduled"] = await enqueue(conn, schema, delay="1 hour")
    ids["retryable"] = await enqueue(conn, schema)
    await fail_attempt(conn, schema, ids["retryable"], 1)
    await conn.execute(
        f"UPDATE {schema}.job SET state = 'retryable', run_at = now() + interval '1 hour' "
        "WHERE id = $1",
        ids["retryable"],
    )
    ids["running"] = await enqueue(conn, schema)
    await conn.execute(
        f"UPDATE {schema}.job SET state = 'running', owner = 'test-member', attempt = 1, "
        f"fence = nextval('{schema}.fence_seq'), lease_expires_at = now() + interval '1 hour', "
        "attempted_at = now() WHERE id = $1",
        ids["running"],
    )
    ids["available"] = await enqueue(conn, schema)
    return Population(ids)


enqueue = enqueue_one
