"""The architecture's floor: the least a member built as design/architecture.md says can
do per job, to measure pgjobd's member against (issue 17, targets 1 and 3).

A supervisor process claims with pgjobd's own `job_claim` (two claim loops, each
claiming the free slots, gathering half of them or waiting BATCH_WINDOW_S as the
producer does), hands each claimed job over a pipe to one of `processes` child processes
(the one with the most free slots, one write per child and claim), and records the ends
its children report with pgjobd's own `job_complete_many`, batched as the completer
batches (MAX_BATCH, FLUSH_AFTER_S). A child decodes each job's args (the JSON text
PostgreSQL returned) and runs the no-op handler in a task of its own (handlers of a
process run at once), and reports what ended in one write per event-loop turn.

A claim loop that comes back empty waits for the enqueue's notification (a LISTEN
session on `<schema>.job_ready`, as the member's notifier) or 50 ms, so the floor can run
bench/throughput.py's trickle too: a job whose args carry "t" (the enqueuer's clock, as
bench/handlers/latency.py reads it) gets its enqueue-to-start latency noted in
`lat.<pid>`.

Everything else a member does is left out: no leadership, lease keeper, presence,
metrics, logs, flow control, cursor look-behind, poison-pill bookkeeping, timeouts,
middleware, retries or failure paths. So its CPU per job and its drain rate are
what that process layout costs at the least on this machine, with the statements and
the stack (asyncpg, uvloop, msgspec) pgjobd uses; a member cannot do better than it.

    python bench/floor_chain.py --dsn DSN --schema S --processes 2 --concurrency 20
        --history all           # until SIGTERM; $PGJOBD_BENCH_DIR gets `ready` and
                                # `first.<pid>` (a time.time()) like bench/handlers
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import signal
import struct
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import uvloop

if TYPE_CHECKING:  # (the child imports neither asyncpg nor pgjobd)
    import asyncpg

HEADER = struct.Struct(">I")
APPLICATION_NAME = "pgjobd-floor"  # counted as the member's sessions by the benches
QUEUE = "default"
MEMBER_ID = "floor"
LEASE = timedelta(seconds=30)


def note(path: Path, text: str) -> None:
    """A file for the bench that started this (once per process: no thread for it)."""
    path.write_text(text)


# -- the child -----------------------------------------------------------------------


async def noop(args: object) -> None:
    return None


def latency_notes(run_dir: str | None) -> Callable[[object], None]:
    """What the child does with a job's args besides the no-op: notes the trickle's
    latency, as bench/handlers/latency.py does, when the args carry the enqueuer's "t"."""
    fd = (
        os.open(Path(run_dir, f"lat.{os.getpid()}"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        if run_dir
        else -1
    )

    def note_latency(args: object) -> None:
        if fd >= 0 and isinstance(args, dict) and "t" in args:
            os.write(fd, f"{args.get('i')} {time.time() - args['t']:.6f}\n".encode())

    return note_latency


async def child_main() -> None:
    """Read (id, fence, args) frames on stdin, run each, write [[id, fence], ...] ends."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=2**24)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    transport, _ = await loop.connect_write_pipe(asyncio.BaseProtocol, sys.stdout)
    decode_run = msgspec.msgpack.Decoder(tuple[int, int, bytes]).decode
    decode_args = msgspec.json.decode
    encode = msgspec.msgpack.Encoder().encode
    ended: list[tuple[int, int]] = []
    first = os.environ.get("PGJOBD_BENCH_DIR")
    note_latency = latency_notes(first)

    def flush() -> None:
        body = encode(ended)
        ended.clear()
        transport.write(HEADER.pack(len(body)) + body)

    def run(job_id: int, fence: int, args: bytes) -> None:
        async def attempt() -> None:
            decoded = decode_args(args)
            note_latency(decoded)
            await noop(decoded)
            if not ended:
                loop.call_soon(flush)  # one write for what ends in this turn
            ended.append((job_id, fence))

        tasks.add(task := loop.create_task(attempt()))
        task.add_done_callback(tasks.discard)

    tasks: set[asyncio.Task[None]] = set()
    while True:
        try:
            header = await reader.readexactly(HEADER.size)
        except asyncio.IncompleteReadError:
            return
        job_id, fence, args = decode_run(await reader.readexactly(HEADER.unpack(header)[0]))
        if first:
            note(Path(first, f"first.{os.getpid()}"), repr(time.time()))
            first = None
        run(job_id, fence, args)


# -- the supervisor --------------------------------------------------------------------


class Child:
    def __init__(self, process: asyncio.subprocess.Process, slots: int) -> None:
        self.process = process
        self.free = slots


class Floor:
    def __init__(self, args: argparse.Namespace) -> None:
        from pgjobd.completer import FLUSH_AFTER_S, MAX_BATCH  # noqa: PLC0415
        from pgjobd.producer import BATCH_SHARE, BATCH_WINDOW_S, CLAIMERS  # noqa: PLC0415
        from pgjobd.queries import for_schema  # noqa: PLC0415

        q = for_schema(args.schema)
        self.claim_sql, self.complete_sql = q.sql("job_claim"), q.sql("job_complete_many")
        self.args = args
        self.keep = args.history == "all"
        self.children: list[Child] = []
        self.reserved = 0
        self.changed = asyncio.Event()
        self.heard = asyncio.Event()  # a job_ready notification since the last claim
        self.channel = f"{args.schema}.job_ready"
        self.ended: list[tuple[int, int]] = []
        self.ended_event = asyncio.Event()
        self.after: tuple[int, object, int] | None = None  # the claim cursor
        self.claimers = CLAIMERS if args.claimers is None else args.claimers
        self.share = BATCH_SHARE if args.share is None else args.share
        self.window_s = BATCH_WINDOW_S if args.window_ms is None else args.window_ms / 1000
        self.max_batch, self.flush_after_s = MAX_BATCH, FLUSH_AFTER_S

    def unreserved(self) -> int:
        return sum(c.free for c in self.children) - self.reserved

    def _changed(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    async def run(self) -> None:
        import asyncpg  # noqa: PLC0415

        from pgjobd.db import GENERIC_PLANS  # noqa: PLC0415 (the member's pool's plans)

        base, extra = divmod(self.args.concurrency, self.args.processes)
        for index in range(self.args.processes):
            process = await asyncio.create_subprocess_exec(
                sys.executable, __file__, "--child",
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            )  # fmt: skip
            self.children.append(Child(process, base + (1 if index < extra else 0)))
        settings = {"application_name": APPLICATION_NAME, **GENERIC_PLANS}
        conns = [
            await asyncpg.connect(self.args.dsn, server_settings=settings)
            for _ in range(self.claimers + 2)
        ]
        listener = conns.pop()
        await listener.add_listener(self.channel, lambda *_: self.heard.set())
        for conn in conns:  # prepare both statements outside the measurement
            await conn.fetch(self.claim_sql, "no_such_queue", 1, MEMBER_ID, LEASE, None, None, None)
            await conn.fetch(self.complete_sql, [], [], [], [])
        if run_dir := os.environ.get("PGJOBD_BENCH_DIR"):
            note(Path(run_dir, "ready"), "")
        async with asyncio.TaskGroup() as tg:
            for child in self.children:
                tg.create_task(self.read_ends(child))
            for conn in conns[:-1]:
                tg.create_task(self.claim_loop(conn))
            tg.create_task(self.complete_loop(conns[-1]))

    async def claim_loop(self, conn: asyncpg.Connection) -> None:
        saturated = False
        while True:
            while self.unreserved() <= 0:
                await self.changed.wait()
            if saturated:
                enough = max(1, self.args.concurrency // self.share)
                # (asyncio.timeout, not wait_for: no task per wait to slow the floor down)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.window_s):
                        while self.unreserved() < enough:
                            await self.changed.wait()
            limit = self.unreserved()
            self.reserved += limit
            self.heard.clear()
            try:
                rows = await conn.fetch(
                    self.claim_sql, QUEUE, limit, MEMBER_ID, LEASE, *(self.after or (None,) * 3)
                )
            finally:
                self.reserved -= limit
            if rows:
                last = max((r["priority"], r["scheduled_at"], r["id"]) for r in rows)
                if self.after is None or last > self.after:
                    self.after = last
                self.hand_over(rows)
            saturated = len(rows) == limit
            if not rows:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.05):
                        await self.heard.wait()

    def hand_over(self, rows: list) -> None:  # type: ignore[type-arg]
        batches: dict[int, list[bytes]] = {}
        for row in rows:
            index, child = max(enumerate(self.children), key=lambda c: c[1].free)
            child.free -= 1
            body = msgspec.msgpack.encode((row["id"], row["fence"], row["args"].encode()))
            batches.setdefault(index, []).append(HEADER.pack(len(body)) + body)
        for index, frames in batches.items():
            self.children[index].process.stdin.write(b"".join(frames))  # type: ignore[union-attr]

    async def read_ends(self, child: Child) -> None:
        stdout = child.process.stdout
        assert stdout is not None
        decode = msgspec.msgpack.Decoder(list[tuple[int, int]]).decode
        while True:
            header = await stdout.readexactly(HEADER.size)
            ended = decode(await stdout.readexactly(HEADER.unpack(header)[0]))
            child.free += len(ended)
            self.ended += ended
            self.ended_event.set()
            self._changed()

    async def complete_loop(self, conn: asyncpg.Connection) -> None:
        while True:
            await self.ended_event.wait()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.flush_after_s):
                    while len(self.ended) < self.max_batch:
                        self.ended_event.clear()
                        await self.ended_event.wait()
            batch, self.ended = self.ended[: self.max_batch], self.ended[self.max_batch :]
            if not self.ended:
                self.ended_event.clear()
            ids = [job_id for job_id, _ in batch]
            fences = [fence for _, fence in batch]
            await conn.fetch(
                self.complete_sql, ids, fences, [None] * len(batch), [self.keep] * len(batch)
            )


async def supervisor_main(args: argparse.Namespace) -> None:
    floor = Floor(args)
    main = asyncio.current_task()
    assert main is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main.cancel)
    try:
        await floor.run()
    except asyncio.CancelledError:
        pass
    finally:
        for child in floor.children:
            if child.process.returncode is None:
                child.process.kill()
                await child.process.wait()


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number of at least 1")
    return int(text)


def not_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a finite number of at least 0")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dsn")
    parser.add_argument("--schema", default="pgjobd")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=20)
    parser.add_argument("--history", default="all", choices=("all", "none"))
    # Other claim strategies than the member's (its constants are the defaults), to see
    # whether any does better in this layout:
    parser.add_argument("--claimers", type=positive, help="claim loops (default: CLAIMERS)")
    parser.add_argument("--share", type=positive,
                        help="a saturated loop gathers concurrency // share free slots "
                        "(default: BATCH_SHARE)")  # fmt: skip
    parser.add_argument("--window-ms", type=not_negative,
                        help="...or waits this long (default: BATCH_WINDOW_S)")  # fmt: skip
    args = parser.parse_args()
    if args.child:
        uvloop.run(child_main())
    else:
        uvloop.run(supervisor_main(args))


if __name__ == "__main__":
    main()
