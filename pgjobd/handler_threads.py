"""The threads that run `def` handlers: daemon threads, reused from job to job.

A thread started per job cost more than the no-op handler itself (bench/throughput.py,
`:def` rounds). The standard library's ThreadPoolExecutor reuses threads but does not
fit: its threads are joined at interpreter exit, so one stuck in a handler would keep
the testing kit's process from exiting, and its fixed number of threads would let stuck
ones take the places of live ones. Here a thread stuck in a handler is simply never
given more work; a new one is started whenever no idle one is waiting, so the threads
running at once are at most the jobs running at once; one idle for IDLE_S exits.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

IDLE_S = 60.0


class HandlerThreads:
    def __init__(self, idle_s: float = IDLE_S) -> None:
        self._idle_s = idle_s
        self._ready = threading.Condition(threading.Lock())
        self._idle = 0  # threads waiting for work, less the work handed to them
        self._handed: deque[tuple[Callable[[], object], str]] = deque()

    def run(self, work: Callable[[], object], name: str) -> None:
        """Run `work` in a daemon thread named `name`, an idle one if any waits."""
        with self._ready:
            if self._idle > 0:
                self._idle -= 1
                self._handed.append((work, name))
                self._ready.notify()
                return
        threading.Thread(target=self._serve, args=(work, name), name=name, daemon=True).start()

    def threads_idle(self) -> int:
        with self._ready:
            return self._idle

    def _serve(self, work: Callable[[], object], name: str) -> None:
        me = threading.current_thread()
        while True:
            me.name = name
            work()  # (the work reports its own outcome and never raises)
            del work
            with self._ready:
                self._idle += 1
                give_up_at = time.monotonic() + self._idle_s
                while not self._handed:
                    left = give_up_at - time.monotonic()
                    if left <= 0:
                        # Nothing was handed over: this thread is one of the idle.
                        self._idle -= 1
                        return
                    self._ready.wait(left)
                work, name = self._handed.popleft()
