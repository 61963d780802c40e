"""Leader election on a PostgreSQL advisory lock held by a dedicated session.

States: candidate (no lock; tries again every ELECT_INTERVAL_S, jittered) → leader
(lock held; a database-issued term in the `leader` table) → candidate again as soon as
it cannot prove, every PING_INTERVAL_S within PING_TIMEOUT_S, that its session still
holds the lock. Roles learn of every change in order through `changes`, and a change
to "not leader" is sent before anything else happens, so roles stop first.

The session is never from a pool: asyncpg's pool release unlocks advisory locks. Behind
a transaction-pooling proxy, point `database.leader_dsn` straight at PostgreSQL.
"""

from __future__ import annotations

import logging

import anyio
import asyncpg
import msgspec
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectSendStream

from pgjobd import backoff
from pgjobd.config import Config
from pgjobd.db import connect_session
from pgjobd.errors import TRANSIENT
from pgjobd.lock_keys import LEADER, lock_key
from pgjobd.queries import Queries

log = logging.getLogger(__name__)

ELECT_INTERVAL_S = 1.0
PING_INTERVAL_S = 1.0
PING_TIMEOUT_S = 1.0


class Leadership(msgspec.Struct, frozen=True):
    """A change of this member's leadership. While leading, `backend_pid` is the
    session holding the lock: role statements are fenced on it."""

    is_leader: bool
    term: int = 0
    backend_pid: int = 0


def unsigned(key: tuple[int, int]) -> tuple[int, int]:
    """The lock key as pg_locks shows it (classid, objid are unsigned oids)."""
    return key[0] & 0xFFFFFFFF, key[1] & 0xFFFFFFFF


class Elector:
    def __init__(
        self,
        config: Config,
        queries: Queries,
        member_id: str,
        changes: MemoryObjectSendStream[Leadership],
    ) -> None:
        self.config = config
        self.q = queries
        self.member_id = member_id
        self.changes = changes
        self.key = lock_key(LEADER, config.database.schema)
        self.term = 0

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with self.changes:
            while True:
                try:
                    conn = await connect_session(
                        self.config, "pgjobd leader", self.config.require_leader_dsn()
                    )
                except TRANSIENT as e:
                    log.warning("leader session: cannot connect: %s", e)
                    await anyio.sleep(backoff.jittered(ELECT_INTERVAL_S * 2))
                    continue
                try:
                    await self._campaign(conn)
                except (*TRANSIENT, asyncpg.PostgresError) as e:
                    log.warning(
                        "leader session lost: %s", e, extra={"event": "leader.session_lost"}
                    )
                finally:
                    with anyio.move_on_after(2, shield=True):
                        await conn.close()  # closing the session frees the lock
                await anyio.sleep(backoff.jittered(ELECT_INTERVAL_S))

    async def _campaign(self, conn: asyncpg.Connection) -> None:
        resigned = anyio.Event()

        def on_resign(*_: object) -> None:
            resigned.set()

        # A leader that shuts down gracefully says so: take over at once, not next try.
        await conn.add_listener(f"{self.config.database.schema}.leader", on_resign)
        while True:  # a candidate: try, and keep the session warm meanwhile
            if await conn.fetchval(self.q["leader_try_lock"], *self.key):
                break
            with anyio.move_on_after(backoff.jittered(ELECT_INTERVAL_S)):
                await resigned.wait()
            resigned = anyio.Event()
        self.term = await conn.fetchval(self.q["leader_term_begin"], self.member_id)
        pid = conn.get_server_pid()
        log.info(
            "leader for term %d", self.term,
            extra={"event": "leader.gained", "term": self.term, "member": self.member_id},
        )  # fmt: skip
        await self.changes.send(Leadership(True, self.term, pid))
        try:
            while True:
                await anyio.sleep(PING_INTERVAL_S)
                with anyio.fail_after(PING_TIMEOUT_S):
                    holds = await conn.fetchval(self.q["leader_still_holds"], *unsigned(self.key))
                if not holds:
                    raise asyncpg.InterfaceError("the advisory lock is no longer held")
        finally:
            with anyio.CancelScope(shield=True):
                await self.changes.send(Leadership(False, self.term))
                log.info(
                    "no longer leader (term %d)", self.term,
                    extra={"event": "leader.lost", "term": self.term},
                )  # fmt: skip
                with anyio.move_on_after(2):
                    try:
                        await conn.fetchval(self.q["leader_resign"], self.term, *self.key)
                    except (*TRANSIENT, asyncpg.PostgresError):
                        pass  # the session is gone, and the lock with it
