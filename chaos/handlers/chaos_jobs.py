"""The chaos suite's job handlers: each execution is written to the ledger table.

Every handler records its start in `chaos_started` first, then (job id, attempt, member
pid, worker pid, start, end, outcome) in `chaos_ledger` (see _ledger.py) before it
returns, raises or kills its worker.

Args: {"n": the workload index (-1 for cron jobs), "ms": time to spend}.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from pgjobd import JobContext, job

from ._ledger import handler_started, ledger


def _n(args: dict[str, Any]) -> int:
    return int(args.get("n", -1))


@job(max_attempts=25)
async def chaos_work(args: dict[str, Any], ctx: JobContext) -> int:
    """The bulk of every workload: spend `ms`, record, succeed."""
    started = await handler_started(ctx)
    await asyncio.sleep(float(args.get("ms", 10)) / 1000)
    await ledger(ctx, _n(args), started, "ok")
    return ctx.attempt


@job(queue="limited", max_attempts=25)
async def chaos_limited(args: dict[str, Any], ctx: JobContext) -> int:
    """chaos_work in the `limits` scenario's queue with a global_concurrency and a
    rate_limit."""
    return await chaos_work(args, ctx)


@job(queue="reserved", max_attempts=25)
async def chaos_reserved(args: dict[str, Any], ctx: JobContext) -> int:
    """chaos_work in the `limits` scenario's queue with only a global_concurrency (it
    claims through flow_reserve and job_claim_reserved)."""
    return await chaos_work(args, ctx)


@job(queue="fair", max_attempts=25)
async def chaos_fair(args: dict[str, Any], ctx: JobContext) -> int:
    """chaos_work in the `limits` scenario's queue whose only limit is fair = true, of
    four tenants, one of them flooding (it claims by tag, without the queue's lock)."""
    return await chaos_work(args, ctx)


@job(queue="grouped", max_attempts=25)
async def chaos_grouped(args: dict[str, Any], ctx: JobContext) -> int:
    """chaos_work for jobs enqueued in ordered groups (args "group"); fails its first
    attempt when args "fail_once" is set (a retrying head keeps its place)."""
    started = await handler_started(ctx)
    await asyncio.sleep(float(args.get("ms", 10)) / 1000)
    if args.get("fail_once") and ctx.attempt == 1:
        await ledger(ctx, _n(args), started, "raised")
        raise RuntimeError("chaos: a group head fails once")
    await ledger(ctx, _n(args), started, "ok")
    return ctx.attempt


@job(max_attempts=25)
async def chaos_raise_once(args: dict[str, Any], ctx: JobContext) -> int:
    """Fails its first attempt (an ordinary exception), succeeds after."""
    started = await handler_started(ctx)
    await asyncio.sleep(float(args.get("ms", 10)) / 1000)
    if ctx.attempt == 1:
        await ledger(ctx, _n(args), started, "raised")
        raise RuntimeError("chaos: failing the first attempt on purpose")
    await ledger(ctx, _n(args), started, "ok")
    return ctx.attempt


@job(max_attempts=25)
async def chaos_crash_once(args: dict[str, Any], ctx: JobContext) -> int:
    """Kills its own worker process (os._exit) on the first attempt, succeeds after."""
    started = await handler_started(ctx)
    if ctx.attempt == 1:
        await ledger(ctx, _n(args), started, "crashed")
        os._exit(3)
    await ledger(ctx, _n(args), started, "ok")
    return ctx.attempt


@job(max_attempts=25)
async def chaos_poison(args: dict[str, Any], ctx: JobContext) -> None:
    """Kills its worker on every attempt: quarantined (dead, worker_crash)."""
    await ledger(ctx, _n(args), await handler_started(ctx), "crashed")
    os._exit(4)


@job(max_attempts=25, timeout="1s")
async def chaos_hang_soft(args: dict[str, Any], ctx: JobContext) -> int:
    """First attempt sleeps past its 1s timeout (cancellable): a timeout failure."""
    started = await handler_started(ctx)
    if ctx.attempt == 1:
        await ledger(ctx, _n(args), started, "hung")
        await asyncio.sleep(30)
    await ledger(ctx, _n(args), started, "ok")
    return ctx.attempt


@job(max_attempts=25, timeout="1s")
async def chaos_hang_hard(args: dict[str, Any], ctx: JobContext) -> int:
    """First attempt blocks its worker's event loop past the timeout: the worker is killed."""
    started = await handler_started(ctx)
    if ctx.attempt == 1:
        await ledger(ctx, _n(args), started, "hung")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # no await: nothing can cancel this
            time.sleep(0.05)  # noqa: ASYNC251 (blocking on purpose)
    await ledger(ctx, _n(args), started, "ok")
    return ctx.attempt


@job(max_attempts=25, timeout="30s")
async def chaos_past_lease(args: dict[str, Any], ctx: JobContext) -> int:
    """Runs longer than the lease (ms is e.g. 5000 with lease 3s): renewal must hold."""
    started = await handler_started(ctx)
    await asyncio.sleep(float(args.get("ms", 5000)) / 1000)
    await ledger(ctx, _n(args), started, "ok")
    return ctx.attempt


@job(max_attempts=25)
async def chaos_cron(args: dict[str, Any], ctx: JobContext) -> str:
    """Enqueued by the config's [[cron]] entry, once per minute slot."""
    await ledger(ctx, -1, await handler_started(ctx), "ok")
    return ctx.scheduled_at.isoformat()
