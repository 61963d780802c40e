"""The soak benchmark's handlers (bench/soak.py): jobs that retry once, snooze now and
then, and a plain no-op for the scheduled ones (bench_noop, in noop.py)."""

from __future__ import annotations

import random
from typing import Any

from pgjobd import JobContext, Retry, Snooze, job


@job(kind="bench_soak_retry")
async def bench_soak_retry(args: dict[str, Any], ctx: JobContext) -> None:
    """Fails its first attempt (back in a second), completes the second."""
    if ctx.attempt == 1:
        raise Retry(after=1)


@job(kind="bench_soak_snooze")
async def bench_soak_snooze(args: dict[str, Any]) -> None:
    """Snoozes for a second half of the time (a snooze uses no attempt): two runs on
    average."""
    if random.random() < 0.5:
        raise Snooze(1)
