"""The statements of sql/maintenance.sql: the reindexer's and the horizon watchdog's
reads of the catalogs and statistics views."""

from __future__ import annotations

from datetime import datetime
from typing import NamedTuple

from pgjobd.statements import Conn, Rendered, one_row, rows_of, statement


class IndexLeftover(NamedTuple):
    qualified: str
    name: str


class IndexSize(NamedTuple):
    """A B-tree index of a table and what its size is judged on (the reindexer's)."""

    qualified: str
    name: str
    valid: bool
    bytes: int
    entries: float  # reltuples; -1 when never measured
    block_size: int
    key_width: int | None  # None for an expression index
    measured_at: datetime | None = None  # the table's last vacuum or analyze
    at: datetime | None = None  # when this was read (the database's clock)


class HorizonHolderRow(NamedTuple):
    source: str
    pid: int | None
    name: str | None
    owner: str | None
    state: str | None
    backend_type: str | None
    xmin_age: int
    xact_age_s: float | None
    xact_start: datetime | None
    query_start: datetime | None
    state_change: datetime | None
    query: str | None


class TableStats(NamedTuple):
    at: datetime
    next_xid: int
    wraparound_age: int
    multixact_age: int
    live_rows: int | None  # None: no statistics for the table yet
    dead_rows: int | None
    last_vacuum: datetime | None
    last_autovacuum: datetime | None
    autovacuum_count: int | None
    vacuum_count: int | None


class MaintenanceStatements(Rendered):
    @statement("index_build_in_progress")
    async def index_build_in_progress(self, conn: Conn, table: str) -> bool:
        building: bool = await conn.fetchval(self.sql("index_build_in_progress"), table)
        return building

    @statement("index_leftover_list")
    async def index_leftover_list(self, conn: Conn, table: str) -> list[IndexLeftover]:
        return rows_of(IndexLeftover, await conn.fetch(self.sql("index_leftover_list"), table))

    @statement("index_size_list")
    async def index_size_list(self, conn: Conn, table: str, index: str | None) -> list[IndexSize]:
        return rows_of(IndexSize, await conn.fetch(self.sql("index_size_list"), table, index))

    @statement("horizon_holders")
    async def horizon_holders(
        self, conn: Conn, limit: int, now: datetime | None
    ) -> list[HorizonHolderRow]:
        records = await conn.fetch(self.sql("horizon_holders"), limit, now)
        return rows_of(HorizonHolderRow, records)

    @statement("horizon_table_stats")
    async def horizon_table_stats(self, conn: Conn, table: str, now: datetime | None) -> TableStats:
        record = await conn.fetchrow(self.sql("horizon_table_stats"), table, now)
        return one_row("horizon_table_stats", TableStats, record)

    @statement("backend_pid")
    async def backend_pid(self, conn: Conn) -> int:
        pid: int = await conn.fetchval(self.sql("backend_pid"))
        return pid

    @statement("backend_stop")
    async def backend_stop(self, conn: Conn, pid: int) -> bool:
        stopped: bool = await conn.fetchval(self.sql("backend_stop"), pid)
        return stopped
