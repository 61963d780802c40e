"""A TCP proxy that adds latency and loss to one member's link to the database, where
the kernel cannot: this machine's has no `netem` qdisc (nor tc's `gact` action), so
`tc` can throttle a link but not delay or drop at random.

While faulty, every chunk read from either side is held for `delay_s` (plus up to
`jitter_s`) before it is written on, in order; a fraction `loss` of the chunks is held
for a retransmission timeout (`stall_s`, TCP's minimum RTO is 200 ms) instead, and
what follows it on that direction waits behind it, as TCP's in-order delivery makes
everything wait behind a lost segment. That is what loss does to a TCP connection
seen from the application: the bytes arrive, late and in bursts. Healthy, it forwards
at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import dataclass, field

CHUNK = 65536


@dataclass
class Impairment:
    delay_s: float = 0.025
    jitter_s: float = 0.010
    loss: float = 0.02
    stall_s: tuple[float, float] = (0.2, 0.6)


@dataclass
class LaggyProxy:
    target_host: str
    target_port: int
    rng: random.Random
    impairment: Impairment | None = None  # None: healthy
    port: int = 0
    chunks: int = 0
    stalled: int = 0
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(
                self.target_host, self.target_port
            )
        except OSError:
            writer.close()
            return
        for source, sink in ((reader, upstream_writer), (upstream_reader, writer)):
            task = asyncio.create_task(self._pipe(source, sink))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _hold_s(self) -> float:
        impairment = self.impairment
        if impairment is None:
            return 0.0
        if self.rng.random() < impairment.loss:
            self.stalled += 1
            return self.rng.uniform(*impairment.stall_s)
        return impairment.delay_s + self.rng.uniform(0.0, impairment.jitter_s)

    async def _pipe(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        """Forwards in order; a chunk leaves no earlier than its own hold and no earlier
        than the chunk before it."""
        not_before = 0.0
        try:
            while chunk := await source.read(CHUNK):
                self.chunks += 1
                not_before = max(not_before, time.monotonic() + self._hold_s())
                wait = not_before - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                sink.write(chunk)
                await sink.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            sink.close()
