"""The trickle benchmark's handler: records handler start minus the enqueue time.

args ``{"i": n, "t": time.time() just before Client.enqueue}``; one line ``n seconds`` per
job is appended to ``lat.<pid>`` in $PGJOBD_BENCH_DIR, as the peers' harness does
(../shared/bench/peers/common.py, Recorder.on_job).
"""

from __future__ import annotations

import os
import time
from typing import Any

from pgjobd import job

_RUN_DIR = os.environ.get("PGJOBD_BENCH_DIR", "")
# Opened at import, unbuffered, so a member that is stopped leaves a complete file.
_FD = (
    os.open(os.path.join(_RUN_DIR, f"lat.{os.getpid()}"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    if _RUN_DIR
    else -1
)


@job(kind="bench_latency")
async def bench_latency(args: dict[str, Any]) -> None:
    now = time.time()
    if _FD >= 0 and "t" in args:
        os.write(_FD, f"{args.get('i')} {now - args['t']:.6f}\n".encode())
