"""Rewritten by the sighup scenario between reloads (VERSION changes); `chaos_swap` jobs
record which version ran them."""

from __future__ import annotations

from typing import Any

from pgjobd import JobContext, job

from ._ledger import handler_started, ledger

VERSION = 0


@job(max_attempts=25)
async def chaos_swap(args: dict[str, Any], ctx: JobContext) -> int:
    started = await handler_started(ctx)
    await ledger(ctx, int(args.get("n", -1)), started, f"ok:v{VERSION}")
    return VERSION
