"""The reindexer: rebuilds the hot table's indexes (REINDEX INDEX CONCURRENTLY) when one
is much larger than its live entries need, after dropping what an interrupted rebuild
left behind.

Why: the hot table churns (every job inserted, updated, deleted), and a B-tree only gives
a page back when the page is entirely empty. After a burst, or after vacuum was held
back for a while, the claim index can be mostly half-empty pages that every claim scan
walks. Vacuum does not compact them; a rebuild does.

The bloat estimate, without pgstattuple (an extension that may not be installed): an
index needs about `entries x (8-byte tuple header + key width, 8-aligned, + 4-byte line
pointer)` bytes of leaf space, at the B-tree's default 90 % leaf fill, plus its inner
pages and metapage (`expected_index_bytes`). `entries` is the index's reltuples (kept
fresh by the hot table's aggressive autovacuum/autoanalyze settings), the key width the
columns' avg_width from pg_stats. The index is rebuilt when its size on disk is more
than BLOAT_FACTOR times that and at least MIN_WASTE_BYTES more. A healthy B-tree's
pages are 50-90 % full, so 3x means pages under a third full; the errors of the
estimate (NULL keys counted at full width, no credit for deduplication) all make the
expectation larger, so it errs towards leaving an index alone. An index with no
measurement yet (reltuples -1) is left alone; an invalid index that is not a leftover
is rebuilt whatever its size (the planner cannot use it).

The entry count is as old as the table's last vacuum or analyze, the size is now: right
after a burst, or after a restart (a crash also resets the statistics that trigger
autovacuum), an index holding a legitimate backlog looks bloated against a count taken
before the backlog came. So an index is rebuilt only when it looked bloated on two
ticks with a vacuum or analyze of the table in between (`measured_at` later than the
first sighting): the count it is judged against is then newer than the suspicion. An
index that still looks bloated right after its rebuild (judged on the rebuild's own
fresh count) is one the estimate misjudges: it waits REBUILD_COOLDOWN like any rebuilt
index, not longer.

No blind schedule: each tick (every INTERVAL_S) re-measures, so the trigger is the
index's state in the database, not a timer that a restart would reset; in memory are
only the sightings, the guards against thrashing (a rebuilt index waits
REBUILD_COOLDOWN before the next) and the failure backoff (doubling from
FAILURE_BACKOFF to FAILURE_BACKOFF_MAX). A new leader starts without them, which
delays a needed rebuild by a tick or two.

REINDEX CONCURRENTLY cannot run in a transaction block, so it cannot be fenced like the
other roles' writes: the leader's term is checked just before each DDL statement. If
leadership is lost mid-rebuild the runner cancels the tick and asyncpg cancels the
statement on the server; the invalid copy it leaves is what the next leader's first
tick drops.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from datetime import datetime
from typing import ClassVar

import anyio
import asyncpg

from pgjobd import db
from pgjobd.config import Config
from pgjobd.roles import (
    RoleContext,
    as_table_owner,
    owner_ddl_session,
    owner_ddl_timeout_s,
    term_open,
)
from pgjobd.statements.maintenance import IndexSize

log = logging.getLogger(__name__)

INTERVAL_S = 600.0
BLOAT_FACTOR = 3.0
MIN_WASTE_BYTES = 1024 * 1024
REBUILD_COOLDOWN_S = 3600.0
FAILURE_BACKOFF_S = 600.0
FAILURE_BACKOFF_MAX_S = 4 * 3600.0
# A rebuild waits for every transaction older than it; don't let one wait for ever.
REINDEX_TIMEOUT_MS = 30 * 60 * 1000
# Dropping an invalid copy waits for the transactions that use the table, no longer.
DROP_LEFTOVER_TIMEOUT_MS = 5 * 60 * 1000

BTREE_PAGE_OVERHEAD = 24 + 16  # page header + B-tree special space
BTREE_LEAF_FILL = 0.90  # the default leaf fillfactor
INDEX_TUPLE_HEADER = 8
LINE_POINTER = 4


def expected_index_bytes(entries: float, key_width: int, block_size: int = 8192) -> int:
    """About how large a freshly built B-tree holding `entries` keys of `key_width`
    bytes is: full leaf pages at the default fill, one inner entry per leaf, metapage."""
    entry = math.ceil((INDEX_TUPLE_HEADER + key_width) / 8) * 8 + LINE_POINTER
    usable = (block_size - BTREE_PAGE_OVERHEAD) * BTREE_LEAF_FILL
    leaves = max(1, math.ceil(max(entries, 0.0) * entry / usable))
    inner = math.ceil(leaves * entry / usable) if leaves > 1 else 0
    return (1 + leaves + inner) * block_size


def rebuild_reason(index: IndexSize) -> str | None:
    """Why `index` should be rebuilt now, or None."""
    if not index.valid:
        return "invalid"
    if index.entries < 0 or index.key_width is None:
        return None  # never measured, or no estimate for expressions
    expected = expected_index_bytes(index.entries, index.key_width, index.block_size)
    if index.bytes > BLOAT_FACTOR * expected and index.bytes - expected >= MIN_WASTE_BYTES:
        return (
            f"bloated: {index.bytes} bytes where its {index.entries:.0f} entries need "
            f"about {expected}"
        )
    return None


class Reindexer:
    name: ClassVar[str] = "reindexer"

    def __init__(self) -> None:
        self.not_before: dict[str, float] = {}  # index -> monotonic time
        self.suspected: dict[str, datetime] = {}  # index -> when first seen bloated
        self.failures: dict[str, int] = {}
        self.rebuilt = 0
        self.dropped = 0

    def interval_s(self, config: Config) -> float:
        return INTERVAL_S

    async def tick(self, ctx: RoleContext) -> None:
        table = f"{ctx.config.database.schema}.job"
        async with owner_ddl_session(ctx, "pgjobd reindexer") as conn:
            await self._check_fence(conn, ctx)
            if await ctx.queries.index_build_in_progress(conn, table):
                log.info(
                    "an index of %s is being built by another session; not touching it", table,
                    extra={"event": "reindexer.busy", "term": ctx.term},
                )  # fmt: skip
                return
            await self._drop_leftovers(conn, ctx, table)
            for row in await ctx.queries.index_size_list(conn, table, None):
                index = row
                reason = self._confirmed(index)
                if reason is None or time.monotonic() < self.not_before.get(index.name, 0.0):
                    continue
                await self._rebuild(conn, ctx, table, index, reason)

    def _confirmed(self, index: IndexSize) -> str | None:
        """Why `index` should be rebuilt now: invalid, or bloated now and at an earlier
        tick, with its entries counted again since then. Else None (and remembered)."""
        reason = rebuild_reason(index)
        if reason is None or reason == "invalid":
            self.suspected.pop(index.name, None)
            return reason
        since = self.suspected.get(index.name)
        if since is None:
            if index.at is not None:
                self.suspected[index.name] = index.at
            log.info(
                "index %s looks %s; rebuilt only if it still does after the next vacuum "
                "or analyze of its table", index.qualified, reason,
                extra={"event": "reindexer.suspected", "index": index.name},
            )  # fmt: skip
            return None
        if index.measured_at is None or index.measured_at <= since:
            return None  # its entry count is no newer than the first sighting
        return reason

    async def _rebuild(
        self, conn: asyncpg.Connection, ctx: RoleContext, table: str, index: IndexSize, why: str
    ) -> None:
        await self._check_fence(conn, ctx)
        log.info(
            "rebuilding index %s (%s)", index.qualified, why,
            extra={"event": "reindexer.started", "index": index.name, "term": ctx.term},
        )  # fmt: skip
        started = time.monotonic()
        pid = await ctx.queries.backend_pid(conn)
        try:
            async with as_table_owner(conn, ctx, timeout_ms=REINDEX_TIMEOUT_MS):
                await conn.execute(
                    f"REINDEX INDEX CONCURRENTLY {index.qualified}",
                    timeout=owner_ddl_timeout_s(REINDEX_TIMEOUT_MS),
                )
        except asyncpg.PostgresError as e:
            failures = self.failures[index.name] = self.failures.get(index.name, 0) + 1
            wait_s = min(FAILURE_BACKOFF_S * 2 ** (failures - 1), FAILURE_BACKOFF_MAX_S)
            self.not_before[index.name] = time.monotonic() + wait_s
            log.warning(
                "rebuilding index %s failed (%d in a row); next try in %.0f s: %s",
                index.qualified, failures, wait_s, e,
                extra={"event": "reindexer.failed", "index": index.name,
                       "failures": failures, "term": ctx.term},
            )  # fmt: skip
            await self._drop_leftovers(conn, ctx, table)  # the next try starts clean
            return
        except BaseException:
            # Cancelled (leadership lost) or the connection broke: end the session from
            # another one, so the REINDEX stops on the server, and never hand back to the
            # pool (which does not reset sessions) one with a half-hour statement_timeout, or
            # one still acting as the maintainer role.
            with anyio.move_on_after(5, shield=True), contextlib.suppress(Exception):
                async with db.acquire(ctx.pool) as other:
                    await ctx.queries.backend_stop(other, pid)
            # Ending the backend may already have closed the connection, and the pool
            # then took it back (the proxy refuses terminate): either way it is gone.
            with contextlib.suppress(asyncpg.InterfaceError):
                conn.terminate()
            raise
        self.rebuilt += 1
        self.failures.pop(index.name, None)
        self.suspected.pop(index.name, None)
        self.not_before[index.name] = time.monotonic() + REBUILD_COOLDOWN_S
        # The build counted the entries it indexed (reltuples): judge on that count.
        rows = await ctx.queries.index_size_list(conn, table, index.name)
        after = rows[0] if rows else None
        log.info(
            "rebuilt index %s in %.1f s: %d -> %s bytes", index.qualified,
            time.monotonic() - started, index.bytes, after.bytes if after else "?",
            extra={"event": "reindexer.rebuilt", "index": index.name, "bytes_before":
                   index.bytes, "bytes_after": after.bytes if after else None,
                   "term": ctx.term},
        )  # fmt: skip
        still = rebuild_reason(after) if after else None
        if still:
            log.warning(
                "index %s still looks %s right after a rebuild: the estimate misjudges "
                "it; next look in %.0f s", index.qualified, still, REBUILD_COOLDOWN_S,
                extra={"event": "reindexer.misjudged", "index": index.name},
            )  # fmt: skip

    async def _drop_leftovers(self, conn: asyncpg.Connection, ctx: RoleContext, table: str) -> None:
        for row in await ctx.queries.index_leftover_list(conn, table):
            await self._check_fence(conn, ctx)
            async with as_table_owner(conn, ctx, timeout_ms=DROP_LEFTOVER_TIMEOUT_MS):
                await conn.execute(
                    f"DROP INDEX CONCURRENTLY IF EXISTS {row.qualified}",
                    timeout=owner_ddl_timeout_s(DROP_LEFTOVER_TIMEOUT_MS),
                )
            self.dropped += 1
            log.warning(
                "dropped %s, left invalid by an interrupted REINDEX CONCURRENTLY",
                row.qualified,
                extra={"event": "reindexer.leftover_dropped", "index": row.name,
                       "term": ctx.term},
            )  # fmt: skip

    @staticmethod
    async def _check_fence(conn: asyncpg.Connection, ctx: RoleContext) -> None:
        # REINDEX/DROP INDEX CONCURRENTLY cannot run in a transaction: the term is
        # checked just before. A deposed leader's rebuild overlapping the next one's is
        # harmless: both lock the table against each other (SHARE UPDATE EXCLUSIVE),
        # and the next leader leaves an index alone while another session builds one.
        await term_open(conn, ctx)
