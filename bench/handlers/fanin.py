"""The fan-in benchmark's callback: notes when it started (a wall-clock time.time())
in ``callback.<id>`` under $PGJOBD_BENCH_DIR (bench/fanin.py)."""

from __future__ import annotations

import os
import time
from typing import Any

from pgjobd import JobContext, job

_RUN_DIR = os.environ.get("PGJOBD_BENCH_DIR", "")


@job(kind="bench_fanin_callback")
async def bench_fanin_callback(args: dict[str, Any], ctx: JobContext) -> int:
    started = time.time()
    if _RUN_DIR:
        fd = os.open(os.path.join(_RUN_DIR, f"callback.{ctx.id}"), os.O_WRONLY | os.O_CREAT)
        os.write(fd, repr(started).encode())
        os.close(fd)
    return len(ctx.dependencies)
