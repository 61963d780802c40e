"""The messages between the supervisor and its worker processes, and how they are framed.

A frame is a 4-byte big-endian length followed by that many bytes of msgpack: one tagged
msgspec Struct. The parent writes to the child's stdin and reads the child's original
stdout (the child moves its own prints to stderr before it sends anything).

    parent -> child   Run(job, timeout_s)   run this job (the child holds it until Done)
                      Cancel(job_id, fence) set that attempt's ctx.cancelled (cooperative)
                      Stop()                take no more work, finish what you hold, exit 0
    child -> parent   Ready(pid, kinds)     handlers loaded; the kinds this child knows
                      BootFailed(message)   handlers failed to load; the child exits 3
                      Done(job_id, ...)     the end of one job it held

Job args travel as the JSON text PostgreSQL returned and are decoded only in the child.
This module is the child's side (ChildChannel, plain asyncio) and what both sides share;
the parent's end, on anyio, is pgjobd.channel. A worker imports neither anyio nor asyncpg.
"""

from __future__ import annotations

import asyncio
import os
import struct
from collections.abc import Callable
from typing import Any, Generic, Literal, TypeVar, get_args

import msgspec

from pgjobd.errors import PgjobdError
from pgjobd.model import ClaimedJob, KindInfo, Outcome, Verdict

# A queue's cpu_scheduling (pgjobd.config): the Linux scheduling policy its workers run
# under, as the supervisor passes it on a worker's command line, by systemd's names.
CpuScheduling = Literal["batch", "other"]
CPU_POLICIES = {name: f"SCHED_{name.upper()}" for name in get_args(CpuScheduling)}

# A worker's exit status, as its parent reads it (the parent never imports pgjobd.worker).
EXIT_OK = 0
# Orphaned (the parent is gone), it abandoned jobs still running past their timeouts.
EXIT_ABANDONED = 1
# Its handlers failed to load (after a BootFailed): a boot failure, not a crash.
EXIT_BOOT = 3
# The pipe to the parent broke under a write (a handler closed or took over the
# descriptor): no outcome can reach the parent any more, so it ended at once.
EXIT_CHANNEL_BROKEN = 4

HEADER = struct.Struct(">I")
# Job args are capped far lower at enqueue (client.MAX_ARGS_BYTES); results and
# tracebacks are capped by the worker. A bigger frame means a corrupt stream.
MAX_FRAME = 16 * 1024 * 1024


class ProtocolError(PgjobdError):
    """A frame that cannot be read: too big, truncated, or not a known message."""


class Message(msgspec.Struct, frozen=True, tag_field="t"):
    """Base of every frame's message."""


class Run(Message, frozen=True, tag="run"):
    job: ClaimedJob
    timeout_s: float


class Cancel(Message, frozen=True, tag="cancel"):
    job_id: int
    fence: int  # the attempt: one member may hold two attempts of a job at once


class Stop(Message, frozen=True, tag="stop"):
    pass


class Ready(Message, frozen=True, tag="ready"):
    pid: int
    kinds: list[KindInfo]


class BootFailed(Message, frozen=True, tag="boot_failed"):
    message: str


class Done(Message, frozen=True, tag="done"):
    job_id: int
    fence: int
    # On the wire as "kind" (its name before the rename), so that a worker of one
    # release still talks to a supervisor of the other.
    verdict: Verdict = msgspec.field(name="kind")
    duration_s: float
    result: bytes | None = None  # JSON text of the handler's return value
    error_class: str | None = None
    error_message: str | None = None
    traceback: str | None = None
    after_s: float | None = None
    fingerprint: str | None = None  # of the error (pgjobd.fingerprint), if any

    def outcome(self, job: ClaimedJob) -> Outcome:
        """This report as the Outcome of `job` (the attempt it reports), for the completer."""
        return Outcome(
            job, self.verdict, duration_s=self.duration_s, result=self.result,
            error_class=self.error_class, error_message=self.error_message,
            traceback=self.traceback, after_s=self.after_s, fingerprint=self.fingerprint,
        )  # fmt: skip


class ResultsWanted(Message, frozen=True, tag="results_wanted"):
    """A handler awaits ctx.results(): the parent reads them from the database."""

    job_id: int
    fence: int


class Results(Message, frozen=True, tag="results"):
    """The answer to ResultsWanted: JSON text {"id": result}, or why there is none."""

    job_id: int
    fence: int
    results: bytes | None = None
    error: str | None = None


ToChild = Run | Cancel | Stop | Results
ToParent = Ready | BootFailed | Done | ResultsWanted

M = TypeVar("M")

_encoder = msgspec.msgpack.Encoder()


def encode_frame(message: Message) -> bytes:
    """The message as one frame: length header and body, ready for a single write."""
    body = _encoder.encode(message)
    if len(body) > MAX_FRAME:
        raise ProtocolError(f"a {type(message).__name__} frame of {len(body)} bytes is too big")
    return HEADER.pack(len(body)) + body


def frame_length(header: bytes | bytearray, offset: int = 0) -> int:
    """The body length the frame header at `offset` announces; ProtocolError if over
    MAX_FRAME."""
    (length,) = HEADER.unpack_from(header, offset)
    if length > MAX_FRAME:
        raise ProtocolError(f"frame of {length} bytes announced, over the {MAX_FRAME} limit")
    return int(length)


# How much one read takes from a pipe at most (what a Linux pipe holds by default).
READ_CHUNK = 65536


class FrameBuffer:
    """Input read in whole chunks, up to what the pipe holds: the frames of a chunk are
    taken from it without a read each (the other side writes what it has in one write).
    Both ends use it."""

    def __init__(self) -> None:
        self._data = bytearray()
        self._start = 0  # where the next frame begins: taken frames are dropped per chunk

    def feed(self, chunk: bytes) -> bool:
        """Add a chunk read from the pipe; False at the end of input (an empty chunk),
        ProtocolError if the input ended inside a frame."""
        if not chunk:
            self._check_ended()
            return False
        if self._start:
            del self._data[: self._start]
            self._start = 0
        self._data += chunk
        return True

    def next_body(self) -> bytes | None:
        """The body of the next frame, taken; None if it is not all there yet
        (ProtocolError as soon as its header announces too much)."""
        start = self._start
        if len(self._data) - start < HEADER.size:
            return None
        end = start + HEADER.size + frame_length(self._data, start)
        if len(self._data) < end:
            return None
        self._start = end
        return bytes(self._data[start + HEADER.size : end])

    def _check_ended(self) -> None:
        left = len(self._data) - self._start
        if left >= HEADER.size:
            length = frame_length(self._data, self._start)
            raise ProtocolError(f"input ended inside a frame of {length} bytes")
        if left:
            raise ProtocolError("input ended inside a frame header")


class Decoder(Generic[M]):
    """Decodes frame bodies into one side's incoming messages."""

    def __init__(self, incoming: Any) -> None:
        self._decoder: msgspec.msgpack.Decoder[M] = msgspec.msgpack.Decoder(incoming)

    def decode(self, body: bytes) -> M:
        try:
            return self._decoder.decode(body)
        except msgspec.DecodeError as e:
            raise ProtocolError(f"undecodable frame: {e}") from None


class ChildChannel:
    """The child's end: plain asyncio streams over the two file descriptors of the pipes.

    Frames are whole when written, so tasks sending concurrently never interleave them;
    the frames sent during one turn of the event loop leave in a single write.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._decoder: Decoder[ToChild] = Decoder(ToChild)
        self._frames = FrameBuffer()
        self._unsent: list[bytes] = []
        # Called when a write finds the pipe broken (the frames are lost): the worker
        # exits rather than hold jobs whose outcomes can never reach the parent.
        self.on_broken: Callable[[], None] | None = None

    @classmethod
    async def open(cls, read_fd: int, write_fd: int) -> ChildChannel:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(loop=loop)
        await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(read_fd, "rb", buffering=0)
        )
        transport, protocol = await loop.connect_write_pipe(
            asyncio.streams.FlowControlMixin, os.fdopen(write_fd, "wb", buffering=0)
        )
        writer = asyncio.StreamWriter(transport, protocol, reader, loop)
        return cls(reader, writer)

    async def send(self, message: Message) -> None:
        if not self._unsent:
            asyncio.get_running_loop().call_soon(self._write_unsent)
        self._unsent.append(encode_frame(message))
        transport = self._writer.transport
        if transport.get_write_buffer_size() or transport.is_closing():
            await self._writer.drain()  # the pipe is backed up (or gone: drain raises)

    def _write_unsent(self) -> None:
        frames, self._unsent = self._unsent, []
        if not self._writer.is_closing():
            self._writer.write(b"".join(frames))
        if self._writer.is_closing() and self.on_broken is not None:
            self.on_broken()

    async def receive(self) -> ToChild:
        """The next message; EOFError at a clean end of input, ProtocolError at a bad one."""
        while (body := self._frames.next_body()) is None:
            if not self._frames.feed(await self._reader.read(READ_CHUNK)):
                raise EOFError
        return self._decoder.decode(body)

    def close(self) -> None:
        self._writer.close()
