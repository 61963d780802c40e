"""The ledger: every chaos handler execution is written to `chaos_ledger`.

Each worker process keeps a small asyncpg pool of its own (application_name
"chaos ledger", so the terminate-backends scenario never picks it). A write that fails
(the server is restarting) is retried for up to two minutes; a handler whose ledger
write never lands raises, so a completed job always has its row. A private helper
(leading underscore): pgjobd does not load it as a handler module.
"""

from __future__ import annotations

import asyncio
import os
import time

import asyncpg

from pgjobd import JobContext

_pool: asyncpg.Pool | None = None
_pool_lock: asyncio.Lock | None = None
_LEDGER_RETRY_S = 120.0

_INSERT = (
    "INSERT INTO public.chaos_ledger (job_id, attempt, kind, n, member_pid, worker_pid, "
    "started_at, ended_at, outcome, cpu_policy) "
    "VALUES ($1, $2, $3, $4, $5, $6, to_timestamp($7), to_timestamp($8), $9, $10) "
    "ON CONFLICT DO NOTHING"  # a retry of a write whose COMMIT answer was lost
)
_STARTED = (
    "INSERT INTO public.chaos_started (job_id, attempt, worker_pid, started_at) "
    "VALUES ($1, $2, $3, to_timestamp($4)) ON CONFLICT DO NOTHING"
)


async def _get_pool() -> asyncpg.Pool:
    global _pool, _pool_lock  # noqa: PLW0603 (one pool per worker process)
    if _pool_lock is None:
        _pool_lock = asyncio.Lock()
    async with _pool_lock:
        if _pool is None:
            _pool = await asyncpg.create_pool(
                os.environ["CHAOS_LEDGER_DSN"],
                min_size=1,
                max_size=4,
                server_settings={"application_name": "chaos ledger"},
                command_timeout=10,
            )
        return _pool


async def _reset_pool() -> None:
    global _pool
    pool, _pool = _pool, None
    if pool is not None:
        pool.terminate()


async def ledger(ctx: JobContext, n: int, started: float, outcome: str) -> None:
    """One execution ended (or is about to end its process): its ledger row."""
    ended = time.time()
    policy = os.sched_getscheduler(0) if hasattr(os, "sched_getscheduler") else None
    await _write(
        _INSERT, ctx.id, ctx.attempt, ctx.kind, n, os.getppid(), os.getpid(),
        started, ended, outcome, policy,
    )  # fmt: skip


async def handler_started(ctx: JobContext) -> float:
    """A handler began an attempt: the evidence that the attempt was really started
    (a charged attempt without it was claimed but never handed to a handler)."""
    started = time.time()
    await _write(_STARTED, ctx.id, ctx.attempt, os.getpid(), started)
    return started


async def _write(sql: str, *args: object) -> None:
    deadline = time.monotonic() + _LEDGER_RETRY_S
    while True:
        try:
            pool = await _get_pool()
            await pool.execute(sql, *args)
            return
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError):
            if time.monotonic() > deadline:
                raise
            await _reset_pool()
            await asyncio.sleep(0.2)
