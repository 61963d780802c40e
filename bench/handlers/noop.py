"""The drain benchmark's handler: does nothing but note when the first job started.

bench/throughput.py starts `pgjobd run` with $PGJOBD_BENCH_DIR set; each worker process
writes ``first.<pid>`` there (a wall-clock time.time()) when it starts its first job, like
the peers' harness (../shared/bench/peers/common.py, Recorder.on_job).
"""

from __future__ import annotations

import os
import time
from typing import Any

from pgjobd import job

_RUN_DIR = os.environ.get("PGJOBD_BENCH_DIR", "")
_started: list[float] = []  # the first job's start, once known


@job(kind="bench_noop")
async def bench_noop(args: dict[str, Any]) -> None:
    _note_first_start()


@job(kind="bench_noop_def")
def bench_noop_def(args: dict[str, Any]) -> None:
    """The same no-op as a `def` handler: the worker runs it in a thread."""
    _note_first_start()


def _note_first_start() -> None:
    if not _started:
        _started.append(time.time())
        if _RUN_DIR:  # once per process: a few microseconds, not worth a thread
            fd = os.open(os.path.join(_RUN_DIR, f"first.{os.getpid()}"), os.O_WRONLY | os.O_CREAT)
            os.write(fd, repr(_started[0]).encode())
            os.close(fd)
