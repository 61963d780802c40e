"""Handlers that take their worker process down, hang, or leak, for supervision tests."""

import ctypes
import os
import time

from pgjobd import job

_hoard: list[bytes] = []


@job(max_attempts=10)
def exits(args: dict[str, object]) -> None:
    os._exit(1)


@job(max_attempts=10)
def segfaults(args: dict[str, object]) -> None:
    ctypes.string_at(0)  # reads address 0: SIGSEGV


@job(timeout="1s", max_attempts=1)
def hangs(args: dict[str, object]) -> None:
    while True:  # a busy loop no cancellation reaches
        time.sleep(0.01)


@job
def leaks(args: dict[str, object]) -> int:
    _hoard.append(os.urandom(1) * (64 << 20))  # 64 MiB this worker will never free
    return len(_hoard)
