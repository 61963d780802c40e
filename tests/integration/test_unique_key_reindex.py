"""Bug 6 of issue 10: a duplicate unique_key is never an error, not even while the
reindexer rebuilds the unique index. REINDEX CONCURRENTLY's "_ccnew" copy is unique
too, but ON CONFLICT does not use it as an arbiter: an insert that races another insert
of the same key, or a plan that straddles the swap, raised unique_violation there."""

from __future__ import annotations

import random

import anyio
import asyncpg
import pytest

from pgjobd import Client

pytestmark = pytest.mark.anyio

REINDEXES = 15
KEYS = ("dup", "r1", "r2", "r3")


async def test_duplicates_during_reindex_concurrently_are_not_errors(
    dsn: str, conn: asyncpg.Connection, schema: str
) -> None:
    holder = await conn.fetchval(f"SELECT {schema}.enqueue('k', '{{}}', unique_key => 'dup')")
    errors: list[BaseException] = []
    returned_for_dup: set[int] = set()
    calls = 0
    done = anyio.Event()

    async def reindex() -> None:
        rebuilder = await asyncpg.connect(dsn)
        try:
            for _ in range(REINDEXES):
                await rebuilder.execute(f"REINDEX INDEX CONCURRENTLY {schema}.job_unique_key_idx")
        finally:
            done.set()
            await rebuilder.close()

    async def finish_jobs() -> None:
        # Jobs of the rotating keys finish all the time, so their next enqueues race to
        # insert the key afresh (the holder of 'dup' stays).
        finisher = await asyncpg.connect(dsn)
        try:
            while not done.is_set():
                await finisher.execute(f"DELETE FROM {schema}.job WHERE unique_key <> 'dup'")
                await anyio.sleep(0.005)
        finally:
            await finisher.close()

    async def enqueue_sql(seed: int) -> None:
        nonlocal calls
        rng = random.Random(seed)
        producer = await asyncpg.connect(dsn)
        try:
            while not done.is_set():
                key = rng.choice(KEYS)
                try:
                    if rng.random() < 0.5:
                        job_id = await producer.fetchval(
                            f"SELECT {schema}.enqueue('k', '{{}}', unique_key => $1)", key
                        )
                    else:
                        job_id = await producer.fetchval(
                            f"SELECT id FROM {schema}.enqueue_many(ARRAY['k', 'k'], "
                            "ARRAY['{}', '{}']::jsonb[], unique_keys => ARRAY[$1, $1]) "
                            "ORDER BY ord LIMIT 1",
                            key,
                        )
                except asyncpg.PostgresError as e:
                    errors.append(e)
                    continue
                calls += 1
                if key == "dup":
                    returned_for_dup.add(job_id)
        finally:
            await producer.close()

    async def enqueue_client(seed: int) -> None:
        nonlocal calls
        rng = random.Random(seed)
        async with await Client.connect(dsn, schema=schema, max_size=1) as client:
            while not done.is_set():
                key = rng.choice(KEYS)
                try:
                    if rng.random() < 0.5:
                        job_id = await client.enqueue("k", {}, unique_key=key)
                    else:
                        job_id = (await client.enqueue_many([("k", {})], unique_key=key))[0]
                except Exception as e:
                    errors.append(e)
                    continue
                calls += 1
                if key == "dup":
                    returned_for_dup.add(job_id)

    with anyio.fail_after(300):
        async with anyio.create_task_group() as tg:
            tg.start_soon(reindex)
            tg.start_soon(finish_jobs)
            for seed in range(3):
                tg.start_soon(enqueue_sql, seed)
                tg.start_soon(enqueue_client, 100 + seed)

    failed = [(e, getattr(e, "detail", None)) for e in errors[:3]]
    assert errors == [], f"{len(errors)} of {calls + len(errors)} enqueues failed: {failed}"
    assert returned_for_dup == {holder}
    live = await conn.fetch(f"SELECT unique_key, count(*) FROM {schema}.job GROUP BY 1")
    assert all(row["count"] == 1 for row in live)
