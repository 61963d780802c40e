"""The reindexer: drops what an interrupted REINDEX CONCURRENTLY left, rebuilds a bloated
index of the hot table, and does nothing unless it leads."""

from __future__ import annotations

import dataclasses
import logging

import anyio
import asyncpg
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pgjobd.roles import Deposed, RoleContext
from pgjobd.roles.reindexer import (
    BLOAT_FACTOR,
    IndexSize,
    Reindexer,
    expected_index_bytes,
    rebuild_reason,
)

pytestmark = pytest.mark.anyio


@given(
    entries=st.integers(min_value=0, max_value=10**8),
    width=st.integers(min_value=1, max_value=2000),
)
def test_expected_size_grows_with_entries_and_is_never_below_two_pages(
    entries: int, width: int
) -> None:
    size = expected_index_bytes(entries, width)
    assert size >= 2 * 8192
    assert expected_index_bytes(entries + 1000, width) >= size
    # at least the entries' own bytes
    assert size >= entries * (8 + width)


def _index(bytes_: int, entries: float, *, valid: bool = True) -> IndexSize:
    return IndexSize("s.i", "i", valid, bytes_, entries, 8192, 32)


def test_rebuild_decisions() -> None:
    need = expected_index_bytes(100_000, 32)
    assert rebuild_reason(_index(need, 100_000)) is None
    assert rebuild_reason(_index(int(need * (BLOAT_FACTOR - 0.1)), 100_000)) is None
    assert rebuild_reason(_index(int(need * (BLOAT_FACTOR + 1)), 100_000)) is not None
    assert rebuild_reason(_index(100 * 8192, 0)) is None  # bloated, but under 1 MiB
    assert rebuild_reason(_index(10**9, -1)) is None  # never measured
    assert rebuild_reason(_index(8192, 0, valid=False)) == "invalid"


def _deposed(leading: RoleContext) -> RoleContext:
    return dataclasses.replace(leading, term=leading.term + 1)  # a term not begun


async def _indexes(conn: asyncpg.Connection, schema: str) -> dict[str, bool]:
    rows = await conn.fetch(
        "SELECT c.relname, i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
        "WHERE i.indrelid = $1::regclass",
        f"{schema}.job",
    )
    return {r["relname"]: r["indisvalid"] for r in rows}


async def _interrupted_reindex(dsn: str, conn: asyncpg.Connection, schema: str) -> None:
    """A REINDEX CONCURRENTLY that waits for an older snapshot and is cancelled by its
    statement_timeout: the invalid job_claim_idx_ccnew it had made stays behind."""
    reader = await asyncpg.connect(dsn)
    try:
        reader_tx = reader.transaction(isolation="repeatable_read")
        await reader_tx.start()
        await reader.fetchval(f"SELECT count(*) FROM {schema}.job")
        await conn.execute("SET statement_timeout = '500ms'")
        with pytest.raises(asyncpg.QueryCanceledError):
            await conn.execute(f"REINDEX INDEX CONCURRENTLY {schema}.job_claim_idx")
        await conn.execute("RESET statement_timeout")
        await reader_tx.rollback()
    finally:
        await reader.close()
    assert (await _indexes(conn, schema)).get("job_claim_idx_ccnew") is False


async def test_an_interrupted_rebuild_leftover_is_dropped(
    dsn: str, conn: asyncpg.Connection, schema: str, leading: RoleContext
) -> None:
    await _interrupted_reindex(dsn, conn, schema)

    reindexer = Reindexer()
    await reindexer.tick(leading)

    indexes = await _indexes(conn, schema)
    assert "job_claim_idx_ccnew" not in indexes
    assert indexes["job_claim_idx"] is True
    assert reindexer.dropped == 1
    assert reindexer.rebuilt == 0  # a fresh, empty table: nothing bloated


async def _bloat(conn: asyncpg.Connection, schema: str, rows: int = 100_000) -> None:
    """Many available jobs, then 95 % of them gone, spread over the whole key range, so
    that every leaf page of the claim index keeps a few entries and none is freed."""
    await conn.execute(f"ALTER TABLE {schema}.job SET (autovacuum_enabled = false)")
    await conn.execute(
        f"INSERT INTO {schema}.job (state, queue, kind, args) "
        f"SELECT 'available', 'default', 'noop', '{{}}' FROM generate_series(1, {rows})"
    )
    await conn.execute(f"DELETE FROM {schema}.job WHERE id % 20 <> 0")
    await conn.execute(f"VACUUM (ANALYZE) {schema}.job")


async def _size(conn: asyncpg.Connection, schema: str, index: str) -> int:
    size: int = await conn.fetchval("SELECT pg_relation_size($1::regclass)", f"{schema}.{index}")
    return size


async def test_a_bloated_index_is_rebuilt(
    conn: asyncpg.Connection, schema: str, leading: RoleContext, caplog: pytest.LogCaptureFixture
) -> None:
    await _bloat(conn, schema)
    before = await _size(conn, schema, "job_claim_idx")
    oid_before = await conn.fetchval("SELECT $1::regclass::oid", f"{schema}.job_claim_idx")

    reindexer = Reindexer()
    await _sighted(reindexer, leading, conn, schema)
    await reindexer.tick(leading)

    after = await _size(conn, schema, "job_claim_idx")
    assert after * 5 < before, (before, after)
    assert await conn.fetchval("SELECT $1::regclass::oid", f"{schema}.job_claim_idx") != (
        oid_before
    )
    assert all((await _indexes(conn, schema)).values())
    assert await conn.fetchval(f"SELECT count(*) FROM {schema}.job") == 5_000
    rebuilt = reindexer.rebuilt
    assert rebuilt >= 1
    assert not any("misjudges" in r.getMessage() for r in caplog.records)

    await conn.execute(f"VACUUM (ANALYZE) {schema}.job")
    await reindexer.tick(leading)  # measured again: nothing left to do
    assert reindexer.rebuilt == rebuilt
    assert not reindexer.suspected


async def _sighted(
    reindexer: Reindexer, ctx: RoleContext, conn: asyncpg.Connection, schema: str
) -> None:
    """A tick that sights the bloat, then a vacuum that counts the entries again."""
    await reindexer.tick(ctx)
    assert reindexer.rebuilt == 0 and "job_claim_idx" in reindexer.suspected
    await anyio.sleep(0.01)  # the vacuum's time is after the sighting's, on any clock
    await conn.execute(f"VACUUM (ANALYZE) {schema}.job")


async def test_an_index_judged_on_an_entry_count_older_than_its_size_is_left_alone(
    conn: asyncpg.Connection, schema: str, leading: RoleContext, caplog: pytest.LogCaptureFixture
) -> None:
    # As after a restart: the claim index's entries were counted when the queue was
    # empty; a backlog has come since. Large against that count, but not bloated.
    await conn.execute(f"ALTER TABLE {schema}.job SET (autovacuum_enabled = false)")
    await conn.execute(f"VACUUM (ANALYZE) {schema}.job")
    await conn.execute(
        f"INSERT INTO {schema}.job (state, queue, kind, args) "
        "SELECT 'available', 'default', 'noop', '{}' FROM generate_series(1, 60000)"
    )
    size = await _size(conn, schema, "job_claim_idx")
    reindexer = Reindexer()

    with caplog.at_level(logging.INFO, logger="pgjobd.roles.reindexer"):
        await reindexer.tick(leading)  # sighted against the stale count
        assert reindexer.rebuilt == 0
        await conn.execute(f"VACUUM (ANALYZE) {schema}.job")  # counted again
        await reindexer.tick(leading)

    assert reindexer.rebuilt == 0
    assert not reindexer.suspected and not reindexer.not_before
    assert await _size(conn, schema, "job_claim_idx") == size
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_a_member_that_is_not_leader_touches_no_index(
    dsn: str, conn: asyncpg.Connection, schema: str, leading: RoleContext
) -> None:
    await _interrupted_reindex(dsn, conn, schema)
    await _bloat(conn, schema, rows=50_000)
    before = await _size(conn, schema, "job_claim_idx")

    reindexer = Reindexer()
    with pytest.raises(Deposed, match="no longer leader"):
        await reindexer.tick(_deposed(leading))

    assert (await _indexes(conn, schema)).get("job_claim_idx_ccnew") is False
    assert await _size(conn, schema, "job_claim_idx") == before
    assert (reindexer.rebuilt, reindexer.dropped) == (0, 0)


async def test_a_rebuild_cancelled_with_the_term_stops_on_the_server(
    dsn: str, conn: asyncpg.Connection, schema: str, leading: RoleContext
) -> None:
    await _bloat(conn, schema, rows=50_000)
    reader = await asyncpg.connect(dsn)
    try:
        reader_tx = reader.transaction(isolation="repeatable_read")
        await reader_tx.start()
        await reader.fetchval(f"SELECT count(*) FROM {schema}.job")  # the REINDEX waits
        reindexer = Reindexer()
        await _sighted(reindexer, leading, conn, schema)
        with anyio.move_on_after(1.0) as scope:
            await reindexer.tick(leading)
        assert scope.cancelled_caught
        still_running = await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'REINDEX INDEX%' "
            "AND state = 'active' AND pid <> pg_backend_pid()"
        )
        assert still_running == 0
        await reader_tx.rollback()
    finally:
        await reader.close()

    await reindexer.tick(leading)  # the next term: drops the leftover, then rebuilds
    indexes = await _indexes(conn, schema)
    assert not any("_cc" in name for name in indexes), indexes
    assert all(indexes.values())
    assert reindexer.dropped >= 1 and reindexer.rebuilt >= 1
